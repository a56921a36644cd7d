"""llama.cpp's own tokenizer tests, on every vocabulary the GGUF loader accepts.

The data is data/llama-cpp-vocab/ (llama.cpp at 0c1e57098, as vendored in llama-cpp-python 0.3.36;
see its README): per vocabulary a vocabulary-only GGUF file (xz-compressed here), the test texts
(.inp) and the ids the model's reference tokenizer gives them (.out).

- test-tokenizer-0: every text encodes, with no BOS and special tokens not parsed, to llama.cpp's
  ids, for gpt-2, llama-bpe (Llama 3), llama-spm (Llama 1/2), phi-3 and qwen2 (also built from
  qwen.tiktoken); and every text decodes back to itself.
- test-tokenizer-1-spm, on the SentencePiece vocabularies: every token's text (both) and every Unicode
  code point (U+2581 aside; llama-spm, as llama.cpp runs it) encode and decode back.
- The pure-Python `spm_encode` gives llama.cpp's ids too, and the Rust backend equals it on random text.
- transformers' GGUF tokenizer for Phi-3, built the way ours is, agrees with ours.
- Each fix undone fails: no ignore_merges (Llama 3's "Cửa Việt"), Metaspace's prefix rule for
  SentencePiece (the texts that start with a space), no byte fallback.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import normalizers, pre_tokenizers

from support import DATA
from minillm.text.sentencepiece import SPACE, sentencepiece_backend, spm_encode
from minillm.text.tokenizer import Tokenizer
from minillm.weights.gguf_file import read_gguf

VOCABS = DATA / "llama-cpp-vocab"
SHA256 = {  # of llama.cpp's .gguf files, as unpacked (the README lists them too)
    "gpt-2": "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
    "llama-bpe": "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
    "llama-spm": "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
    "phi-3": "967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326",
    "qwen2": "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c",
}
NAMES = tuple(SHA256)
SENTENCEPIECE = ("llama-spm", "phi-3")
SEPARATOR = "\n__ggml_vocab_test__\n"


def vocab_tests(name: str) -> list[tuple[str, list[int]]]:
    """(text, ids) as llama.cpp's read_tests reads them: the texts between separators (the separator
    that ends the file starts no further text), and one line of ids per text."""
    texts = (VOCABS / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8").split(SEPARATOR)
    if texts[-1] == "":
        texts.pop()
    lines = (VOCABS / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").splitlines()
    assert len(texts) == len(lines), name
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def failures(encode, name: str) -> list[tuple[str, list[int], list[int]]]:
    """The test texts that `encode` gets wrong: (text, its ids, llama.cpp's ids)."""
    return [(text, encode(text), ids) for text, ids in vocab_tests(name) if encode(text) != ids]


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory) -> Path:
    """A folder with the five .gguf files unpacked."""
    folder = tmp_path_factory.mktemp("llama-cpp-vocab")
    for name in NAMES:
        data = lzma.decompress((VOCABS / f"ggml-vocab-{name}.gguf.xz").read_bytes())
        (folder / f"ggml-vocab-{name}.gguf").write_bytes(data)
    return folder


@pytest.fixture(scope="module")
def load(unpacked):
    """name -> Tokenizer.from_gguf of that vocabulary, each read once (Qwen2's and Llama 3's take ~10 s)."""
    cache: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in cache:
            cache[name] = Tokenizer.from_gguf(unpacked / f"ggml-vocab-{name}.gguf")
        return cache[name]
    return get


def tokens_and_scores(unpacked: Path, name: str) -> tuple[list[str], list[float]]:
    fields = read_gguf(unpacked / f"ggml-vocab-{name}.gguf").fields
    return fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.scores"].contents()


# ---------------------------------------------------------------- the data


def test_the_files_are_llama_cpps(unpacked):
    for name, digest in SHA256.items():
        assert hashlib.sha256((unpacked / f"ggml-vocab-{name}.gguf").read_bytes()).hexdigest() == digest, name
    texts = {name: [text for text, _ in vocab_tests(name)] for name in NAMES}
    assert {len(t) for t in texts.values()} == {46}
    assert len({tuple(t) for t in texts.values()}) == 1  # the same 46 texts for each vocabulary
    assert "" in texts["qwen2"] and "Cửa Việt" in texts["qwen2"] and len(set(texts["qwen2"])) == 46


# ---------------------------------------------------------------- test-tokenizer-0


@pytest.mark.parametrize("name", NAMES)
def test_every_text_encodes_to_llama_cpps_ids(load, name):
    tok = load(name)
    assert failures(tok.encode, name) == []
    assert tok.sentencepiece == tok.space_prefix == (name in SENTENCEPIECE)


@pytest.mark.parametrize("name", NAMES)
def test_every_text_decodes_back(load, name):
    tok = load(name)
    assert [text for text, _ in vocab_tests(name) if tok.decode(tok.encode(text)) != text] == []


def test_qwen_tiktoken_ranks_pass_the_qwen2_tests():
    assert failures(Tokenizer.from_qwen_tiktoken().encode, "qwen2") == []


# ---------------------------------------------------------------- test-tokenizer-1-spm


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_every_token_round_trips(load, name):
    """Each token's text (special ones written out), encoded with special tokens parsed, decodes back."""
    tok = load(name)
    texts = [tok.decode([i]) for i in range(tok.vocab_size)]
    again = tok.backend.decode_batch([e.ids for e in tok.backend.encode_batch(texts)], skip_special_tokens=False)
    assert [(i, text, back) for i, (text, back) in enumerate(zip(texts, again)) if text != back] == []


def test_every_code_point_round_trips(load):
    """Each code point alone (surrogates and U+40000..U+E0000 skipped, as llama.cpp does) decodes back,
    but '▁', which is how SentencePiece writes a space. On llama-spm, as in llama.cpp (Phi-3's
    vocabulary is Llama 2's, plus added tokens)."""
    tok = load("llama-spm")
    chars = [chr(c) for c in range(0x110000) if not (0xD800 <= c <= 0xDFFF or 0x40000 <= c <= 0xE0000)]
    back = tok.backend.decode_batch([e.ids for e in tok.backend.encode_batch(chars)], skip_special_tokens=False)
    assert [(f"U+{ord(c):04X}", b) for c, b in zip(chars, back) if c != b] == [("U+2581", " ")]


# ---------------------------------------------------------------- the Python loop, the backend, transformers


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_spm_encode_gives_llama_cpps_ids(unpacked, name):
    tokens, scores = tokens_and_scores(unpacked, name)
    ids, table = {t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores))
    assert failures(lambda text: [ids[p] for p in spm_encode(text, table)], name) == []


def test_the_backend_picks_the_pairs_spm_encode_picks(load, unpacked):
    """On seeded random text (space runs with tied scores, unknown characters, '▁' itself) and on
    runs of 1 to 40 spaces, the Rust backend's pieces are the Python loop's."""
    tokens, scores = tokens_and_scores(unpacked, "llama-spm")
    table, backend = dict(zip(tokens, scores)), load("llama-spm").backend
    rng = random.Random(0)
    alphabet = [" ", " ", " ", "\n", "\t", "a", "e", "r", "t", "h", "é", "ự", "世", "界", "🦙", "3", ".", "'", SPACE]
    words = ["the", " the", "Hello", "world", "tokenization", "ing", "    ", "\n\n", "1234", "Việt", "нещо"]
    texts = ["".join(rng.choice(alphabet) if rng.random() < 0.5 else rng.choice(words) for _ in range(rng.randint(0, 30)))
             for _ in range(1000)] + [" " * n + "x" for n in range(1, 41)]
    assert [t for t in texts if backend.encode(t).tokens != spm_encode(t, table)] == []


def test_phi3_agrees_with_transformers(load, unpacked):
    """transformers builds Phi-3's GGUF tokenizer with the normalizer ours uses (Prepend, Replace)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(unpacked), gguf_file="ggml-vocab-phi-3.gguf")
    ours = load("phi-3")
    chat = "<s><|user|>\nHi there<|end|>\n<|assistant|>\n  Sure 👍🏽 鑫淼！</s>"
    texts = [text for text, _ in vocab_tests("phi-3")] + [chat]
    assert [t for t in texts if ours.encode(t) != hf.encode(t, add_special_tokens=False)] == []
    assert ours.decode(ours.encode(chat)) == hf.decode(hf.encode(chat, add_special_tokens=False))


# ---------------------------------------------------------------- each fix undone is caught


def with_model(backend: BackendTokenizer, **changes) -> BackendTokenizer:
    """A copy of the backend with fields of its BPE model changed (through tokenizer.json)."""
    spec = json.loads(backend.to_str())
    spec["model"].update(changes)
    return BackendTokenizer.from_str(json.dumps(spec))


def test_without_ignore_merges_llama3_fails_cua_viet(load):
    tok = load("llama-bpe")
    assert json.loads(tok.backend.to_str())["model"]["ignore_merges"] is True
    planted = with_model(tok.backend, ignore_merges=False)
    wrong = failures(lambda text: planted.encode(text).ids, "llama-bpe")
    assert [(text, [tok.token_bytes(i) for i in ids]) for text, ids, _ in wrong] == [
        ("Cửa Việt", [b"C", "ửa".encode(), b" Vi", "ệ".encode(), b"t"])]


def test_metaspace_prefix_fails_the_texts_that_start_with_a_space(unpacked):
    """transformers' LlamaTokenizer adds the '▁' with Metaspace, only where the text does not start
    with one: 15 of Llama 2's texts, exactly those starting with a space."""
    tokens, scores = tokens_and_scores(unpacked, "llama-spm")
    planted = sentencepiece_backend(tokens, scores, unk_token="<unk>")
    planted.normalizer = None
    planted.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    wrong = [text for text, _, _ in failures(lambda text: planted.encode(text).ids, "llama-spm")]
    assert wrong == [text for text, _ in vocab_tests("llama-spm") if text.startswith(" ")] and len(wrong) == 15
    planted.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    planted.pre_tokenizer = None
    assert failures(lambda text: planted.encode(text).ids, "llama-spm") == []  # the fix, put back


def test_without_byte_fallback_the_unknown_characters_fail(load):
    """A character outside the vocabulary (a newline, an emoji, Khmer) becomes <unk> instead of its bytes."""
    tok = load("llama-spm")
    planted = with_model(tok.backend, byte_fallback=False)
    vocab = tok.backend.get_vocab()
    unknown = [text for text, _ in vocab_tests("llama-spm") if any(c not in vocab for c in text.replace(" ", SPACE))]
    assert [text for text, _, _ in failures(lambda text: planted.encode(text).ids, "llama-spm")] == unknown
    assert len(unknown) >= 10 and any("🦙" in text for text in unknown)
