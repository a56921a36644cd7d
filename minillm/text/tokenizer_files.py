# Generated from notebooks/A2_template_sandbox.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""What a model's files say about its tokenizer, read and checked: the chat templates by name, the
bos/eos tokens and the ids that end a reply.

Built in notebooks/A2_template_sandbox.ipynb, the appendix of notebook 07. A GGUF file keeps its
templates under `tokenizer.chat_template` (and llama.cpp's `tokenizer.chat_template.NAME`); a
Hugging Face folder in tokenizer_config.json, chat_template.json, chat_template.jinja and
additional_chat_templates/. Both are downloaded from whoever published the model, so every value is
checked where it is read: a wrong type, a bad encoding or a template that does not compile is a
ValueError naming the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minillm.text.chat_template import validate_template
from minillm.utils.files import read_json_object, read_text
from minillm.utils.validate import is_int


def gguf_templates(meta: dict[str, Any], path: Path) -> dict[str, str]:
    """`tokenizer.chat_template` (the default) and llama.cpp's named ones (`tokenizer.chat_template.NAME`)."""
    templates = {}
    for key, value in meta.items():
        if key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template."):
            validate_template(value, f"{path}: {key}")  # a syntax error named when the file is loaded
            templates[key.removeprefix("tokenizer.chat_template").lstrip(".") or "default"] = value
    return templates


def config_token(config: dict, key: str, path: Path) -> str | None:
    """A tokenizer_config.json token: a string, or an AddedToken dict with a string 'content'."""
    value = config.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: {key} must be a string or {{'content': string}}, got {config[key]!r:.80}")
    return value


def _templates(value: Any, where: str) -> dict[str, str]:
    """A `chat_template` value by name: one template (the 'default'), or Hugging Face's list of named
    ones, [{"name": "default", "template": ...}, {"name": "tool_use", ...}]; each must compile."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = [{"name": "default", "template": value}]
    if not (isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                            and isinstance(t.get("template"), str) for t in value)):
        raise ValueError(f"{where} must be a string or a list of {{'name': str, 'template': str}}, got {value!r:.80}")
    for t in value:
        validate_template(t["template"], f"{where} {t['name']!r}")
    return {t["name"]: t["template"] for t in value}


def folder_templates(folder: Path, config: dict) -> dict[str, str]:
    """The folder's chat templates by name, read where transformers reads them, a later file winning:
    tokenizer_config.json, chat_template.json, chat_template.jinja, additional_chat_templates/*.jinja."""
    templates = _templates(config.get("chat_template"), f"{folder / 'tokenizer_config.json'}: chat_template")
    if (folder / "chat_template.json").is_file():
        path = folder / "chat_template.json"
        templates.update(_templates(read_json_object(path).get("chat_template"), f"{path}: chat_template"))
    for path in [folder / "chat_template.jinja", *sorted((folder / "additional_chat_templates").glob("*.jinja"))]:
        if path.is_file():
            name = "default" if path.name == "chat_template.jinja" else path.stem
            templates[name] = read_text(path)
            validate_template(templates[name], str(path))
    return templates


def generation_eos_ids(path: Path) -> list[int]:
    """generation_config.json's eos_token_id: an int or a list of ints (none when the file is absent)."""
    if not path.is_file():
        return []
    eos = read_json_object(path).get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r:.80}")
    return ids


def template_named(templates: dict[str, str], name: str | None, source: str, tools: bool = False,
                   default: str | None = None) -> str | None:
    """The template a chat names ('default', 'tool_use', ...), or ValueError listing the names there are;
    without a name, 'tool_use' for a chat with tools when there is one (as transformers picks), else `default`."""
    if name is None:
        return templates["tool_use"] if tools and "tool_use" in templates else default
    if name not in templates:
        raise ValueError(f"{source} has no chat template named {name!r}; it has: {', '.join(map(repr, templates)) or 'none'}")
    return templates[name]
