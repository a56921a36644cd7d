# Generated from notebooks/06_weights.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Opening a GGUF file: the one place in minillm that does, and the one error for a bad weights file.

Built in notebooks/06_weights.ipynb. The weights loader, the quantized loader (notebook 13), the
tokenizer (notebook 07) and the command line all read GGUF files through `read_gguf`, so a
truncated or corrupt file gets the same message everywhere, never an IndexError from the parser.
"""

from __future__ import annotations

from pathlib import Path

import gguf


class WeightsError(ValueError):
    """A weights file or folder that cannot be loaded; the message names the file, tensor and cause."""


def read_gguf(path: str | Path) -> gguf.GGUFReader:
    """A GGUFReader over the file (memory-mapped: nothing is read until used), or WeightsError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, OverflowError) as exc:  # the parser on a bad file
        raise WeightsError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
