"""A compiled fast model compiles at load (a prompt graph and a decode graph), and never again while it
generates: not per decode step as the context grows, not for a second request with another prompt length
and cache size (issue 48). Counted with dynamo's own counters; a recompile per step would count 64 here."""

import pytest
import torch
from torch._dynamo.utils import counters

from support import DATA
from minillm.bench.peers import IdsOnly
from minillm.model.decoder import from_folder
from minillm.runtime.generate import generate
from minillm.speed.fast import FastCausalLM, compile_now

# the prompt's (causal, any length >= 2) and the decode step's (one token, any position); int4 decode steps
# run appendix A4's one-call layers, uncompiled
GRAPHS = {None: 2, "int4": 1}


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_graphs_at_load_and_none_after(quantize):
    torch._dynamo.reset()
    counters.clear()
    said = []
    model = compile_now(FastCausalLM(from_folder(DATA / "tiny-qwen3"), quantize=quantize).compile(), say=said.append)
    assert counters["stats"]["unique_graphs"] == GRAPHS[quantize]
    graphs = ["prompt", "decode"][:GRAPHS[quantize]]
    assert [line.split(" graph")[0] for line in said] == [s for g in graphs for s in (f"minillm: compiling the {g}",
                                                                                       f"minillm: {g}")]
    tok = IdsOnly()
    for prompt, tokens in (([3, 1, 4, 1, 5], 64), ([2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], 20)):  # two requests
        out = generate(model, tok, prompt, max_new_tokens=tokens, eos_token_ids=())
        assert len(out.token_ids) == tokens
    assert counters["stats"]["unique_graphs"] == GRAPHS[quantize], dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
