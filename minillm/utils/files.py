"""Reading the small text files a model folder holds, in one home, so that every bad one is named.

A model folder is downloaded from whoever published it: config.json, tokenizer_config.json,
generation_config.json and chat_template.jinja can be in another encoding, hold a list where an
object belongs, or nest without end. Each reader here raises ValueError naming the file and what is
wrong with it, never UnicodeDecodeError or AttributeError from deep inside a loader.

    config = read_json_object(folder / "config.json")     # a dict, or ValueError naming the file
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_text(path: str | Path) -> str:
    """The file's text, which must be UTF-8 (as Hugging Face writes it), or ValueError naming the file."""
    path = Path(path)
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})") from None


def read_json(path: str | Path) -> Any:
    """The value in a UTF-8 JSON file, or ValueError naming the file and where the JSON breaks."""
    path = Path(path)
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise ValueError(f"{path}: JSON nested too deeply") from None


def read_json_object(path: str | Path) -> dict:
    """A JSON file that must hold an object ({...}), as every Hugging Face config file does."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object {{...}}, got a {type(data).__name__}")
    return data
