"""minillm: an educational, notebook-driven implementation of LLM inference in PyTorch.

    import minillm
    llm = minillm.load()                      # the embedded SmolLM2-135M-Instruct
    llm = minillm.load("Qwen/Qwen2.5-0.5B-Instruct")   # a hub id, a folder or a .gguf file
    llm = minillm.load(fast=True, quantize="int4")     # the fast path with int4 weights
    print(llm.chat([{"role": "user", "content": "Hello!"}]).text)

The package is one folder per concept, in layers that import only downward (docs/architecture.md):
utils, model, weights and cache, text and speed, runtime, parallel, then the front doors: api
(`load`, `LLM` with every option, from notebooks/24_qwen_end_to_end.ipynb, on notebook 10's
minillm/runtime/llm.py), serve, bench, check and the CLI (__main__).
"""

from minillm.api import LLM, load
from minillm.runtime.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "load"]
