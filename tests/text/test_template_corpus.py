"""Chat templates nobody here wrote: every template of llama.cpp's models/templates/ (70 models' real
templates, Qwen2.5, Qwen3, QwQ, Qwen3-Coder and Qwen3.5 among them; unpacked from the pinned
llama-cpp-python 0.3.36 sdist by tools/fetch_llama_cpp_vocab.py) rendered by minillm's sandbox (appendix A2's
render_chat) and by transformers' render_jinja_template (what apply_chat_template runs), on the fixed
conversations of data/chat-templates/conversations.json, each with enable_thinking unset and false.

The rule, per template and conversation:
- both render: byte for byte equal;
- transformers raises and minillm renders: only where the conversation offers no tools and transformers
  passes tools=None to a template that loops over it (minillm leaves `tools` undefined, an empty loop);
  minillm's text must then equal transformers' with tools=[] (the one named difference);
- transformers raises otherwise (the template refuses the conversation): minillm raises too, a
  jinja2 TemplateError (what the API and the server report as a clear error), never a raw exception.
"""

from __future__ import annotations

import json

import jinja2
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from minillm.text.chat_template import render_chat
from support import DATA, LLAMA_CPP

TEMPLATES = LLAMA_CPP / "models" / "templates"
FIXTURE = json.loads((DATA / "chat-templates" / "conversations.json").read_text())
SPECIALS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
QWEN = ("Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-QwQ-32B.jinja", "Qwen-Qwen3-0.6B.jinja", "Qwen3-Coder.jinja",
        "Qwen3.5-4B.jinja")
NAMES = sorted(p.name for p in TEMPLATES.glob("*.jinja")) or ["(missing)"]


def cases():
    """(name, messages, tools or None, template kwargs) for each conversation, with and without thinking."""
    for name, messages in FIXTURE["conversations"].items():
        for tools in ([None, FIXTURE["tools"]] if name in ("user", "tool call and result") else [None]):
            for kwargs in ({}, {"enable_thinking": False}):
                yield f"{name}{' +tools' if tools else ''}{' no-think' if kwargs else ''}", messages, tools, kwargs


def reference(template: str, messages, tools, kwargs) -> str:
    return render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=True,
                                 **SPECIALS, **kwargs)[0][0]


def outcome(template: str, messages, tools, kwargs) -> str:
    """'equal', 'tools None' (the named difference) or 'refused by both'; AssertionError otherwise."""
    try:
        theirs, their_error = reference(template, messages, tools, kwargs), None
    except Exception as exc:  # noqa: BLE001 (a template may raise anything)
        theirs, their_error = None, exc
    try:
        ours, our_error = render_chat(template, messages, True, **({"tools": tools} if tools else {}), **SPECIALS,
                                      **kwargs), None
    except Exception as exc:  # noqa: BLE001
        ours, our_error = None, exc
    if their_error is None:
        assert our_error is None, f"transformers renders it, minillm raises {our_error!r}"
        assert ours == theirs, "the two texts differ"
        return "equal"
    if our_error is None:
        assert tools is None and isinstance(their_error, TypeError) and "NoneType" in str(their_error), \
            f"transformers raises {their_error!r}, minillm renders"
        assert ours == reference(template, messages, [], kwargs), "minillm differs from transformers' tools=[]"
        return "tools None"
    assert isinstance(our_error, jinja2.exceptions.TemplateError), f"minillm raised {our_error!r}, not a TemplateError"
    return "refused by both"


def test_the_corpus_is_there():
    assert TEMPLATES.is_dir(), (f"llama.cpp's chat templates are not in {TEMPLATES}: `make test` fetches them from the "
                                "pinned sdist, or run .venv/bin/python tools/fetch_llama_cpp_vocab.py")
    assert len(NAMES) >= 70 and set(QWEN) <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_template_renders_as_transformers_does(name):
    if name == "(missing)":
        pytest.fail("no templates: see test_the_corpus_is_there", pytrace=False)
    template = (TEMPLATES / name).read_text()
    results = {}
    for case, messages, tools, kwargs in cases():
        try:
            results[case] = outcome(template, messages, tools, kwargs)
        except AssertionError as exc:
            raise AssertionError(f"{name}, conversation {case!r}: {exc}") from None
    if name in QWEN:  # the templates minillm's models use render every conversation, exactly
        assert set(results.values()) == {"equal"}, results
