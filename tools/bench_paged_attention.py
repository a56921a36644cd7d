"""One layer's attention in a decode step: gather + SDPA against paged attention (FlexAttention).

The measurement of notebook 15's "What it saves" cell, on any device, written to JSON so that the
notebook can quote a run on a machine it does not run on (a GPU):

    python tools/bench_paged_attention.py --device cuda --out docs/bench/paged-attention-h200.json

For each context, dtype and block order, 16 sequences with SmolLM2-135M's attention shapes (9 query
heads, 3 KV heads of 64) sit in a pool of 16-token blocks. "gather" is PagedView.update (write the new
key/value, copy every sequence's blocks into a dense batch) followed by scaled_dot_product_attention;
"paged" is BlockTableView.attend (write, then FlexAttention over the pool through the block tables).
Each is timed as the median of `--repeats` runs of `--inner` calls, after two warm-up calls that
compile. `key_block` and `query_block` are the block mask's block sizes: 4 and 1 as decode_layout
ships them (a CPU workaround, notebook 15's Plumbing); the other layouts are built by the same code
with those numbers changed. `compiled` says whether the compiled kernel served the shape (else attend fell back
to the uncompiled FlexAttention, and `error` says why). The package is imported without
minillm/__init__ (which loads the whole front door), so torch is the only requirement.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import random
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_pkg = types.ModuleType("minillm")
_pkg.__path__ = [str(ROOT / "minillm")]
sys.modules.setdefault("minillm", _pkg)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minillm.cache import paged_attention as pa  # noqa: E402
from minillm.cache.paged import BlockManager, PagedKVCache, PagedView, batch_layout  # noqa: E402

H, HKV, D, B = 9, 3, 64, 16  # SmolLM2-135M's heads; 16 sequences


def layout_with_blocks(kb: int, qb: int):
    """decode_layout with its key block set to `kb` and its query block to `qb` (as shipped: 4 and 1)."""
    if (kb, qb) == (4, 1):
        return pa.decode_layout
    src = inspect.getsource(pa.decode_layout).replace("(4, 2, 1)", f"({kb}, 4, 2, 1)")
    src = src.replace("BLOCK_SIZE=(1, kb)", f"BLOCK_SIZE=({qb}, kb)")
    scope = dict(vars(pa))
    exec(compile(src, "decode_layout", "exec"), scope)  # noqa: S102 -- the module's own source, one number changed
    return scope["decode_layout"]


def timed_ms(fn, device: torch.device, repeats: int, inner: int) -> float:
    fn(), fn()  # compile, warm up
    runs = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(runs)


def one(context: int, dtype: torch.dtype, shuffled: bool, kb: int, qb: int, device: torch.device, repeats: int, inner: int,
        BS: int = 16) -> dict:
    m = BlockManager(num_blocks=B * context // BS + B, block_size=BS, enable_prefix_caching=False)
    if shuffled:  # a running server's blocks lie anywhere in the pool
        order = list(m.free_list)
        random.Random(0).shuffle(order)
        m.free_list.clear(), m.free_list.extend(order)
    for b in range(B):
        m.allocate(b, [0] * context)
    pool = PagedKVCache(m.num_blocks, BS, HKV, D, dtype=dtype, device=device)
    pool.k.normal_(), pool.v.normal_()
    q = torch.randn(B, H, 1, D, device=device, dtype=dtype)
    k, v = (torch.randn(B, HKV, 1, D, device=device, dtype=dtype) for _ in range(2))
    gathered = PagedView(pool, batch_layout(m, list(range(B)), 1, device=device))
    paged = pa.BlockTableView(pool, layout_with_blocks(kb, qb)(m, list(range(B)), m.num_blocks, device))
    key = (max(B, 2), m.num_blocks * BS, H, HKV, D, dtype, device.type)  # the shapes attend remembers a failure by
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, *gathered.update(context - 1, k, v), enable_gqa=True)
        got = paged.attend(q, k, v)
        t_gather = timed_ms(lambda: F.scaled_dot_product_attention(q, *gathered.update(context - 1, k, v), enable_gqa=True),
                            device, repeats, inner)
        t_paged = timed_ms(lambda: paged.attend(q, k, v), device, repeats, inner)
    return {"context": context, "dtype": str(dtype).removeprefix("torch."), "blocks": "shuffled" if shuffled else "in order",
            "block_size": BS, "key_block": kb, "query_block": qb, "gather_ms": round(t_gather, 4), "paged_ms": round(t_paged, 4),
            "paged_over_gather": round(t_paged / t_gather, 3),
            "max_abs_diff": float((got.float() - want.float()).abs().max()),
            "compiled": key not in pa._failed, "error": pa._failed.get(key)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", default="256,1024,4096,16384")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--blocks", default="4x1,16x1,16x128", help="key x query block sizes of the block mask")
    p.add_argument("--block-size", type=int, default=16, help="tokens per pool block (the notebook's: 16)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    rows = []
    for kb, qb in (map(int, kq.split("x")) for kq in a.blocks.split(",")):
        pa._failed.clear(), torch._dynamo.reset()  # each layout compiles afresh
        for dtype in (getattr(torch, d) for d in a.dtypes.split(",")):
            for shuffled in (False, True):
                for context in map(int, a.contexts.split(",")):
                    row = one(context, dtype, shuffled, kb, qb, device, a.repeats, a.inner, a.block_size)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    write(a.out, device, rows)


def write(out: str | None, device: torch.device, rows: list[dict]) -> None:
    """The JSON so far (after every row, so that a run cut short keeps what it measured)."""
    result = {"what": "one layer's attention in a decode step of 16 sequences: gather + SDPA vs paged (FlexAttention)",
              "command": "python tools/bench_paged_attention.py " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "shapes": {"sequences": B, "query_heads": H, "kv_heads": HKV, "head_dim": D},
              "rows": rows}
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
