"""A model folder's tokenizer files, malformed as a downloaded folder can be: each is refused when the
model loads, with a ValueError naming the file and the key, never an AttributeError or a jinja2
traceback on the first chat. Hugging Face's named templates load and render by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from support import DATA, ROOT, tokenizer_gguf
from minillm.text.tokenizer import Tokenizer
from minillm.weights.embedded import embedded_gguf_path

CHAT = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(embedded_gguf_path())


@pytest.fixture
def folder(tmp_path, smol):
    """A Hugging Face tokenizer folder: SmolLM2's tokenizer.json and a well-formed tokenizer_config.json."""
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    write(tmp_path / "tokenizer_config.json", {"chat_template": smol.chat_template, "eos_token": "<|im_end|>"})
    return tmp_path


def write(path, value) -> None:
    path.write_text(value if isinstance(value, str) else json.dumps(value), encoding="utf-8")


@pytest.mark.parametrize("name, content, message", [
    ("tokenizer_config.json", [], "tokenizer_config.json: must hold a JSON object {...}, got a list"),
    ("tokenizer_config.json", "x", "tokenizer_config.json: not valid JSON"),
    ("tokenizer_config.json", {"chat_template": ["{{ x }}", "{{ y }}"]},
     "tokenizer_config.json: chat_template must be a string or a list of {'name': str, 'template': str}"),
    ("tokenizer_config.json", {"chat_template": [{"name": "default"}]}, "chat_template must be a string or a list"),
    ("tokenizer_config.json", {"chat_template": 7}, "chat_template must be a string or a list"),
    ("tokenizer_config.json", {"eos_token": 2}, "tokenizer_config.json: eos_token must be a string or {'content': string}"),
    ("tokenizer_config.json", {"bos_token": {"content": ["<s>"]}}, "tokenizer_config.json: bos_token must be a string"),
    ("tokenizer_config.json", {"chat_template": "{% for m in messages %}"},
     "tokenizer_config.json: chat_template 'default': the chat template does not compile (line 1:"),
    ("generation_config.json", [1, 2], "generation_config.json: must hold a JSON object {...}, got a list"),
    ("generation_config.json", "x", "generation_config.json: not valid JSON"),
    ("generation_config.json", '"x"', "generation_config.json: must hold a JSON object {...}, got a str"),
    ("generation_config.json", {"eos_token_id": "2"}, "generation_config.json: eos_token_id must be an int or a list"),
    ("generation_config.json", {"eos_token_id": [2, None]}, "eos_token_id must be an int or a list of ints"),
    ("generation_config.json", {"eos_token_id": True}, "eos_token_id must be an int or a list of ints"),
    ("chat_template.jinja", "{% if messages %}{{ messages[0].content }", "chat_template.jinja: the chat template does not compile"),
    ("chat_template.json", {"chat_template": {"default": "x"}}, "chat_template.json: chat_template must be a string or a list"),
    ("additional_chat_templates/tool_use.jinja", "{{ ", "tool_use.jinja: the chat template does not compile"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 and "{" not in v else None)
def test_a_malformed_file_is_refused_at_load_naming_it(folder, name, content, message):
    (folder / name).parent.mkdir(exist_ok=True)
    write(folder / name, content)
    with pytest.raises(ValueError) as caught:
        Tokenizer.from_folder(folder)
    assert message in str(caught.value)
    assert str(folder) in str(caught.value)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json", "chat_template.jinja"])
def test_a_file_that_is_not_utf8_is_refused_naming_it(folder, name):
    (folder / name).write_bytes(b'{"eos_token": "\xff"}')
    with pytest.raises(ValueError, match=rf"{name}: not UTF-8 text \(byte 15 is 0xff\)"):
        Tokenizer.from_folder(folder)


def test_a_config_json_that_is_not_utf8_or_not_an_object_is_named(tmp_path):
    from minillm.model.decoder import ModelConfig

    shutil.copy(DATA / "tiny-llama" / "config.json", tmp_path / "config.json")
    raw = (tmp_path / "config.json").read_bytes()
    (tmp_path / "config.json").write_bytes(raw.replace(b'"llama"', b'"ll\xffama"'))
    with pytest.raises(ValueError, match=r"config.json: not UTF-8 text \(byte \d+ is 0xff\)"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="config.json: must hold a JSON object"):
        ModelConfig.from_json(tmp_path)


def test_named_templates_load_and_render_by_name(folder):
    """Hugging Face's list of named templates: the default renders by default, a name picks another,
    tools pick 'tool_use' as transformers does, and an unknown name lists the names there are."""
    write(folder / "tokenizer_config.json", {"chat_template": [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools[0].function.name }}"}]})
    write(folder / "chat_template.jinja", "J{{ messages[0].content }}")
    (folder / "additional_chat_templates").mkdir()
    write(folder / "additional_chat_templates" / "rag.jinja", "R{{ messages[0].content }}")
    tok = Tokenizer.from_folder(folder)
    assert sorted(tok.chat_templates) == ["default", "rag", "tool_use"]
    assert tok.chat_text(CHAT) == "Jhi"  # chat_template.jinja wins over tokenizer_config.json's default
    assert tok.chat_text(CHAT, template_name="rag") == "Rhi"
    assert tok.chat_text(CHAT, tools=TOOLS) == "Tf"
    assert tok.chat_text(CHAT, template_name="default", tools=TOOLS) == "Jhi"
    with pytest.raises(ValueError, match="has no chat template named 'nope'; it has: 'default', 'tool_use', 'rag'"):
        tok.chat_text(CHAT, template_name="nope")


def test_named_templates_match_transformers(folder, smol):
    """The same folder through transformers' AutoTokenizer: the same names, the same rendering."""
    from transformers import AutoTokenizer

    templates = {"default": smol.chat_template, "tool_use": "{{ tools|length }} tools: {{ messages[0].content }}"}
    write(folder / "tokenizer_config.json", {"chat_template": [{"name": k, "template": v} for k, v in templates.items()],
                                             "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"})
    hf = AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.from_folder(folder)
    assert hf.chat_template == ours.chat_templates
    for kwargs in [{}, {"tools": TOOLS}]:
        assert ours.chat_text(CHAT, **kwargs) == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True,
                                                                         **kwargs)


def test_the_cli_names_a_malformed_generation_config_without_a_traceback(tmp_path, smol):
    """From the hostile-input probe: generation_config.json holding [1, 2] ended `generate` with an
    AttributeError traceback; now the CLI prints one line naming the file."""
    for name in ("config.json", "model.safetensors"):
        shutil.copy(DATA / "tiny-llama" / name, tmp_path / name)
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    write(tmp_path / "generation_config.json", [1, 2])
    run = subprocess.run([sys.executable, "-m", "minillm", "generate", "hi", "--model", str(tmp_path),
                          "--max-new-tokens", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert f"{tmp_path / 'generation_config.json'}: must hold a JSON object" in run.stderr


def test_a_gguf_files_named_templates_are_read(tmp_path):
    path = tokenizer_gguf(tmp_path / "t.gguf", {"default": "D{{ messages[0].content }}", "tool_use": "T"})
    tok = Tokenizer.from_gguf(path)
    assert tok.chat_templates == {"default": "D{{ messages[0].content }}", "tool_use": "T"}
    assert (tok.chat_text(CHAT), tok.chat_text(CHAT, tools=TOOLS)) == ("Dhi", "T")


def test_a_gguf_template_that_does_not_compile_is_refused_at_load(tmp_path):
    path = tokenizer_gguf(tmp_path / "t.gguf", {"default": "{% for m in messages %}{{ m }}"})
    with pytest.raises(ValueError, match=r"t.gguf: tokenizer.chat_template: the chat template does not compile \(line 1"):
        Tokenizer.from_gguf(path)


def test_llm_chat_renders_the_template_a_chat_names(tmp_path):
    """LLM.chat(template_name=...) and the tools path render the named template: the prompt ids the
    model reads are that template's, as Tokenizer.chat_text renders it."""
    from minillm.api import LLM
    from minillm.weights.loading import load_folder

    tok = Tokenizer.from_gguf(tokenizer_gguf(tmp_path / "t.gguf", {
        "default": "D{{ messages[0].content }}", "rag": "R{{ messages[0].content }}",
        "tool_use": "{{ tools[0].function.name }}:{{ messages[0].content }}"}))
    llm = LLM(load_folder(DATA / "tiny-llama", device="cpu"), tok)
    assert llm.encode_chat(CHAT, template_name="rag") == tok.encode("Rhi")
    seen, steps = [], llm._steps
    llm._steps = lambda ids, *args, **kwargs: seen.append(ids) or steps(ids, *args, **kwargs)
    llm.chat(CHAT, template_name="rag", max_new_tokens=1)
    llm.chat(CHAT, tools=TOOLS, max_new_tokens=1)
    llm.chat(CHAT, tools=TOOLS, template_name="default", max_new_tokens=1)
    assert seen[:2] == [tok.encode("Rhi"), tok.encode("f:hi")]
    default = tok.decode(seen[2])  # the default template has no tools: they reach it in a system message
    assert default.startswith("D") and "<tool_call>" in default
    with pytest.raises(ValueError, match="no chat template named 'nope'"):
        llm.chat(CHAT, template_name="nope")
