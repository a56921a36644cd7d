"""Automatic checks for the classroom exercises (plumbing, not a lesson): the front door.

Each check takes a student's function or class, runs it on small inputs, compares with torch
(or with a few lines of reference math written here), prints PASS or FAIL with the first wrong
element and the likely cause, and returns True or False. The same checks grade the reference
package: `check.rms_norm(minillm.layers.rms_norm)` passes.

In an exercise notebook:      from minillm import check; check.rms_norm(rms_norm)
From the command line:        python -m minillm.check exercises/04_norm_mlp.ipynb
                              python -m minillm.check submissions/        (every notebook in a folder)
                              python -m minillm.check my_layers.py        (a student's module)

The checks live in minillm/check_model.py (notebooks 01-05) and minillm/check_serving.py (08-13),
on the harness of minillm/check_harness.py; this module names them (CHECKS) and runs them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
from pathlib import Path
from typing import Callable

from minillm.check_harness import CheckFailed
from minillm.check_model import (
    apply_rope,
    attention_forward,
    attention_weights,
    causal_mask,
    contiguous_strides,
    decoder_layer_forward,
    expand,
    matmul,
    mlp_forward,
    rms_norm,
    rope_cos_sin,
    rotate_half,
    scaled_dot_product_attention,
    transpose,
)
from minillm.check_serving import (
    batch_layout,
    dequantize_q4_1,
    gather_reference,
    kv_cache_update,
    min_p_filter,
    quantize_int4,
    top_k_filter,
    top_p_filter,
)

__all__ = [
    "contiguous_strides", "transpose", "expand", "matmul",
    "causal_mask", "attention_weights", "scaled_dot_product_attention",
    "rotate_half", "rope_cos_sin", "apply_rope",
    "rms_norm", "mlp_forward", "attention_forward", "decoder_layer_forward",
    "kv_cache_update", "gather_reference", "batch_layout", "top_k_filter", "top_p_filter", "min_p_filter", "quantize_int4", "dequantize_q4_1",
    "CheckFailed", "CHECKS", "check_namespace", "check_path", "main",
]


# ------------------------------------------------------------------ the command line

CHECKS: dict[str, Callable[[object], bool]] = {
    "contiguous_strides": contiguous_strides, "transpose": transpose, "expand": expand, "matmul": matmul,
    "causal_mask": causal_mask, "attention_weights": attention_weights,
    "scaled_dot_product_attention": scaled_dot_product_attention,
    "rotate_half": rotate_half, "rope_cos_sin": rope_cos_sin, "apply_rope": apply_rope,
    "rms_norm": rms_norm, "MLP.forward": mlp_forward,
    "Attention.forward": attention_forward, "DecoderLayer.forward": decoder_layer_forward,
    "KVCache.update": kv_cache_update, "gather_reference": gather_reference, "batch_layout": batch_layout,
    "top_k_filter": top_k_filter, "top_p_filter": top_p_filter, "min_p_filter": min_p_filter,
    "quantize_int4": quantize_int4, "dequantize_q4_1": dequantize_q4_1,
}
"""Exercise name (a function, or Class.method) -> its check, which takes the function or the class."""

_EXPORT = re.compile(r"^#\|\s*export")


def check_namespace(ns: dict, names: list[str] | None = None) -> tuple[int, int]:
    """Run the checks for `names` (default: every checkable name defined in ns); return (passed, total)."""
    if names is None:  # the checkable names the code defines itself (not those it imports)
        names = [n for n in CHECKS
                 if getattr(ns.get(n.split(".")[0]), "__module__", None) == ns.get("__name__", "__main__")]
    passed = 0
    for name in names:
        obj = ns.get(name.split(".")[0])
        if obj is None:
            print(f"FAIL {name}: not defined")
            continue
        passed += CHECKS[name](obj)
    return passed, len(names)


def _notebook_code(path: Path) -> tuple[str, list[str] | None]:
    """The code of a notebook's module cells (exercise cells tagged 'module', or '#| export' cells), and its stubs."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    chunks = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        src = cell.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        tagged = "module" in cell.get("metadata", {}).get("tags", [])
        if tagged or any(_EXPORT.match(line) for line in src.splitlines()):
            chunks.append("\n".join(line for line in src.splitlines() if not line.startswith("#|")))
    stubs = nb.get("metadata", {}).get("minillm", {}).get("stubs")
    lines = "\n\n".join(chunks).splitlines()  # several modules' cells: their __future__ imports go first
    future = [line for line in lines if line.startswith("from __future__ import")]
    return "\n".join([*dict.fromkeys(future), *(line for line in lines if line not in future)]), stubs


def check_path(path: str | Path) -> tuple[int, int]:
    """Load a student's notebook (.ipynb) or module (.py) and run every check it has code for."""
    path = Path(path)
    if path.suffix == ".ipynb":
        code, stubs = _notebook_code(path)
    else:
        code, stubs = path.read_text(encoding="utf-8"), None
    name = "minillm_student_" + re.sub(r"\W", "_", path.stem)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # dataclasses look their module up
    try:
        exec(compile(code, str(path), "exec"), module.__dict__)
    except Exception as exc:
        print(f"FAIL {path}: its code does not run: {type(exc).__name__}: {exc}")
        return 0, len(stubs or []) or 1
    finally:
        sys.modules.pop(name, None)
    return check_namespace(module.__dict__, stubs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.check",
                                     description="Check exercise notebooks or student modules.")
    parser.add_argument("paths", nargs="+", type=Path, help="exercise notebooks, .py modules, or folders of them")
    args = parser.parse_args(argv)
    files: list[Path] = []
    for p in args.paths:
        if p.is_dir():
            files += sorted(q for q in p.rglob("*") if q.suffix in (".ipynb", ".py") and ".ipynb_checkpoints" not in q.parts)
        elif p.exists():
            files.append(p)
        else:
            print(f"error: {p} does not exist", file=sys.stderr)
            return 2
    results = []
    for f in files:
        print(f"== {f}")
        results.append((f, *check_path(f)))
    if len(results) > 1:
        print("\nsummary")
        for f, passed, total in results:
            print(f"  {passed}/{total}  {f}")
    return 0 if all(p == t for _, p, t in results) else 1


if __name__ == "__main__":
    sys.exit(main())
