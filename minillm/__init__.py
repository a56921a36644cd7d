"""minillm: an educational, notebook-driven implementation of LLM inference in PyTorch.

    import minillm
    llm = minillm.load()                      # the embedded SmolLM2-135M-Instruct
    llm = minillm.load("Qwen/Qwen2.5-0.5B-Instruct")   # a hub id, a folder or a .gguf file
    llm = minillm.load(fast=True, quantize="int4")     # the fast path with int4 weights
    print(llm.chat([{"role": "user", "content": "Hello!"}]).text)

Each module is built in a notebook (see the README); `load` and `LLM` come from
notebooks/10_generate.ipynb (minillm/generate.py).
"""

__version__ = "0.1.0"


def load(model=None, dtype=None, device=None, **options):
    """An LLM from a hub id, a model folder or a .gguf file; default: the embedded SmolLM2-135M-Instruct.

    options: quantize ("int8", "int4", "gguf"), group_size, fast, compile (see minillm.generate.load)."""
    from minillm.generate import load as _load  # imported on use: `import minillm` stays light

    return _load(model, dtype=dtype, device=device, **options)
