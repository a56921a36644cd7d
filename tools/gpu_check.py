"""Check minillm on a device (a CUDA GPU, or the CPU) against the references stored in data/.

    python tools/gpu_check.py [--device cuda|cpu] [--out docs/bench/gpu-check.json]

No network, standard library + torch + minillm only; about a minute on a CPU, well under five
minutes on a GPU. What it checks, on the device:

- the tiny Qwen2 (tied, untied), Qwen3 and Llama checkpoints of data/: their logits on the three
  stored sequences against transformers' float32 logits, in float32 and in bfloat16;
- their 32 stored greedy tokens per sequence, in float32, through `generate` (the KV-cached loop)
  and through the fast path (FastCausalLM);
- the Engine (paged cache, batched prefill and decode) against one-at-a-time `generate`, float32;
- SmolLM2-135M-Instruct (the embedded GGUF): its last-position logits for the three stored chats
  (float32 and bfloat16), its stored greedy answers (float32, `generate` and the fast path), and
  the Engine against one-at-a-time generation.

It writes a JSON report (device, torch version, each check's name, pass/fail, measured max error
and tolerance, the wall time) and exits 1 if any check failed, 2 if the device is not available.

Tolerances (see tests/support.py for the float32 reasoning):
- float32, tiny fixtures: 1e-4 absolute. Correct machines differ from transformers by about 1e-5
  (logits std about 4.2); the subtlest planted bug in tests/model/test_model.py moves them by 6e-4.
- float32, SmolLM2: 2.5e-4 x std(reference) (about 9e-4), the suite's SMOLLM2_REL: 30 layers
  accumulate more rounding than 3, measured up to 2.3e-5 x std between correct machines.
- bfloat16: 0.3 x std(reference), see BF16_REL below.
Greedy tokens are compared in float32 only: bf16 logits move by far more than the smallest top-2
margins of the stored runs (0.03 tiny, 0.012 SmolLM2), so bf16 greedy runs may rightly diverge.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from minillm.weights.embedded import embedded_gguf_path  # noqa: E402
from minillm.runtime.engine import Engine  # noqa: E402
from minillm.speed.fast import FastCausalLM  # noqa: E402
from minillm.runtime.generate import generate  # noqa: E402
from minillm.model.decoder import from_folder  # noqa: E402
from minillm.text.tokenizer import Tokenizer  # noqa: E402
from minillm.weights.loading import from_gguf  # noqa: E402

TINY = ("tiny-qwen2-tied", "tiny-qwen2-untied", "tiny-qwen3", "tiny-llama")
FLOAT32_ATOL = 1e-4  # tiny fixtures, float32: absolute (their logits' std is about 4.2)
SMOLLM2_REL = 2.5e-4  # SmolLM2, float32: x std(reference), as tests/support.py
# bfloat16 keeps 8 significant bits: a logit near 15 is already rounded by up to 0.03 on output, and
# every matmul input (weights and activations) is rounded to 2^-9 relative on the way. Measured on a
# CPU against transformers' float32 logits, the largest error over every position and vocab entry is
# 0.02-0.13 x std (tiny fixtures and SmolLM2 alike); 0.3 x std leaves room for a GPU's other kernels
# and summation order, and stays 6x below what a real bug does (RoPE or the causal mask off by one
# moves logits by 1.8 x std or more, tests/support.py). Subtler bugs are the float32 checks' job.
BF16_REL = 0.3
GREEDY_TOKENS = 32


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


class Report:
    """The checks run so far: name, passed, max error, tolerance, a note."""

    def __init__(self):
        self.checks: list[dict] = []
        self.clock = time.perf_counter()

    def add(self, name: str, passed: bool, max_error: float | None = None, tolerance: float | None = None,
            detail: str = "") -> None:
        now = time.perf_counter()  # seconds: since the previous check (loading included)
        self.checks.append(dict(name=name, passed=bool(passed), max_error=max_error, tolerance=tolerance,
                                detail=detail, seconds=round(now - self.clock, 3)))
        self.clock = now
        err = "" if max_error is None else f" max error {max_error:.3g} (tolerance {tolerance:.3g})"
        print(f"{'PASS' if passed else 'FAIL'}  {name}{err}{'  ' + detail if detail else ''}"
              f"  [{self.checks[-1]['seconds']:.1f} s]", flush=True)

    def logits(self, name: str, pairs: list[tuple[torch.Tensor, torch.Tensor]], tolerance_of) -> None:
        """Max |actual - reference| over all pairs against tolerance_of(reference); NaN fails."""
        worst, worst_tol, ok = 0.0, None, True
        for actual, ref in pairs:
            err = (actual.float().cpu() - ref).abs().max().item()
            tol = tolerance_of(ref)
            ok = ok and err <= tol  # NaN compares False: fails
            if not err <= worst:
                worst, worst_tol = err, tol
        self.add(name, ok, worst, worst_tol if worst_tol is not None else tolerance_of(pairs[0][1]))

    def tokens(self, name: str, got: list[list[int]], want: list[list[int]]) -> None:
        """Token lists equal; the error is the number of differing runs."""
        n = max(len(got), len(want))
        bad = [i for i in range(n) if i >= len(got) or i >= len(want) or got[i] != want[i]]
        self.add(name, not bad, float(len(bad)), 0.0, f"runs differing: {bad}" if bad else f"{len(want)} runs")


@torch.no_grad()
def forward_logits(model, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    return model(ids[None].to(device))[0]


def greedy_runs(model, tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    return [generate(model, tokenizer, p, max_new_tokens=GREEDY_TOKENS, eos_token_ids=()).token_ids for p in prompts]


def engine_runs(model, tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    out = Engine(model, tokenizer, num_blocks=64).generate(prompts, max_new_tokens=GREEDY_TOKENS, eos_token_ids=())
    return [r["token_ids"] for r in out]


def check_tiny(report: Report, data: Path, name: str, tokenizer: Tokenizer, device: torch.device) -> None:
    ref = load_file(data / name / "reference.safetensors")
    inputs = [ref[f"input_ids_{i}"] for i in range(3)]
    prompts = [x.tolist() for x in inputs]
    model = from_folder(data / name, dtype=torch.float32, device=device)
    report.logits(f"{name}/float32/logits", [(forward_logits(model, x, device), ref[f"logits_{i}"])
                                             for i, x in enumerate(inputs)], lambda r: FLOAT32_ATOL)
    want = [ref[f"greedy_{i}"].tolist() for i in range(3)]
    one_at_a_time = greedy_runs(model, tokenizer, prompts)
    report.tokens(f"{name}/float32/greedy", one_at_a_time, want)
    report.tokens(f"{name}/float32/fast-greedy", greedy_runs(FastCausalLM(model), tokenizer, prompts), want)
    report.tokens(f"{name}/float32/engine-vs-one-at-a-time", engine_runs(model, tokenizer, prompts), one_at_a_time)
    model = from_folder(data / name, dtype=torch.bfloat16, device=device)
    report.logits(f"{name}/bfloat16/logits", [(forward_logits(model, x, device), ref[f"logits_{i}"])
                                              for i, x in enumerate(inputs)], lambda r: BF16_REL * float(r.std()))


def check_smollm2(report: Report, data: Path, tokenizer: Tokenizer, device: torch.device) -> None:
    ref = load_file(data / "smollm2" / "reference.safetensors")
    prompts = [ref[f"prompt_ids_{i}"].tolist() for i in range(3)]
    model = from_gguf(embedded_gguf_path(), dtype=torch.float32, device=device)

    def last_logits():
        return [(forward_logits(model, torch.tensor(p), device)[-1], ref[f"last_logits_{i}"]) for i, p in enumerate(prompts)]

    report.logits("smollm2/float32/logits", last_logits(), lambda r: SMOLLM2_REL * float(r.std()))
    want = [ref[f"greedy_{i}"].tolist() for i in range(3)]
    one_at_a_time = greedy_runs(model, tokenizer, prompts)
    report.tokens("smollm2/float32/greedy", one_at_a_time, want)
    report.tokens("smollm2/float32/fast-greedy", greedy_runs(FastCausalLM(model), tokenizer, prompts), want)
    # the engine on the three chats at once (38, 32 and 75 tokens: padded, batched prefill, then decode)
    report.tokens("smollm2/float32/engine-vs-one-at-a-time", engine_runs(model, tokenizer, prompts), one_at_a_time)
    model = model.to(torch.bfloat16)  # in place: one load for both dtypes
    report.logits("smollm2/bfloat16/logits", last_logits(), lambda r: BF16_REL * float(r.std()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="where to run (default: cuda if available, else cpu)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "gpu-check.json",
                        help="the JSON report (default: docs/bench/gpu-check.json)")
    parser.add_argument("--data", type=Path, default=ROOT / "data", help="the reference data folder")
    parser.add_argument("--only", nargs="+", choices=(*TINY, "smollm2"), default=None,
                        help="check only these models (default: all)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(name)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32: TF32 would round inputs to 10 bits
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    start = time.perf_counter()
    report = Report()
    models = args.only or [*TINY, "smollm2"]
    tokenizer = Tokenizer.from_gguf(embedded_gguf_path())  # the tiny models have none: SmolLM2's decodes ids < 320
    for model in models:
        if model == "smollm2":
            check_smollm2(report, args.data, tokenizer, device)
        else:
            check_tiny(report, args.data, model, tokenizer, device)
    wall_s = time.perf_counter() - start
    passed = all(c["passed"] for c in report.checks)
    result = {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "tolerances": {"float32_tiny_atol": FLOAT32_ATOL, "float32_smollm2_rel_std": SMOLLM2_REL,
                       "bfloat16_rel_std": BF16_REL},
        "checks": report.checks,
        "passed": passed,
        "wall_s": round(wall_s, 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    failed = [c["name"] for c in report.checks if not c["passed"]]
    print(f"{len(report.checks) - len(failed)}/{len(report.checks)} checks passed on {result['device']} "
          f"in {wall_s:.1f} s; report: {args.out}")
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
