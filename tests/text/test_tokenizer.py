"""minillm.text.tokenizer against tiktoken (Qwen), transformers (SmolLM2 GGUF, chat templates) and
data/smollm2/reference.json; bad input; planted bugs that the comparisons must catch."""

from __future__ import annotations

import json
import unicodedata

import jinja2
import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, normalizers

from support import ROOT
from minillm.text.chat_template import render_chat
from minillm.weights.embedded import embedded_gguf_path
from minillm.text.tokenizer import (
    QWEN_ADDED_TOKENS,
    QWEN_PATTERN,
    StreamDecoder,
    Tokenizer,
    bpe,
    bytes_to_unicode,
    load_tiktoken_ranks,
    merges_from_ranks,
    qwen_tiktoken_path,
    spell,
    split_pre_tokenizer,
    unspell,
)

REFERENCE = json.loads((ROOT / "data/smollm2/reference.json").read_text(encoding="utf-8"))

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've GOT IT'S done, haven't they?",
    "大型语言模型通过预测下一个词元来生成文本。分词器把文字变成数字。",
    "日本語のテキストも、한국어도 됩니다. Ünïcödé: naïve café, Ελληνικά, русский, עברית",
    "def f(x):\n    return x ** 2  # square\n\n\n\nclass A:\n\tpass\n",
    "if (a != b && c >= 0) { y += 1; }\t\t// tabs\r\n",
    "emoji 👋🏽👨‍👩‍👧 ❤️ 🇨🇳 🤗🤗🤗",
    "   leading and trailing spaces   ",
    "\n\n\r\n  \n        \n",
    "1234567890 3.14159 1e-6 0x7FFF",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "e\u0301 vs \u00e9, \ufb01 ligature, \u212b angstrom",
    "",
]


@pytest.fixture(scope="module")
def ranks():
    return load_tiktoken_ranks(qwen_tiktoken_path())


@pytest.fixture(scope="module")
def qwen():
    return Tokenizer.from_qwen_tiktoken()


@pytest.fixture(scope="module")
def tiktoken_qwen(ranks):
    specials = {t: len(ranks) + i for i, t in enumerate(QWEN_ADDED_TOKENS)}
    return tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="module")
def smol():
    return Tokenizer.from_gguf(embedded_gguf_path())


def tiktoken_ids(enc, text):
    return enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")


def stream(tokenizer, ids, **kw):
    decoder = StreamDecoder(tokenizer, **kw)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


# byte alphabet and BPE -----------------------------------------------------------------


def test_bytes_to_unicode_matches_transformers():
    from transformers.convert_slow_tokenizer import bytes_to_unicode as hf_bytes_to_unicode

    assert bytes_to_unicode() == hf_bytes_to_unicode()
    every_byte = bytes(range(256))
    assert unspell(spell(every_byte)) == every_byte
    assert spell(b" hi\n") == "\u0120hi\u010a"


def test_bpe_toy_ranks_and_merges():
    # 'ab' (rank 3) and 'bc' (rank 4) both exist; 'abc' (5) is made from 'ab' + 'c' because BPE merges 'ab' first
    toy = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert bpe(b"abc", toy) == [b"abc"]
    assert bpe(b"abc", toy, max_rank=5) == [b"ab", b"c"]
    assert bpe(b"bcab", toy) == [b"bc", b"ab"]
    assert merges_from_ranks(toy) == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c")]
    with pytest.raises(ValueError, match="not a merge"):
        merges_from_ranks({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


def test_load_tiktoken_ranks_errors(tmp_path):
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(b"IQ== 0\nnot-base64! 1\n")
    with pytest.raises(ValueError, match="line 2"):
        load_tiktoken_ranks(bad)
    gap = tmp_path / "gap.tiktoken"
    gap.write_bytes(b"IQ== 0\nIg== 2\n")
    with pytest.raises(ValueError, match="ranks must be"):
        load_tiktoken_ranks(gap)


# Qwen ----------------------------------------------------------------------------------


def test_qwen_known_ids(qwen):
    assert qwen.encode("Hello world") == [9707, 1879]
    assert [qwen.token_to_id(t) for t in QWEN_ADDED_TOKENS[:3]] == [151643, 151644, 151645]
    assert qwen.encode("<|im_start|>user\nhi<|im_end|>")[0] == 151644
    assert qwen.vocab_size == 151665
    assert qwen.eos_token_ids == (151645, 151643)
    assert qwen.token_to_id("no such token") is None


@pytest.mark.parametrize("text", CORPUS)
def test_qwen_matches_tiktoken(qwen, tiktoken_qwen, text):
    ids = qwen.encode(text)
    assert ids == tiktoken_ids(tiktoken_qwen, text)
    assert qwen.decode(ids) == tiktoken_qwen.decode(ids) == unicodedata.normalize("NFC", text)


def test_qwen_skip_special_tokens(qwen, tiktoken_qwen):
    ids = qwen.encode("<|im_start|>user\nhi<|im_end|>\n<tool_call>")
    assert qwen.decode(ids, skip_special_tokens=True) == "user\nhi\n<tool_call>"  # <tool_call> is not special
    assert "".join(stream(qwen, ids, skip_special_tokens=True)) == "user\nhi\n<tool_call>"


def test_qwen_chat_template(qwen):
    ids = qwen.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert qwen.decode(ids) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[:1] == [151644] and ids[-3:] == qwen.encode("<|im_start|>assistant\n")[-3:]


def test_planted_bug_naive_merges_caught(ranks, tiktoken_qwen):
    """Merging at the first split whose halves are tokens (not BPE's split) changes the ids."""
    naive = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            lower = [
                i for i in range(1, len(token)) if max(ranks.get(token[:i], rank), ranks.get(token[i:], rank)) < rank
            ]
            i = lower[0]
            naive.append((spell(token[:i]), spell(token[i:])))
    backend = BackendTokenizer(models.BPE(vocab={spell(t): r for t, r in ranks.items()}, merges=naive))
    backend.normalizer, backend.pre_tokenizer = normalizers.NFC(), split_pre_tokenizer(QWEN_PATTERN)
    wrong = [t for t in CORPUS if backend.encode(t).ids != tiktoken_ids(tiktoken_qwen, t)]
    assert len(wrong) >= 5


def test_planted_bug_no_nfc_caught(tiktoken_qwen):
    no_nfc = Tokenizer.from_qwen_tiktoken()
    no_nfc.backend.normalizer = None
    assert no_nfc.encode("e\u0301") != tiktoken_ids(tiktoken_qwen, "e\u0301")


# SmolLM2 (GGUF) and chat templates ------------------------------------------------------


@pytest.mark.parametrize("n", range(len(REFERENCE["prompts"])))
def test_smollm2_reference_chats(smol, n):
    prompt = REFERENCE["prompts"][n]
    assert smol.chat_text(prompt["messages"]) == prompt["rendered"]
    assert smol.apply_chat_template(prompt["messages"]) == prompt["prompt_ids"]
    assert smol.decode(prompt["prompt_ids"]) == prompt["rendered"]


def test_smollm2_matches_transformers_gguf(smol):
    from transformers import AutoTokenizer

    path = embedded_gguf_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in CORPUS:
        assert smol.encode(text) == hf(text, add_special_tokens=False).input_ids, text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    for gen in (True, False):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert smol.chat_text(messages, gen) == expected
    assert smol.eos_token_ids == (hf.eos_token_id,) == (2,)


def test_from_folder_round_trip_and_missing(smol, tmp_path):
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": smol.chat_template}], "eos_token": "<|im_end|>"})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    again = Tokenizer.from_folder(tmp_path)
    assert again.eos_token_ids == (2, 0)
    assert again.apply_chat_template(REFERENCE["prompts"][0]["messages"]) == REFERENCE["prompts"][0]["prompt_ids"]
    with pytest.raises(FileNotFoundError) as info:
        Tokenizer.from_folder(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere" / "tokenizer.json") in str(info.value)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_from_gguf_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match="junk.gguf"):
        Tokenizer.from_gguf(junk)


def test_render_chat_helpers_like_transformers():
    template = "{{ messages | tojson }}{% if messages | length > 1 %}{{ raise_exception('only one') }}{% endif %}"
    assert render_chat(template, [{"role": "user", "content": "<b>世界</b>"}]) == (
        '[{"role": "user", "content": "<b>世界</b>"}]'  # no HTML escaping, no \\u escapes
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="only one"):
        render_chat(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    one = [{"role": "user", "content": "x"}]
    assert render_chat("{{ bos_token }}{{ messages[0].content }}", one, bos_token="<s>") == "<s>x"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{{ raise_exception.__globals__.keys() | list }}",
        "{% for c in ''.__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    ],
)
def test_render_chat_sandbox(template):
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat(template, [{"role": "user", "content": "hi"}])


def test_render_chat_sandbox_prints_nothing_unsafe():
    # an unsafe attribute that is only printed becomes an empty Undefined: nothing leaks
    assert render_chat("[{{ raise_exception.__globals__ }}]", [{"role": "user", "content": "hi"}]) == "[]"


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "messages must be a list"),
        ({"role": "user", "content": "hi"}, "messages must be a list"),
        ([], "empty"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be a dict"),
        ([{"content": "a"}], r"messages\[0\]\['role'\].*missing"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\]\['content'\].*missing"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\].*int"),
    ],
)
def test_bad_messages(smol, messages, match):
    with pytest.raises(ValueError, match=match):
        smol.apply_chat_template(messages)


def test_bad_ids_and_text(smol):
    with pytest.raises(ValueError, match="token id 49152"):
        smol.decode([1, 49152])
    with pytest.raises(ValueError, match="token id -1"):
        StreamDecoder(smol).push(-1)
    with pytest.raises(TypeError):
        smol.decode([1.5])
    with pytest.raises(TypeError, match="text must be a str"):
        smol.encode(b"bytes")


# streaming ------------------------------------------------------------------------------

TEXT = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0x20, max_codepoint=0x7E),
        st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
        st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
        st.sampled_from(["\n", "\t", " ", "\u200d", "\ufe0f", "\u0301", "é", "ß"]),
        st.characters(codec="utf-8", exclude_characters="\ufffd"),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None, database=None)
@given(text=TEXT)
def test_stream_decoder_property(qwen, tiktoken_qwen, text):
    ids = qwen.encode(text)
    assert ids == tiktoken_ids(tiktoken_qwen, text)
    pieces = stream(qwen, ids)
    assert "".join(pieces) == qwen.decode(ids) == unicodedata.normalize("NFC", text)
    assert not any("\ufffd" in p for p in pieces)


@settings(max_examples=100, deadline=None, database=None)
@given(ids=st.lists(st.integers(0, 151664), max_size=30))
def test_stream_decoder_any_ids_equals_decode(qwen, ids):
    """Even for arbitrary ids (invalid UTF-8), the stream's text equals decode's."""
    assert "".join(stream(qwen, ids)) == qwen.decode(ids)
    assert "".join(stream(qwen, ids, skip_special_tokens=True)) == qwen.decode(ids, skip_special_tokens=True)


def test_planted_bug_per_token_decode_caught(qwen):
    """Decoding each token alone (the naive stream) prints U+FFFD inside split characters."""
    ids = qwen.encode("鑫淼 👍🏽")
    naive = [qwen.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in naive)
    assert not any("\ufffd" in p for p in stream(qwen, ids))


QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_template_kwargs_like_qwen3_enable_thinking(smol, enable_thinking):
    """Extra template variables (Qwen3's enable_thinking) reach the template as in transformers."""
    from transformers import AutoTokenizer

    path = embedded_gguf_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = hf.apply_chat_template(messages, chat_template=QWEN3_STYLE_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True, **kwargs)
    assert render_chat(QWEN3_STYLE_TEMPLATE, messages, add_generation_prompt=True, **kwargs) == expected
    assert ("<think>" in expected) == (enable_thinking is False)


def test_a_merge_outside_the_vocabulary_is_named(tmp_path):
    """From the adversarial probe: a corrupted merge list escaped as tokenizers' bare Exception."""
    raw = embedded_gguf_path().read_bytes()
    merge = (3).to_bytes(8, "little") + b"i n"  # a length-prefixed GGUF string: the merge "i n"
    assert raw.count(merge) == 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(raw.replace(merge, (3).to_bytes(8, "little") + b"i \x01"))  # \x01: not a byte-level symbol
    with pytest.raises(ValueError, match="bad.gguf: tokenizer.ggml.merges does not fit the vocabulary"):
        Tokenizer.from_gguf(bad)
