"""minillm: an educational, notebook-driven implementation of LLM inference in PyTorch.

    import minillm
    llm = minillm.load()                      # the embedded SmolLM2-135M-Instruct
    llm = minillm.load("Qwen/Qwen2.5-0.5B-Instruct")   # a hub id, a folder or a .gguf file
    llm = minillm.load(fast=True, quantize="int4")     # the fast path with int4 weights
    print(llm.chat([{"role": "user", "content": "Hello!"}]).text)

Each module is built in a notebook (see the README's "How the code is organised"); `load` and
`LLM` are minillm/api.py, from notebooks/10_generate.ipynb.
"""

from minillm.api import LLM, load

__version__ = "0.1.0"
__all__ = ["LLM", "load"]
