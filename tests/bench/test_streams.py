"""The benchmark's streams rows (minillm/bench/streams.py) and the served step's profile (serve_profile.py):
a real `python -m minillm serve` process streams bursts; the profile splits a served step into its phases.

No timing asserts beyond order and positivity: speed is the benchmark's output, not a test."""

import argparse

import pytest

import minillm
from minillm.bench import serve_profile, streams
from minillm.bench.serve import Arrival
from minillm.weights.embedded import embedded_gguf_path


def test_bursts_through_a_serve_process():
    """`serve --fast --quantize int4` in its own process: every burst's requests make exactly their tokens
    (`counted` inside), one row per metric and concurrency, the server's share of the in-process decode."""
    rows, skipped = [], {}

    def row(section, variant, metric, unit, ours, theirs=None, n=None):
        rows.append((section, variant, metric, unit, ours, theirs, n))

    args = argparse.Namespace(threads=1, tokens=4, peers=[], concurrency=[1, 3], serving=["fast-int4"])
    streams.streams_rows(embedded_gguf_path(), args, row, skipped)
    metrics = {(r[2], r[6]) for r in rows}
    assert metrics == {("start to ready", None), ("in-process decode", 1), ("served / in-process at 1", 1)} | {
        (m, c) for m in ("output", "time to first token p50", "inter-token p50") for c in (1, 3)}
    assert all(r[0] == "streams" and r[1] == "fast-int4" and r[4] > 0 and r[5] is None for r in rows)
    assert skipped == {}


def test_the_chats_differ_and_are_templated():
    tok = minillm.load().tokenizer
    chats = streams.chats(tok, 16)
    assert len({tuple(c) for c in chats}) == 16  # no two share a prompt (no prefix-cache shortcut between them)
    assert all(tok.decode(c).rstrip().endswith("assistant") for c in chats)  # ready for the answer


@pytest.mark.parametrize("before", [False, True])
def test_the_profile_splits_a_served_step(before):
    """Both setups: the phases are there, each inside the step (cumulative times), the forward the largest."""
    llm = minillm.load(quantize="int4", fast=True)
    parts = [layer.one_call for layer in llm.model.layers]
    if before:
        for layer in llm.model.layers:
            layer.one_call = None
    workload = [Arrival(0.0, p, 4) for p in streams.chats(llm.tokenizer, 2)]
    run = serve_profile.profile_run(llm, workload, before)
    for layer, part in zip(llm.model.layers, parts):
        layer.one_call = part
    ms = run["ms_per_step"]
    assert run["setup"] == ("before" if before else "after") and run["concurrency"] == 2 and run["steps"] >= 4
    assert set(ms) == set(serve_profile.ENGINE_PHASES) | {"HTTP thread: SSE events", "HTTP thread: the rest"}
    assert all(v >= 0 for v in ms.values()) and ms["forward"] > 0 and ms["HTTP thread: the rest"] > 0
    inside = [k for k in serve_profile.ENGINE_PHASES if k != "step"]
    assert all(ms[k] <= ms["step"] for k in inside) and max(inside, key=ms.get) == "forward"
