"""The tensor-parallel section of the benchmark (`python -m minillm.bench tp`): one decode step at
TP 1 and TP 2 over gloo on this machine's cores, and how much of it the collectives take.

Each run is `torchrun --standalone --nproc-per-node N -m minillm.bench.tp ...`; the cores are
shared out (TP 1: all of --threads; TP 2: half each), so both runs use the same CPU. The model
has Qwen2.5-0.5B-Instruct's shape (24 layers, 14 heads, 2 KV heads: it splits in two; SmolLM2's
9 heads do not) with random weights: speed depends on shapes, not on values. The collectives
alone are timed by repeating one decode step's worth of them (2 all-reduces a layer, one after
the embedding, one all-gather of the logits) with nothing else running; and the time a decode
step spends inside them (torch.profiler's gloo events), which adds the wait for the slower rank.
On CUDA the ranks run on one GPU each (NCCL) and the same rows are written; there, the profiler's
CPU-side NCCL events show launches rather than transfers, so read the step times.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minillm.model.devices import synchronized_time
from minillm.cache.dense import make_cache
from minillm.model.decoder import ModelConfig
from minillm.bench.roofline import weight_mib
from minillm.parallel.tensor_parallel import Split, all_gather_last, all_reduce, empty_shard, init_tensor_parallel

DATA = Path(__file__).resolve().parents[2] / "data"
SHAPE = DATA / "configs" / "Qwen2.5-0.5B-Instruct.json"
QUICK_SHAPE = DATA / "tiny-qwen3" / "config.json"
PROMPT = 32  # tokens before the timed decode steps


def median_ms(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        start = synchronized_time(device)
        fn()
        times.append((synchronized_time(device) - start) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def rank_main(shape: str, tokens: int, out: str) -> None:
    """One rank: a random model of `shape`, a prompt, then `tokens` timed decode steps and as many
    rounds of the same collectives alone. Rank 0 writes the medians to `out` (JSON)."""
    world = int(os.environ["WORLD_SIZE"])
    rank, device = init_tensor_parallel(world)
    config = ModelConfig.from_json(shape)
    split = Split(config, rank, world)
    torch.manual_seed(rank)
    model = empty_shard(split, torch.float32, device)
    for p in model.parameters():
        p.normal_(0, 0.02)
    cache = make_cache(model.config, 1, PROMPT + 2 * tokens + 1, device=device)
    model(torch.randint(0, config.vocab_size, (1, PROMPT), device=device), cache=cache)
    pos, token = PROMPT, torch.tensor([[1]], device=device)

    def step():
        nonlocal pos
        model(token, cache=cache, start_pos=pos)
        pos += 1

    hidden, rows = torch.zeros(1, 1, config.hidden_size, device=device), torch.zeros(1, 1, split.vocab_rows, device=device)

    def collectives():
        for _ in range(2 * config.num_hidden_layers + 1):
            all_reduce(hidden)
        all_gather_last(rows, world)

    step_ms = median_ms(step, tokens, device)
    comm_ms = median_ms(collectives, tokens, device) if world > 1 else 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the same steps again, watched (and slowed)
        start = synchronized_time(device)
        for _ in range(tokens):
            step()
        watched_ms = (synchronized_time(device) - start) * 1e3 / tokens  # a mean, as inside_ms: the share <= 1
    inside_ms = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith(("gloo:", "nccl:"))) / 1e3 / tokens
    if rank == 0:
        mib = weight_mib(model)  # the benchmark's one rule for weight bytes
        Path(out).write_text(json.dumps({"world": world, "threads": torch.get_num_threads(), "step_ms": step_ms,
                                         "comm_ms": comm_ms, "inside_ms": inside_ms, "watched_step_ms": watched_ms,
                                         "weights_mib": mib}))
    torch.distributed.destroy_process_group()


def run_tp(world: int, threads: int, shape: Path, tokens: int) -> dict:
    """One torchrun of `world` ranks with `threads` torch threads each; rank 0's measurements."""
    with tempfile.TemporaryDirectory(prefix="minillm-bench-tp-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "minillm.bench.tp", str(shape), str(tokens), str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode or not out.exists():
            raise RuntimeError(f"torchrun of {world} ranks failed:\n{done.stderr[-2000:]}")
        return json.loads(out.read_text())


def tp_rows(args, row) -> None:
    """Rows of the tp section: decode step at TP 1 and TP 2, the collectives' time and share, weights per rank."""
    cores = args.threads or torch.get_num_threads()
    shape, tokens = (QUICK_SHAPE, 8) if args.quick else (SHAPE, 32)
    name = "tiny-qwen3 shape" if args.quick else "Qwen2.5-0.5B shape"
    one, two = run_tp(1, cores, shape, tokens), run_tp(2, max(1, cores // 2), shape, tokens)
    for r in (one, two):
        variant = f"{name}, TP {r['world']} x {r['threads']} thread(s)"
        row("tp", variant, "decode step", "ms", r["step_ms"], n=tokens)
        row("tp", variant, "weights per rank", "MiB", r["weights_mib"])
    variant = f"{name}, TP 2 x {two['threads']} thread(s)"
    row("tp", variant, "collectives alone, per token", "ms", two["comm_ms"], n=tokens)
    row("tp", variant, "in collectives during a step", "ms", two["inside_ms"], n=tokens)  # under the profiler
    row("tp", variant, "collectives' share of the step", "%", 100 * two["inside_ms"] / two["watched_step_ms"], n=tokens)
    row("tp", variant, "step vs TP 1", "x", one["step_ms"] / two["step_ms"], n=tokens)


if __name__ == "__main__":
    rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
