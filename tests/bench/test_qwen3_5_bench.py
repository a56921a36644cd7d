"""The benchmark's qwen3_5 section (minillm/bench/qwen3_5.py) on the tiny shape: its rows, its agreement,
its memory numbers (worked out by hand here, not with the functions the section calls).

No timing asserts beyond positivity: speed is the benchmark's output, not a test."""

import json

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from minillm.bench import cli as bench, peers as bench_peers, qwen3_5 as bench_qwen3_5
from minillm.model.qwen3_5 import HybridConfig

HF_CLASSES = (Qwen3_5TextConfig, Qwen3_5ForCausalLM)
MIB = 2**20
TOKENS = 16
METRICS = (["first generate", "generate"] + ["time to first token", "prefill"] * 2
           + ["decode", "greedy agreement", "distinct tokens"]
           + ["engine", "shared system prompt", "shared system prompt", "prompt blocks reused", "cache after prefill"]
           + ["cache memory", "cache memory", "vs all-attention KV cache"] * 2 + ["state memory"])


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "qwen3_5.json"
    assert bench.main(["qwen3_5", "--quick", "--threads", "1", "--repeats", "1", "--json", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def row(result, metric, n=None, variant="readable"):
    found = [r for r in result["rows"] if r["metric"] == metric and r["variant"] == variant and r["n"] == n]
    assert len(found) == 1, (metric, n, variant)
    return found[0]


def test_header_and_rows(result):
    assert result["model"] == "tiny Qwen3.5 shape, random weights (seed 0, std 0.3)"
    assert result["dtype"] == "float32" and result["threads"] == 1 and result["ceilings"] == {}
    assert result["args"]["prompt_lengths"] == [32, 128] and result["args"]["tokens"] == TOKENS
    keys = {"section", "variant", "metric", "n", "unit", "minillm", "transformers", "ratio", "ceiling_fraction"}
    assert all(set(r) == keys and r["section"] == "qwen3_5" for r in result["rows"])
    assert [r["metric"] for r in result["rows"]] == METRICS


def test_speed_rows_are_ratios_of_both_sides(result):
    for metric, unit, n in [("first generate", "s", TOKENS), ("generate", "s", TOKENS), ("decode", "tok/s", TOKENS),
                            ("time to first token", "ms", 32), ("time to first token", "ms", 128)]:
        r = row(result, metric, n)
        assert r["unit"] == unit and r["minillm"] > 0 and r["transformers"] > 0
        better = r["transformers"] / r["minillm"] if unit in ("s", "ms") else r["minillm"] / r["transformers"]
        assert r["ratio"] == pytest.approx(better)
    for n in (32, 128):  # prompt tokens over the time to first token
        ttft, prefill = row(result, "time to first token", n), row(result, "prefill", n)
        assert prefill["minillm"] == pytest.approx(n / (ttft["minillm"] / 1e3))
        assert prefill["transformers"] == pytest.approx(n / (ttft["transformers"] / 1e3))


def test_engine_rows(result):
    r = row(result, "engine", 16)  # the smallest --requests: 16 by default
    assert r["unit"] == "tok/s" and r["minillm"] > 0 and r["ratio"] == pytest.approx(r["minillm"] / r["transformers"])
    for variant in ("prefix cache", "no prefix cache"):
        r = row(result, "shared system prompt", bench_qwen3_5.CHATS, variant)
        assert r["unit"] == "s" and r["ratio"] == pytest.approx(r["transformers"] / r["minillm"])
    # --quick: 8 chats of a 64-token system prompt and 32 of their own (6 blocks of 16 each); the first saves
    # its states at 64 (and 80), so each later chat reuses the system prompt's 4 blocks: 7 x 4 of 48
    reused = row(result, "prompt blocks reused", bench_qwen3_5.CHATS, "prefix cache")
    assert reused["unit"] == "%" and reused["minillm"] == pytest.approx(100 * 7 * 4 / 48) and reused["transformers"] is None


def test_greedy_agreement_is_total_and_not_a_repeated_token(result):
    agreement = row(result, "greedy agreement", TOKENS)
    assert agreement["minillm"] == agreement["transformers"] == TOKENS
    distinct = row(result, "distinct tokens", TOKENS)
    assert distinct["minillm"] == distinct["transformers"] >= TOKENS // 2  # std 0.3: not the last prompt token again


def test_memory_rows_by_hand(result):
    """Tiny shape, fp32: 1 attention layer of 2 kv heads x 32 dims, 3 DeltaNet layers of C = 2*2*16 + 4*8 = 96
    conv channels (K - 1 = 3 columns) and a 4 x 16 x 8 recurrent state."""
    kv_per_token, states = 2 * 1 * 2 * 32 * 4, 3 * (96 * 3 * 4 + 4 * 16 * 8 * 4)  # 512 B; 9600 B
    assert row(result, "state memory", variant="DeltaNet states")["minillm"] == states / MIB
    for n in (4096, 32768):
        hybrid = row(result, "cache memory", n, "hybrid cache")["minillm"]
        dense = row(result, "cache memory", n, "all-attention KV")["minillm"]
        assert hybrid == (kv_per_token * n + states) / MIB and dense == 4 * kv_per_token * n / MIB
        assert row(result, "vs all-attention KV cache", n, "hybrid cache")["minillm"] == pytest.approx(dense / hybrid)
    cache = row(result, "cache after prefill", 32)  # what each side's cache holds after 32 tokens
    assert cache["minillm"] == (kv_per_token * 32 + states) / MIB
    assert cache["transformers"] == (kv_per_token * 32 + 3 * (96 * 4 * 4 + 4 * 16 * 8 * 4)) / MIB  # conv: K columns


def test_memory_rows_of_the_0_8b_shape():
    """The numbers the README quotes, in bf16 (no weights needed): 6 attention layers of 2 x 256, 18 DeltaNet layers."""
    rows = []
    bench_qwen3_5.memory_rows(HybridConfig.from_dict(dict(bench_qwen3_5.QWEN3_5_0_8B, model_type="qwen3_5_text")),
                              torch.bfloat16, lambda *a, n=None: rows.append((a[1], a[2], n, a[4])))
    states = 18 * (6144 * 3 * 2 + 16 * 128 * 128 * 4)  # conv in bf16, recurrent in fp32: 18.6 MiB
    assert ("DeltaNet states", "state memory", None, states / MIB) in rows
    for n in (4096, 32768):
        assert ("hybrid cache", "cache memory", n, (2 * 6 * 2 * 256 * 2 * n + states) / MIB) in rows
        assert ("all-attention KV", "cache memory", n, 2 * 24 * 2 * 256 * 2 * n / MIB) in rows
    ratio = [value for variant, metric, n, value in rows if metric == "vs all-attention KV cache" and n == 32768]
    assert ratio == [pytest.approx(1536 / (384 + states / MIB))]  # 3.8x at 32k tokens


def test_both_sides_share_one_copy_of_the_weights_and_compute_the_same():
    ours, hf = bench_qwen3_5.build_pair(bench_qwen3_5.TINY, torch.float32, HF_CLASSES)
    assert ours.model.embed_tokens.weight.data_ptr() == hf.lm_head.weight.data_ptr()
    theirs = dict(hf.named_parameters())
    assert all(p.data_ptr() == theirs[name].data_ptr() for name, p in ours.named_parameters())
    ids = torch.tensor([bench_qwen3_5.prompt_ids(100, 320)])  # longer than one chunk of the delta rule (64)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-3, rtol=1e-3)  # float32 sums in another order


def test_tensor_bytes_counts_each_storage_once():
    t = torch.zeros(10)

    class Holder:
        def __init__(self):
            self.views, self.half = [t[:5], {"again": t}], torch.zeros(3, dtype=torch.float16)

    assert bench_qwen3_5.tensor_bytes([t, Holder()]) == 10 * 4 + 3 * 2
    assert bench_qwen3_5.tensor_bytes({"none": None, "n": 3}) == 0


def test_leading_agreement():
    assert bench_peers.leading_agreement([1, 2, 3], [1, 2, 4]) == 2
    assert bench_peers.leading_agreement([5, 2, 3], [1, 2, 3]) == 0
    assert bench_peers.leading_agreement([1, 2], [1, 2, 3]) == 2


def test_defaults_and_refusals():
    args = bench.parse_args(["qwen3_5"])
    assert args.prompt_lengths == [1024, 4096] and args.tokens == 64
    args = bench.parse_args(["qwen3_5", "--quick"])
    assert args.prompt_lengths == [32, 128] and args.tokens == 16
    assert bench.parse_args(["decode"]).prompt_lengths == [128, 1024]  # the other sections keep theirs
    with pytest.raises(SystemExit, match="--model does not apply"):
        bench.main(["qwen3_5", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    with pytest.raises(SystemExit):  # argparse: "--tokens: must be at least 2 to time decode"
        bench.parse_args(["qwen3_5", "--tokens", "1"])
    with pytest.raises(SystemExit, match="exceed the model's context of 512 tokens"):
        bench.main(["qwen3_5", "--quick", "--prompt-lengths", "32", "600"])
