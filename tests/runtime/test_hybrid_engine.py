"""Qwen3.5 in the continuous-batching engine (appendix A6): every answer equals a full recompute of
its sequence, under batching, chunked prefill, forced preemption, n > 1 choices, prefix caching and
speculation (the slots rolled back after rejected drafts);
a prefix hit goes only as far as a saved state reaches, and the hit rate on a shared system prompt
is what the saved states allow."""

from __future__ import annotations

import warnings

import pytest
import torch

from minillm.runtime.engine import Engine
from minillm.runtime.generate import generate
from minillm.runtime import hybrid_engine
from minillm.runtime.hybrid_engine import HybridEngine, HybridSpeculativeEngine
from minillm.runtime.sampling import SamplingParams
from minillm.runtime.speculative import NgramDrafter
from minillm.cache.hybrid import make_hybrid_cache
from minillm.cache.state_pool import StatePool
from minillm.text.tokenizer import Tokenizer
from minillm.weights.embedded import embedded_gguf_path
from minillm.weights.hybrid import load_hybrid_folder
from support import DATA, HYBRID_REL, KnowsTheAnswers, logits_tolerance, top2_margin


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(embedded_gguf_path())  # decodes any id < 320: the tiny model has no tokenizer


@pytest.fixture(scope="module")
def model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped vision tower: tests/weights/test_hybrid.py checks the message
        return load_hybrid_folder(DATA / "qwen3_5-tiny", dtype=torch.float32, device="cpu")


def random_ids(g, n):
    return torch.randint(3, 320, (n,), generator=g).tolist()


def mixed(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [random_ids(g, int(k)) for k in torch.randint(1, 150, (n,), generator=g)]  # across chunks of 64
    return prompts, [int(k) for k in torch.randint(1, 30, (n,), generator=g)]


@torch.no_grad()
def assert_full_recompute(model, prompts, answers):
    """Each answer is the greedy choice at every step of one forward over prompt + answer, with no
    state kept: the chunked rule from zeros over the whole sequence. Where the top two logits lie
    within twice the tolerance, two correct float32 paths may pick either (support.py)."""
    for prompt, answer in zip(prompts, answers):
        logits = model(torch.tensor([prompt + answer]))[0, len(prompt) - 1 : -1]  # (len(answer), V)
        wrong = (logits.argmax(-1) != torch.tensor(answer)) & (top2_margin(logits) > 2 * logits_tolerance(logits, HYBRID_REL))
        assert not wrong.any(), f"prompt of {len(prompt)} tokens: steps {wrong.nonzero().flatten().tolist()} differ"


@pytest.mark.parametrize("options", [dict(), dict(num_blocks=30), dict(prefill_chunk=7), dict(max_prefill_tokens=20)],
                         ids=["roomy", "forced-preemption", "chunked-prefill", "small-forwards"])
def test_concurrent_requests_equal_a_full_recompute(model, tok, options):
    prompts, limits = mixed(10)
    engine = HybridEngine(model, tok, **options)
    out = engine.generate(prompts, max_new_tokens=limits, eos_token_ids=())
    assert [len(r["token_ids"]) for r in out] == limits
    assert_full_recompute(model, prompts, [r["token_ids"] for r in out])
    assert (engine.scheduler.num_preemptions > 0) == ("num_blocks" in options)
    assert engine.states.slot_of == {} and engine.manager.num_free_blocks == engine.manager.num_blocks


def test_the_engine_equals_one_at_a_time_generation(model, tok):
    """The same tokens as notebook 22's generate with a hybrid cache, one request at a time."""
    prompts, limits = mixed(6, seed=1)
    out = HybridEngine(model, tok, prefill_chunk=16).generate(prompts, max_new_tokens=limits, eos_token_ids=())
    alone = [generate(model, tok, p, max_new_tokens=m, eos_token_ids=(), cache_factory=make_hybrid_cache).token_ids
             for p, m in zip(prompts, limits)]
    assert [r["token_ids"] for r in out] == alone


def test_n_choices_fork_the_state(model, tok):
    """n = 3 seeded choices share one prefill; each equals a request of its own with seed + i."""
    prompt = mixed(1, seed=2)[0][0]
    engine = HybridEngine(model, tok)
    engine.add_request(prompt, SamplingParams(temperature=1.0, seed=5), max_new_tokens=12, eos_token_ids=(), n=3)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    choices = sorted({o.request_id for o in outputs})
    got = [[o.token_id for o in outputs if o.request_id == i] for i in choices]
    assert got == [generate(model, tok, prompt, params=SamplingParams(temperature=1.0, seed=5 + i), max_new_tokens=12,
                            eos_token_ids=(), cache_factory=make_hybrid_cache).token_ids for i in range(3)]
    assert len(set(map(tuple, got))) > 1  # sampled apart: a fork sharing its parent's slot would not


def shared_prompt_requests(model, tok, **options):
    """Six chats with one 150-token system prompt, one after the other: (engine, prompts, answers)."""
    g = torch.Generator().manual_seed(3)
    system = random_ids(g, 150)
    prompts = [system + random_ids(g, int(k)) for k in torch.randint(1, 30, (6,), generator=g)]
    engine = HybridEngine(model, tok, **options)
    answers = [engine.generate([p], max_new_tokens=8, eos_token_ids=())[0]["token_ids"] for p in prompts]
    return engine, prompts, answers


def expected_hits(prompts, block_size=16, interval=64) -> int:
    """The blocks each prompt may reuse: up to the furthest boundary an earlier prompt saved its states
    at (every `interval` tokens, and its last boundary before its last token) within their common prefix."""
    saved, hits = [], 0
    for prompt in prompts:
        last = (len(prompt) - 1) // block_size * block_size
        shared = [b for q, b in saved if b <= last and q[:b] == prompt[:b]]
        hits += max(shared, default=0) // block_size
        saved += [(prompt, b) for b in range(block_size, last + 1, block_size) if b % interval == 0 or b == last]
    return hits


def test_a_shared_system_prompt_reuses_its_saved_states(model, tok):
    engine, prompts, answers = shared_prompt_requests(model, tok)
    assert_full_recompute(model, prompts, answers)
    hits = expected_hits(prompts)
    assert hits >= 5 * 8  # each later chat reuses at least 128 of the 150 shared tokens
    assert engine.manager.hits == hits and engine.manager.queries == sum(len(p) // 16 for p in prompts)
    assert engine.manager.snapshots.restored == 5
    off, _, answers_off = shared_prompt_requests(model, tok, enable_prefix_caching=False)
    assert answers_off == answers and off.manager.hits == 0


def test_a_prefix_hit_stops_where_no_state_was_saved(model, tok):
    """Cached KV blocks alone are not a hit: without the DeltaNet states after them, the prompt is
    recomputed (a silent reuse would skip those tokens in the DeltaNet layers)."""
    g = torch.Generator().manual_seed(4)
    first, more = random_ids(g, 40), random_ids(g, 60)
    for snapshots, hits in [(0, 0), (32, 2)]:  # 40 tokens save their states at 32 only: 2 blocks
        engine = HybridEngine(model, tok, state_snapshots=snapshots)
        engine.generate([first], max_new_tokens=2, eos_token_ids=())
        second = engine.generate([first + more], max_new_tokens=8, eos_token_ids=())[0]["token_ids"]
        assert engine.manager.hits == hits
        assert_full_recompute(model, [first + more], [second])


def test_snapshots_are_bounded_and_the_oldest_go_first(model, tok):
    engine, prompts, answers = shared_prompt_requests(model, tok, state_snapshots=2)
    assert_full_recompute(model, prompts, answers)
    assert len(engine.manager.snapshots.rows) == 2 and engine.manager.snapshots.saved > 2
    assert engine.states.pools[0].saved_conv.shape[0] == 2  # the rows exist, and no more
    assert HybridEngine(model, tok).states.pools[0].saved_recurrent.shape[0] == 0  # none before they are needed
    assert engine.manager.hits > 0  # the most recent boundaries stayed


def test_abort_frees_the_slot(model, tok):
    engine = HybridEngine(model, tok)
    request = engine.add_request(list(range(3, 90)), max_new_tokens=50, eos_token_ids=())
    engine.step()
    assert request in engine.states.slot_of
    engine.abort(request)
    engine.step()
    assert engine.states.slot_of == {} and not engine.has_unfinished()


def test_slots_grow_past_their_first_number(model, tok):
    prompts, limits = mixed(20, seed=5)
    engine = HybridEngine(model, tok)
    out = engine.generate(prompts, max_new_tokens=limits, eos_token_ids=())
    assert engine.states.pools[0].conv.shape[0] >= 20  # 8 slots at first, doubled while 20 ran at once
    assert_full_recompute(model, prompts, [r["token_ids"] for r in out])


@pytest.mark.parametrize("bad, message", [(dict(state_snapshots=-1), "state_snapshots must be an int >= 0"),
                                          (dict(snapshot_interval=0), "snapshot_interval must be a positive int"),
                                          (dict(snapshot_interval=40), "must be a multiple of block_size 16")])
def test_bad_options_are_refused(model, tok, bad, message):
    with pytest.raises(ValueError, match=message):
        HybridEngine(model, tok, **bad)


def test_notebook_17s_engine_names_the_hybrid_one(model, tok):
    with pytest.raises(ValueError, match="its engine is minillm.runtime.hybrid_engine.HybridEngine"):
        Engine(model, tok, num_blocks=8)


def test_a_planted_bug_is_caught(model, tok, monkeypatch):
    """A prefix hit that restores zeros instead of the saved states answers differently."""
    load = StatePool.load
    monkeypatch.setattr(StatePool, "load", lambda self, slot, row: load(self, slot, None))
    engine, prompts, answers = shared_prompt_requests(model, tok)
    with pytest.raises(AssertionError, match="differ"):
        assert_full_recompute(model, prompts, answers)



def speculate(model, tok, prompts, answers, drafter=None):
    engine = HybridSpeculativeEngine(model, tok, drafter=drafter or KnowsTheAnswers([p + a for p, a in zip(prompts, answers)]),
                                     max_batch=4)
    out = engine.generate(prompts, max_new_tokens=[len(a) for a in answers], eos_token_ids=())
    return engine, [r["token_ids"] for r in out]


def test_speculation_rolls_the_slots_back(model, tok):
    prompts, limits = mixed(3, seed=6)[0], [20, 24, 16]
    answers = [r["token_ids"] for r in HybridEngine(model, tok).generate(prompts, max_new_tokens=limits, eos_token_ids=())]
    engine, got = speculate(model, tok, prompts, answers)
    assert_full_recompute(model, prompts, got)
    assert engine.stats.drafted > engine.stats.accepted > 0  # drafts kept and drafts rejected
    assert engine.states.slot_of == {}
    ngram, got = speculate(model, tok, prompts, answers, NgramDrafter())
    assert_full_recompute(model, prompts, got)


def test_speculation_without_the_rollback_goes_wrong(model, tok, monkeypatch):
    """A planted bug: the saved slot is not restored, so the states keep the rejected drafts."""
    prompts, limits = mixed(3, seed=6)[0], [20, 24, 16]
    answers = [r["token_ids"] for r in HybridEngine(model, tok).generate(prompts, max_new_tokens=limits, eos_token_ids=())]
    monkeypatch.setattr(hybrid_engine, "restore_slot", lambda states, seq_id, saved: None)
    _, got = speculate(model, tok, prompts, answers)
    with pytest.raises(AssertionError, match="differ"):
        assert_full_recompute(model, prompts, got)
