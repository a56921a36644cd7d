"""n choices of one prompt (issue 24): the prompt is prefilled once, the choices share its blocks
through BlockManager.fork and copy-on-write, and choice i equals a request of its own with seed + i.
On the embedded SmolLM2, in-process on the engine; the server's `n` is tested in test_server_ops.py."""

from __future__ import annotations

import pytest

import minillm.runtime.engine as engine_module
from minillm.api import LLM
from minillm.runtime.engine import Engine, choice_params
from minillm.runtime.sampling import SamplingParams

HOT = SamplingParams(temperature=1.0, top_p=0.95, seed=7)


def chat_ids(smollm2, text: str) -> list[int]:
    return LLM(*smollm2).encode_chat([{"role": "user", "content": text}])


def run(engine: Engine, first) -> dict[int, list[int]]:
    """Step a submitted request (and its forks) to the end: each choice's tokens by request id."""
    tokens = {first.id: []} | {f.id: [] for f in first.forks}
    engine.submit(first)
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
    return tokens


def alone(smollm2, ids, params, max_new_tokens=10) -> list[int]:
    model, tok = smollm2
    return Engine(model, tok, num_blocks=64).generate([ids], params, max_new_tokens=max_new_tokens)[0]["token_ids"]


def test_three_choices_equal_three_requests_seeded_seed_plus_i(smollm2):
    model, tok = smollm2
    ids = chat_ids(smollm2, "Write a word.")
    engine = Engine(model, tok, num_blocks=64)
    got = list(run(engine, engine.make_request(ids, HOT, max_new_tokens=10, n=3)).values())
    want = [alone(smollm2, ids, SamplingParams(temperature=1.0, top_p=0.95, seed=7 + i)) for i in range(3)]
    assert got == want
    assert len({tuple(t) for t in got}) > 1  # the seeds differ, so do the answers
    assert engine.manager.num_free_blocks == 64 and not engine.sequences


def test_the_prompt_is_prefilled_once_and_its_blocks_are_shared(smollm2, monkeypatch):
    model, tok = smollm2
    ids = chat_ids(smollm2, "Name a colour.")
    computed = []  # new tokens per forward: the prompt once, then one per running choice
    forward = engine_module.forward_step

    def counting(model, cache, manager, batch, *rest):
        computed.append(sum(max(n, 1) for _, n in batch))  # a decode row (n = 0) computes one token
        return forward(model, cache, manager, batch, *rest)

    monkeypatch.setattr(engine_module, "forward_step", counting)
    engine = Engine(model, tok, num_blocks=64, block_size=16)
    first = engine.make_request(ids, HOT, max_new_tokens=6, n=3)
    rids = [first.id] + [f.id for f in first.forks]
    engine.submit(first)
    outputs = engine.step()
    assert computed == [len(ids)] and sorted(o.request_id for o in outputs) == rids
    tables = [engine.manager.block_table(r) for r in rids]
    assert tables[0] == tables[1] == tables[2]
    assert engine.manager.num_free_blocks == 64 - engine.manager.blocks_needed(len(ids))
    assert all(engine.manager.ref_count[b] == 3 for b in tables[0])
    engine.step()  # each choice's first token lands in the shared last block: copied on write
    tables = [engine.manager.block_table(r) for r in rids]
    assert tables[0][:-1] == tables[1][:-1] == tables[2][:-1] and len({t[-1] for t in tables}) == 3
    assert computed[1] == 3  # one decode forward, three rows
    while engine.has_unfinished():
        engine.step()
    assert engine.manager.num_free_blocks == 64


def test_greedy_choices_agree_and_unseeded_choices_differ(smollm2):
    model, tok = smollm2
    ids = chat_ids(smollm2, "Say hello.")
    engine = Engine(model, tok, num_blocks=64)
    greedy = list(run(engine, engine.make_request(ids, SamplingParams(temperature=0), max_new_tokens=6, n=2)).values())
    assert greedy[0] == greedy[1] == alone(smollm2, ids, SamplingParams(temperature=0), 6)
    assert choice_params(SamplingParams(temperature=1.0), 3) == [SamplingParams(temperature=1.0)] * 3
    assert [p.seed for p in choice_params(HOT, 3)] == [7, 8, 9]


def test_choices_of_an_aborted_first_sequence_run_on_their_own(smollm2):
    model, tok = smollm2
    ids = chat_ids(smollm2, "Name a fruit.")
    engine = Engine(model, tok, num_blocks=64)
    first = engine.make_request(ids, HOT, max_new_tokens=5, n=3)
    second, third = first.forks
    engine.submit(first)
    engine.abort(first.id)  # before its prefill: the other two must not be lost
    engine.abort(third.id)
    tokens = {second.id: []}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == second.id
            tokens[second.id].append(out.token_id)
    assert tokens[second.id] == alone(smollm2, ids, SamplingParams(temperature=1.0, top_p=0.95, seed=8), 5)
    assert engine.manager.num_free_blocks == 64 and not engine.sequences


def test_bad_n_is_refused(smollm2):
    model, tok = smollm2
    engine = Engine(model, tok, num_blocks=64)
    for n in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n must be an int >= 1"):
            engine.make_request([1, 2, 3], n=n)
    with pytest.raises(ValueError, match="seed"):  # seed + i must stay a valid seed
        engine.make_request([1, 2, 3], SamplingParams(temperature=1.0, seed=2**64 - 2), n=3)


def test_planted_bug_choices_sharing_one_seed_is_caught(smollm2, monkeypatch):
    """Had every choice kept the request's seed, the comparison with seed + i would fail."""
    model, tok = smollm2
    ids = chat_ids(smollm2, "Write a word.")
    monkeypatch.setattr(engine_module, "choice_params", lambda params, n: [params] * n)
    engine = Engine(model, tok, num_blocks=64)
    got = list(run(engine, engine.make_request(ids, HOT, max_new_tokens=10, n=3)).values())
    want = [alone(smollm2, ids, SamplingParams(temperature=1.0, top_p=0.95, seed=7 + i)) for i in range(3)]
    assert got != want and got[0] == got[1] == got[2]
