"""minillm.text.sentencepiece and SentencePiece GGUF files through Tokenizer.from_gguf: the Python loop on
toy scores (best score first, leftmost on a tie, byte fallback), the merges the scores imply, the
backend equal to the loop, the GGUF metadata checks, and StreamDecoder equal to decode on Llama 2's
vocabulary (the space SentencePiece puts in front dropped, as decode drops it). llama.cpp's own tests
of these vocabularies are in test_llama_cpp_vocab.py."""

from __future__ import annotations

import codecs
import lzma
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders

from support import DATA
from minillm.text.sentencepiece import (SPACE, FirstSpaceDropped, merges_from_scores, piece_bytes,
                                        sentencepiece_backend, sentencepiece_flags, spm_encode)
from minillm.text.tokenizer import StreamDecoder, Tokenizer
from minillm.weights.embedded import embedded_gguf_path

BYTES = [f"<0x{b:02X}>" for b in range(256)]
TOY = {"<unk>": 0.0, "<s>": 0.0, "</s>": 0.0, "<|user|>": 0.0, **dict.fromkeys(BYTES, 0.0),
       SPACE: -9.0, "a": -9.0, "b": -9.0, "c": -9.0, f"{SPACE}a": -1.0, "ab": -2.0, "bc": -0.5, "aa": -3.0,
       f"{SPACE}{SPACE}": -5.0, f"{SPACE}ab": -4.0}
TOY_TYPES = (2, 3, 3, 4) + (6,) * 256 + (1,) * (len(TOY) - 260)  # unknown, control, user-defined, bytes, normal
TOY_TOKENS, TOY_SCORES = tuple(TOY), tuple(TOY.values())


def test_piece_bytes():
    assert piece_bytes(f"{SPACE}Hello") == b" Hello"
    assert piece_bytes("<0x0A>") == b"\n" and piece_bytes("<0xff>") == b"\xff"
    assert piece_bytes("<s>") == b"<s>" and piece_bytes("<0x0A>x") == b"<0x0A>x"  # not a byte token
    assert piece_bytes(f"{SPACE}世") == " 世".encode()


def test_spm_encode_best_score_first_leftmost_on_a_tie_bytes_for_the_rest():
    assert spm_encode("abc", TOY) == [f"{SPACE}a", "bc"]  # 'bc' (-0.5) before '▁a' (-1): 'ab' never forms
    assert spm_encode("ab", TOY) == [f"{SPACE}ab"]  # '▁a' (-1), then '▁ab'
    assert spm_encode("baaa", TOY, add_space_prefix=False) == ["b", "aa", "a"]  # two 'aa' pairs: the leftmost
    assert spm_encode("z€", TOY) == [SPACE, "<0x7A>", "<0xE2>", "<0x82>", "<0xAC>"]  # no token: its bytes
    assert spm_encode(" a", TOY) == [SPACE, f"{SPACE}a"]  # the prefix, then the text's own space
    assert spm_encode("", TOY) == [] and spm_encode("a", TOY, add_space_prefix=False) == ["a"]


def test_merges_from_scores_rank_by_the_joined_tokens_score():
    tokens = list(TOY)
    merges = merges_from_scores(tokens, list(TOY.values()))
    assert merges[:3] == [("b", "c"), (SPACE, "a"), ("a", "b")]
    assert merges.index((f"{SPACE}a", "b")) < merges.index((SPACE, "ab"))  # one token, two cuts: longer left first
    assert ("<", "s>") not in merges  # both halves must be tokens


@pytest.mark.parametrize("prefix", [True, False])
def test_the_backend_encodes_as_spm_encode_and_decodes_back(prefix):
    backend = sentencepiece_backend(list(TOY), list(TOY.values()), add_space_prefix=prefix, unk_token="<unk>")
    for text in ["abc", "ab", "baaa", "z€ ab  c", " a", "", "a\n", "  "]:
        encoding = backend.encode(text)
        assert encoding.tokens == spm_encode(text, TOY, add_space_prefix=prefix), text
        assert backend.decode(encoding.ids) == text


def write_spm_gguf(path, tokens=TOY_TOKENS, scores=TOY_SCORES, types=TOY_TYPES, model="llama", **extra):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(list(tokens))
    if scores is not None:
        writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in extra.items():
        writer.add_bool(f"tokenizer.ggml.{key}", value) if isinstance(value, bool) else writer.add_string(
            f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_from_gguf_reads_a_sentencepiece_vocabulary(tmp_path):
    tok = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "spm.gguf"))
    assert tok.sentencepiece and tok.space_prefix and tok.vocab_size == len(TOY)
    assert (tok.bos_token, tok.eos_token, tok.eos_token_ids) == ("<s>", "</s>", (2,))
    ids = tok.encode("<s>ab<|user|>abc")
    assert [tok.id_to_token(i) for i in ids] == ["<s>", f"{SPACE}ab", "<|user|>", f"{SPACE}a", "bc"]
    assert tok.special_ids == {1, 2}  # control tokens; '<|user|>' (user-defined) is matched whole, not special
    assert tok.decode(tok.encode("ab c")) == "ab c" and tok.token_bytes(tok.token_to_id(f"{SPACE}ab")) == b" ab"
    assert tok.decode(ids, skip_special_tokens=True) == "ab<|user|> abc"  # a '▁' after an added token, as llama.cpp


def test_add_space_prefix_false_is_honoured(tmp_path):
    tok = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "spm.gguf", add_space_prefix=False))
    assert not tok.space_prefix and [tok.id_to_token(i) for i in tok.encode("ab c")] == ["ab", SPACE, "c"]
    assert tok.decode(tok.encode(" ab")) == " ab"


@pytest.mark.parametrize("change, match", [
    (dict(scores=None), "missing tokenizer.ggml.scores"),
    (dict(scores=TOY_SCORES[:-1]), r"scores must be one finite number per token \(270 tokens, 269 scores\)"),
    (dict(scores=(float("nan"),) + TOY_SCORES[1:]), "scores must be one finite number per token"),
    (dict(add_space_prefix="yes"), "add_space_prefix must be a bool, got 'yes'"),
    (dict(model="t5"), r"tokenizer.ggml.model is 't5'; supported: 'gpt2' \(byte-level BPE\) and 'llama' \(SentencePiece\)"),
    (dict(model="bert"), "tokenizer.ggml.model is 'bert'; supported"),
])
def test_bad_sentencepiece_metadata_is_named(tmp_path, change, match):
    path = write_spm_gguf(tmp_path / "bad.gguf", **change)
    with pytest.raises(ValueError, match=match) as info:
        Tokenizer.from_gguf(path)
    assert str(info.value).startswith(str(path))


# ---------------------------------------------------------------- streaming a SentencePiece reply


@pytest.fixture(scope="module")
def llama2(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "ggml-vocab-llama-spm.gguf"
    path.write_bytes(lzma.decompress((DATA / "llama-cpp-vocab/ggml-vocab-llama-spm.gguf.xz").read_bytes()))
    return Tokenizer.from_gguf(path)


def stream(tok, ids, skip_special_tokens=False) -> list[str]:
    decoder = StreamDecoder(tok, skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def test_a_streamed_reply_drops_the_space_in_front_as_decode_does(llama2):
    ids = llama2.encode("Sure 👍🏽 鑫淼！")
    pieces = stream(llama2, ids)
    assert pieces[:2] == ["Sure", " "] and "".join(pieces) == llama2.decode(ids) == "Sure 👍🏽 鑫淼！"
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(stream(llama2, [1, *ids])) == llama2.decode([1, *ids]) == "<s> Sure 👍🏽 鑫淼！"  # '<s>' came first
    assert "".join(stream(llama2, [1, *ids], skip_special_tokens=True)) == "Sure 👍🏽 鑫淼！"


def test_planted_bug_streaming_without_dropping_the_space_is_caught(llama2):
    ids = llama2.encode("Sure")
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # what StreamDecoder had before
    assert "".join(utf8.decode(llama2.token_bytes(i)) for i in ids) == " Sure" != llama2.decode(ids)
    dropped = FirstSpaceDropped(codecs.getincrementaldecoder("utf-8")(errors="replace"))
    assert "".join(dropped.decode(llama2.token_bytes(i)) for i in ids) == "Sure"


def test_invalid_utf8_decodes_as_python_and_the_stream_read_it(llama2):
    """tokenizers' ByteFallback makes a run of byte tokens that is not valid UTF-8 one U+FFFD per byte, valid
    ones included; decode reads the bytes as Python does (as StreamDecoder does, and a reader of llama.cpp's
    output bytes would): only the invalid part becomes U+FFFD."""
    ids = [llama2.token_to_id("<0x00>"), llama2.token_to_id("<0x80>"), llama2.token_to_id("▁ok")]
    assert llama2.decode(ids) == "".join(stream(llama2, ids)) == b"\x00\x80 ok".decode(errors="replace") == "\x00\ufffd ok"
    assert llama2.backend.decode(ids) == "\ufffd\ufffd ok"  # tokenizers' own decoder, which decode does not use


@settings(max_examples=100, deadline=None, database=None)
@given(ids=st.lists(st.integers(0, 31999), max_size=30))
def test_stream_decoder_any_ids_equals_decode(llama2, ids):
    """Even for arbitrary ids (bos/eos, lone byte tokens, '▁' first), the stream's text equals decode's."""
    assert "".join(stream(llama2, ids)) == llama2.decode(ids)
    assert "".join(stream(llama2, ids, skip_special_tokens=True)) == llama2.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- a Hugging Face folder of a SentencePiece model


def test_a_sentencepiece_folder_streams_its_text_not_its_pieces(llama2, tmp_path):
    """transformers writes Llama 2's tokenizer.json (Metaspace pre-tokenizer; decoder Replace, ByteFallback,
    Fuse, Strip); from_folder reads the flags from its decoder, so token_bytes and the stream see spaces and
    bytes, not '▁' and '<0x0A>'. Its ids are transformers' (whose prefix rule differs from llama.cpp's)."""
    from transformers import AutoTokenizer

    path = Path(llama2.source)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf.save_pretrained(tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    assert (tok.sentencepiece, tok.space_prefix) == (True, True)
    text = "Hello world\n  🦙 ok"
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert "".join(stream(tok, ids)) == tok.decode(ids) == hf.decode(ids) == text
    assert tok.token_bytes(tok.token_to_id("<0x0A>")) == b"\n" and tok.token_bytes(tok.token_to_id("▁Hello")) == b" Hello"


def test_sentencepiece_flags_read_the_decoder():
    smol = Tokenizer.from_gguf(embedded_gguf_path())
    assert sentencepiece_flags(smol.backend) == {"sentencepiece": False, "space_prefix": False}  # ByteLevel
    backend = sentencepiece_backend(TOY_TOKENS, TOY_SCORES, add_space_prefix=False)
    assert sentencepiece_flags(backend) == {"sentencepiece": True, "space_prefix": False}
    backend.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    assert sentencepiece_flags(backend) == {"sentencepiece": True, "space_prefix": True}
    backend.decoder = None
    assert sentencepiece_flags(backend) == {"sentencepiece": False, "space_prefix": False}
