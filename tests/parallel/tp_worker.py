"""One rank of a tensor-parallel test run (tests/parallel/test_tensor_parallel.py starts `world` of them, with
the variables torchrun would set). Rank 0 saves what it computed to OUT; the test compares it with
the single-process model.

    python tests/parallel/tp_worker.py fixtures OUT    # logits, 32 greedy tokens and an engine run, per tiny fixture
    python tests/parallel/tp_worker.py smollm2 OUT     # SmolLM2's reference prompts: last logits and 32 greedy tokens
    python tests/parallel/tp_worker.py experts OUT     # the MoE fixtures split by experts (notebook 23): the same, and the engine
    python tests/parallel/tp_worker.py die OUT         # rank 1 exits during generation: rank 0 must raise RankLost
    python tests/parallel/tp_worker.py hang OUT        # rank 1 stops answering: rank 0 must raise RankLost in time
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from minillm.weights.embedded import embedded_gguf_path
from minillm.runtime.engine import Engine
from minillm.runtime.generate import generate
from minillm.parallel.tensor_parallel import RankLost, init_tensor_parallel, load_shard
from minillm.text.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[2] / "data"
TINY = ("tiny-qwen2-tied", "tiny-qwen2-untied", "tiny-qwen3", "tiny-llama")


def engine_prompts(n: int = 12, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of 1-69 tokens and limits of 1-29 new tokens (the test builds the same)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 320, (int(k),), generator=g).tolist() for k in torch.randint(1, 70, (n,), generator=g)]
    return prompts, [int(k) for k in torch.randint(1, 30, (n,), generator=g)]


def fixtures(rank: int, world: int) -> dict:
    tok = Tokenizer.from_gguf(embedded_gguf_path())  # decodes any id < 320: the tiny models have none
    out = {}
    for name in TINY:
        model = load_shard(DATA / name, rank, world)
        ref = load_file(DATA / name / "reference.safetensors")
        with torch.no_grad():
            logits = [model(ref[f"input_ids_{i}"][None])[0] for i in range(3)]
        greedy = generate(model, tok, ref["input_ids_0"].tolist(), max_new_tokens=32, eos_token_ids=()).token_ids
        engine = Engine(model, tok, num_blocks=12)  # too few blocks for all at once: preemption
        prompts, limits = engine_prompts()
        runs = [r["token_ids"] for r in engine.generate(prompts, max_new_tokens=limits, eos_token_ids=())]
        out[name] = {"logits": logits, "greedy": greedy, "engine": runs,
                     "preemptions": engine.scheduler.num_preemptions,
                     "local_heads": (model.config.num_attention_heads, model.config.num_key_value_heads)}
    return out


def experts(rank: int, world: int) -> dict:
    """Expert parallelism (notebook 23) on the tiny MoE checkpoints: logits, 32 greedy tokens, an engine run."""
    import warnings

    from minillm.cache.hybrid import make_hybrid_cache
    from minillm.parallel.expert_parallel import expert_parallel_model
    from minillm.runtime.hybrid_engine import HybridEngine
    from minillm.weights.moe import load_moe_folder

    tok, out = Tokenizer.from_gguf(embedded_gguf_path()), {}
    for name in ("qwen3_moe-tiny", "qwen3_5_moe-tiny"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the Qwen3.5-MoE's vision tower, skipped
            model = expert_parallel_model(load_moe_folder(DATA / name, dtype=torch.float32, device="cpu"), rank, world)
        hybrid = name.startswith("qwen3_5")
        ref = load_file(DATA / name / "reference.safetensors")
        with torch.no_grad():
            logits = [model(ref[f"input_ids_{i}"][None])[0] for i in range(3)]
        extra = {"cache_factory": make_hybrid_cache} if hybrid else {}
        greedy = [generate(model, tok, ref[f"input_ids_{i}"].tolist(), max_new_tokens=32, eos_token_ids=(), **extra).token_ids
                  for i in range(3)]
        engine = (HybridEngine if hybrid else Engine)(model, tok, num_blocks=24)
        prompts = [ref[f"input_ids_{i}"].tolist() for i in range(3)]
        runs = [r["token_ids"] for r in engine.generate(prompts, max_new_tokens=32, eos_token_ids=())]
        held = [tuple(layer.mlp.gate_up_proj.shape) for layer in model.model.layers]
        out[name] = {"logits": logits, "greedy": greedy, "engine": runs, "held": held}
    return out


def smollm2(rank: int, world: int) -> dict:
    path = embedded_gguf_path()
    model, tok, ref = load_shard(path, rank, world), Tokenizer.from_gguf(path), load_file(DATA / "smollm2" / "reference.safetensors")
    out = {}
    for i in range(3):
        ids = ref[f"prompt_ids_{i}"].tolist()
        with torch.no_grad():
            out[f"last_logits_{i}"] = model(torch.tensor([ids]), logits_to_keep=1)[0, -1]
        out[f"greedy_{i}"] = generate(model, tok, ids, max_new_tokens=32, eos_token_ids=()).token_ids
    return out


def lose_a_rank(rank: int, world: int, how: str) -> dict:
    """Rank 1 leaves after its 3rd forward (exits, or sleeps past the timeout); rank 0 reports what it saw."""
    model, tok = load_shard(DATA / "tiny-qwen3", rank, world), Tokenizer.from_gguf(embedded_gguf_path())
    if rank == 1:
        forwards = 0

        def leave(module, args):
            nonlocal forwards
            forwards += 1
            if forwards == 3:
                if how == "die":
                    os._exit(3)
                time.sleep(3600)

        model.register_forward_pre_hook(leave)
    start = time.monotonic()
    try:
        generate(model, tok, [5, 6, 7], max_new_tokens=20, eos_token_ids=())
    except RankLost as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def main() -> None:
    task, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)  # several ranks share two cores
    world = int(os.environ["WORLD_SIZE"])
    rank, _ = init_tensor_parallel(world, timeout=float(os.environ.get("TP_TIMEOUT", 60)))
    tasks = {"fixtures": fixtures, "smollm2": smollm2, "experts": experts}
    result = tasks[task](rank, world) if task in tasks else lose_a_rank(rank, world, task)
    if rank == 0:
        torch.save(result, out)
    if task in ("die", "hang"):
        os._exit(0)  # the group lost a rank: nothing to tear down cleanly
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
