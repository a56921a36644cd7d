"""A compiled fast model compiles at load, and never again: not per decode step as the context grows, not for
a second request of another length (issue 48), and not for any kind of engine step (issue 53): decode only,
prompts after a prefix-cache hit, prompts and decode tokens packed together, 1 to 16 prompts in one forward.
`.compile()` compiles each layer's two pieces around attention (notebook 13), attention stays eager, so the
graphs are four: two pieces, each for one token and for two or more. Counted with dynamo's own counters; a
graph with attention in it would compile again for each kind of step."""

import pytest
import torch
from torch._dynamo.utils import counters

from support import DATA
from minillm.bench.peers import IdsOnly
from minillm.model.decoder import from_folder
from minillm.runtime import engine as engine_module
from minillm.runtime.engine import Engine
from minillm.runtime.generate import generate
from minillm.speed.fast import FastCausalLM, compile_now

GRAPHS = 4  # attention_inputs and attention_output, each for T = 1 and T >= 2


def compiled(quantize):
    torch._dynamo.reset()
    counters.clear()
    said = []
    model = compile_now(FastCausalLM(from_folder(DATA / "tiny-qwen3"), quantize=quantize).compile(), say=said.append)
    assert counters["stats"]["unique_graphs"] == GRAPHS
    assert [line.split(" graphs")[0] for line in said] == [s for g in ("prompt", "one-token")
                                                            for s in (f"minillm: compiling the {g}", f"minillm: {g}")]
    return model


def assert_no_new_graph():
    assert counters["stats"]["unique_graphs"] == GRAPHS, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_graphs_at_load_and_none_after(quantize):
    model, tok = compiled(quantize), IdsOnly()
    for prompt, tokens in (([3, 1, 4, 1, 5], 64), ([2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], 20)):  # two requests
        out = generate(model, tok, prompt, max_new_tokens=tokens, eos_token_ids=())
        assert len(out.token_ids) == tokens
    assert_no_new_graph()


def engine_run(model, monkeypatch=None):
    """Requests arriving over time on an engine with prefix caching; returns each request's tokens
    and, with monkeypatch, what each packed forward held: (prompt chunks, decode tokens, chunks after cached keys)."""
    steps, forward = [], engine_module.forward_packed
    if monkeypatch is not None:
        def counting(model, cache, manager, batch, attention="gather"):
            chunks = [s for s, n in batch if n]
            steps.append((len(chunks), len(batch) - len(chunks), sum(s.num_computed > 0 for s in chunks)))
            return forward(model, cache, manager, batch, attention)
        monkeypatch.setattr(engine_module, "forward_packed", counting)
    engine = Engine(model, IdsOnly(), num_blocks=256, block_size=4, max_num_seqs=32)
    g = torch.Generator().manual_seed(0)
    system = list(range(10, 22))  # shared by every other request: prefix-cache hits
    waves = [[torch.randint(3, 300, (int(k),), generator=g).tolist() for k in torch.randint(1, 10, (n,), generator=g)]
             for n in (1, 16, 3)]  # short: a packed row holds at most the model's 256 positions
    waves[0] = [system + waves[0][0]]  # computes the shared prefix (a prompt waits for one being computed)
    waves[1] = [system + p if i % 2 else p for i, p in enumerate(waves[1])]
    waves[2].append(list(waves[1][1]))  # the same prompt again: its full blocks cached
    ids = []
    for wave in waves:
        ids += [engine.add_request(p, max_new_tokens=12, eos_token_ids=()) for p in wave]
        for _ in range(4):  # the next wave arrives while these decode
            engine.step()
    tokens = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += [] if out.token_id is None else [out.token_id]
    return tokens, steps


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_no_engine_step_compiles_again(quantize, monkeypatch):
    model = compiled(quantize)
    _, steps = engine_run(model, monkeypatch)
    assert_no_new_graph()
    kinds = {"decode only": [s for s in steps if s[0] == 0], "one prompt alone": [s for s in steps if s[:2] == (1, 0)],
             "prompts beside decode tokens": [s for s in steps if s[0] and s[1]],
             "after a prefix-cache hit": [s for s in steps if s[2]], "16 prompts in one": [s for s in steps if s[0] >= 16]}
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}  # the run holds every kind of step


def test_the_compiled_engine_answers_as_the_eager_one():
    eager = FastCausalLM(from_folder(DATA / "tiny-qwen3"))
    assert engine_run(compiled(None))[0] == engine_run(eager)[0]
