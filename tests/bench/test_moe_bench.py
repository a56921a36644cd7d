"""The benchmark's moe section (minillm/bench/moe.py) on the tiny shape: its rows, the agreement of the
shared weights with transformers, and the experts rows' four forms computing one result.

No timing asserts beyond positivity: speed is the benchmark's output, not a test. The run asks for
--peers llama.cpp: where llama-cpp-python is installed its rows are checked, where it is not (CI) the
reason under "skipped" is (tests/bench/test_moe_gguf_writer.py holds the file it runs to llama.cpp's
converter either way)."""

import importlib.util
import json
import sys

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from minillm.bench import cli as bench, moe as bench_moe
from minillm.model.moe import experts_grouped, experts_loop

HF_CLASSES = (Qwen3MoeConfig, Qwen3MoeForCausalLM)
TOKENS = 16
METRICS = (["first generate", "generate"] + ["time to first token", "prefill"] * 2
           + ["decode", "greedy agreement", "distinct tokens", "engine"]
           + (["time to first token", "prefill"] * 2 + ["decode", "greedy agreement"]) * 3 + ["experts, one layer"] * 6)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "moe.json"
    assert bench.main(["moe", "--quick", "--threads", "1", "--repeats", "1", "--peers", "llama.cpp", "--json",
                       "--out", str(out)]) == 0
    return json.loads(out.read_text())


def is_peer(r) -> bool:
    return r["variant"].startswith("llama.cpp") or "vs llama.cpp" in r["metric"]


def row(result, metric, n=None, variant="readable"):
    found = [r for r in result["rows"] if r["metric"] == metric and r["variant"] == variant and r["n"] == n]
    assert len(found) == 1, (metric, n, variant)
    return found[0]


def test_header_and_rows(result):
    assert result["model"] == "tiny Qwen3-MoE shape, random weights (seed 0, std 0.3)"
    assert result["args"]["prompt_lengths"] == [32, 128] and result["args"]["tokens"] == TOKENS
    assert all(r["section"] == "moe" for r in result["rows"])
    assert [r["metric"] for r in result["rows"] if not is_peer(r)] == METRICS


def test_speed_rows_are_ratios_of_both_sides(result):
    for metric, unit, n, variant in [("first generate", "s", TOKENS, "readable"), ("decode", "tok/s", TOKENS, "readable"),
                                     ("engine", "tok/s", 16, "readable"), ("experts, one layer", "ms", 1, "grouped"),
                                     ("experts, one layer", "ms", 16, "loop"), ("experts, one layer", "ms", 1, "int4"),
                                     ("decode", "tok/s", TOKENS, "fast-int4"), ("prefill", "tok/s", 128, "fast-int8")]:
        r = row(result, metric, n, variant)
        assert r["unit"] == unit and r["minillm"] > 0 and r["transformers"] > 0
        better = r["transformers"] / r["minillm"] if unit in ("s", "ms") else r["minillm"] / r["transformers"]
        assert r["ratio"] == pytest.approx(better)


def test_the_shared_weights_give_transformers_greedy_tokens(result):
    """The same weights on both sides: every one of the 16 greedy tokens agrees (the float fast path's too),
    and they are not one token repeated."""
    agreement, distinct = row(result, "greedy agreement", TOKENS), row(result, "distinct tokens", TOKENS)
    assert agreement["minillm"] == agreement["transformers"] == TOKENS
    assert row(result, "greedy agreement", TOKENS, "fast")["minillm"] == TOKENS
    assert distinct["minillm"] == distinct["transformers"] > 1


@torch.no_grad()
def test_the_four_expert_forms_agree():
    """What the experts rows time: minillm's grouped form and loop, transformers' grouped_mm and eager, on layer 0."""
    ours, hf = bench_moe.build_pair(bench_moe.TINY, torch.float32, HF_CLASSES)
    block, theirs = ours.model.layers[0].mlp, hf.model.layers[0].mlp.experts
    x = torch.randn(16, ours.config.hidden_size)
    weights, experts = block.gate(x)
    expected = experts_loop(x, block.experts.gate_up_proj, block.experts.down_proj, weights, experts)
    atol = 1e-6 * float(expected.abs().max())  # float32 rounding of outputs up to ~20
    torch.testing.assert_close(experts_grouped(x, block.experts.gate_up_proj, block.experts.down_proj, weights, experts),
                               expected, rtol=0, atol=atol)
    for implementation in ("grouped_mm", "eager"):
        hf.config._experts_implementation = implementation
        torch.testing.assert_close(theirs(x, experts, weights), expected, rtol=0, atol=atol, msg=implementation)


def test_the_llamacpp_peer(result):
    """Installed: llama.cpp runs the same weights (its float32 file's greedy tokens are transformers' for at
    least half the run; a near-tie may flip later), its Q8_0 and Q4_1 decode, and minillm's variants of each
    precision are set beside it. Absent: the rows are not there and "skipped" names the install."""
    peer_rows = [r for r in result["rows"] if is_peer(r)]
    if importlib.util.find_spec("llama_cpp") is None:
        assert "pip install llama-cpp-python" in result["skipped"]["moe: llama.cpp"] and not peer_rows
        return
    assert "moe: llama.cpp" not in result["skipped"]
    assert row(result, "greedy agreement", TOKENS, "llama.cpp F32")["minillm"] >= TOKENS // 2
    for qtype, beside in bench_moe.LLAMA_CPP_TYPES.items():
        assert row(result, "decode", TOKENS, f"llama.cpp {qtype}")["minillm"] > 0
        for variant in beside:
            r = row(result, f"decode vs llama.cpp {qtype}", TOKENS, variant)
            assert r["ratio"] == pytest.approx(r["minillm"] / r["transformers"])


def test_without_llama_cpp_nothing_is_written(monkeypatch, tmp_path):
    """Absent, the peer is skipped with the install named before any GGUF file is written."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    monkeypatch.setattr(bench_moe.tempfile, "tempdir", str(tmp_path))
    skipped, rows = {}, []
    bench_moe.llamacpp_rows(None, {32: [1, 2]}, {}, {}, bench.parse_args(["moe", "--quick"]), rows.append, skipped)
    assert "pip install llama-cpp-python" in skipped["moe: llama.cpp"] and not rows and not list(tmp_path.iterdir())


def test_defaults_and_refusals():
    args = bench.parse_args(["moe"])
    assert args.prompt_lengths == [128, 512] and args.tokens == 64
    with pytest.raises(SystemExit, match="--model does not apply"):
        bench.main(["moe", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    with pytest.raises(SystemExit, match="exceed the model's context of 256 tokens"):
        bench.main(["moe", "--quick", "--prompt-lengths", "32", "300"])
