"""The continuous-batching engine equals one-at-a-time generation, under any preemption."""

import gc
import weakref

import pytest
import torch

from support import DATA
from minillm.weights.embedded import embedded_gguf_path
from minillm.runtime.engine import Engine
from minillm.runtime.generate import generate
from minillm.model.decoder import from_folder
from minillm.runtime.sampling import SamplingParams
from minillm.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(embedded_gguf_path())  # decodes any id < 320: the tiny models have no tokenizer


@pytest.fixture(scope="module")
def tiny():
    return from_folder(DATA / "tiny-qwen3")


def mixed(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 320, (int(k),), generator=g).tolist() for k in torch.randint(1, 70, (n,), generator=g)]
    limits = [int(k) for k in torch.randint(1, 40, (n,), generator=g)]
    return prompts, limits


def alone(model, tok, prompts, limits):
    return [generate(model, tok, p, max_new_tokens=m, eos_token_ids=()).token_ids for p, m in zip(prompts, limits)]


@pytest.mark.parametrize("num_blocks", [512, 20], ids=["roomy", "forced-preemption"])
def test_sixteen_concurrent_requests_equal_one_at_a_time(tiny, tok, num_blocks):
    prompts, limits = mixed(18)
    engine = Engine(tiny, tok, num_blocks=num_blocks)
    out = engine.generate(prompts, max_new_tokens=limits, eos_token_ids=())
    assert [r["token_ids"] for r in out] == alone(tiny, tok, prompts, limits)
    assert all(r["finish_reason"] == "length" for r in out)
    assert engine.manager.num_free_blocks == num_blocks
    assert (engine.scheduler.num_preemptions > 0) == (num_blocks == 20)


def test_shared_prefix_with_prefix_caching_equals_one_at_a_time(tiny, tok):
    system = list(range(10, 60))  # 50 shared tokens: 3 full blocks
    prompts = [system + [100 + k, 101 + k] for k in range(6)]
    engine = Engine(tiny, tok, num_blocks=128, enable_prefix_caching=True)
    out = engine.generate(prompts, max_new_tokens=8, eos_token_ids=())
    assert [r["token_ids"] for r in out] == alone(tiny, tok, prompts, [8] * 6)
    assert engine.manager.num_free_blocks == 128


@pytest.mark.parametrize("max_prefill_tokens", [4096, 1], ids=["grouped", "one-per-forward"])
def test_prefix_shared_within_one_step_is_computed_before_it_is_read(tiny, tok, max_prefill_tokens):
    """Prompts admitted together: the first makes the shared blocks findable at once, but prefill
    batches run longest first, so a longer prompt reusing them must wait for the next step
    (found by comparing SmolLM2's engine run with transformers' greedy tokens)."""
    system = list(range(10, 58))  # 48 shared tokens: 3 full blocks of 16
    prompts = [system + [100, 101], system + list(range(120, 190)), system[:20]]  # 50, 118 and 20 tokens
    engine = Engine(tiny, tok, num_blocks=64, max_prefill_tokens=max_prefill_tokens)
    out = engine.generate(prompts, max_new_tokens=6, eos_token_ids=())
    assert [r["token_ids"] for r in out] == alone(tiny, tok, prompts, [6] * 3)
    assert engine.manager.hits >= 3  # the second prompt still reused the shared blocks


def test_requests_sharing_a_computed_prefix_join_together(tiny, tok):
    """A server's chats share one system prompt: the first computes its blocks, and every later
    one may reuse them at once (only blocks allocated new in a step make the next prompt wait)."""
    system = list(range(10, 58))  # 48 shared tokens: 3 full blocks of 16
    prompts = [system + [100 + k] * (k + 2) for k in range(4)]
    engine = Engine(tiny, tok, num_blocks=64)
    ids = [engine.add_request(p, max_new_tokens=4, eos_token_ids=()) for p in prompts]
    first, second = engine.step(), engine.step()
    assert {o.request_id for o in first} == {ids[0]}  # the shared blocks are being computed
    assert {o.request_id for o in second} == set(ids)  # all three others join in one step
    outputs = first + second
    while engine.has_unfinished():
        outputs += engine.step()
    got = [[o.token_id for o in outputs if o.request_id == i] for i in ids]
    assert got == alone(tiny, tok, prompts, [4] * 4)
    assert engine.manager.hits >= 9  # 3 shared blocks reused by each of the three


def test_sampled_requests_keep_their_own_seeds(tiny, tok):
    prompts, _ = mixed(6, seed=3)
    params = [SamplingParams(temperature=1.0, seed=k) for k in range(6)]
    together = Engine(tiny, tok).generate(prompts, params=params, max_new_tokens=12, eos_token_ids=())
    for p, q, r in zip(prompts, params, together):
        assert r["token_ids"] == generate(tiny, tok, p, params=q, max_new_tokens=12, eos_token_ids=()).token_ids


def test_request_that_never_fits_gets_a_clear_reason_and_abort_frees(tiny, tok):
    engine = Engine(tiny, tok, num_blocks=4)
    huge = engine.add_request(list(range(3, 100)), max_new_tokens=4)
    small = engine.add_request([5, 6, 7], max_new_tokens=4, eos_token_ids=())
    gone = engine.add_request([8, 9], max_new_tokens=40, eos_token_ids=())
    outputs = engine.step()
    engine.abort(gone)
    engine.abort(gone)  # twice, or after the end: nothing left to do
    while engine.has_unfinished():
        outputs += engine.step()
    last = {out.request_id: out for out in outputs if out.finished}
    assert last[huge].finish_reason == "error" and "needs 7 KV blocks" in last[huge].error and "pool has 4" in last[huge].error
    assert last[small].finish_reason == "length" and sum(o.request_id == small for o in outputs) == 4
    assert gone not in last and engine.finish_reasons == {"error": 1, "length": 1, "abort": 1}
    assert engine.manager.num_free_blocks == 4


def test_engine_forgets_finished_requests(tiny, tok):
    """2,000 short requests, a few at a time as a server sends them: afterwards the engine holds
    none of them, and no Sequence (with its generator and decoder) stays alive anywhere."""
    engine = Engine(tiny, tok, num_blocks=64, max_num_seqs=16)
    g = torch.Generator().manual_seed(5)
    alive, finished = [], 0
    for start in range(0, 2000, 50):
        for k in range(50):
            prompt = torch.randint(3, 320, (int(torch.randint(1, 12, (), generator=g)),), generator=g).tolist()
            params = SamplingParams(temperature=1.0, seed=start + k) if k % 2 else None
            rid = engine.add_request(prompt, params, max_new_tokens=2, eos_token_ids=())
            alive.append(weakref.ref(engine.sequences[rid]))
            if k % 10 == 3:
                engine.abort(rid)
        while engine.has_unfinished():
            finished += sum(out.finished for out in engine.step())
    gc.collect()
    assert finished == 2000 - 200 and engine.finish_reasons == {"length": 1800, "abort": 200}
    assert engine.sequences == {} and not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.manager.num_free_blocks == 64
    assert sum(ref() is not None for ref in alive) == 0


def test_eos_and_stop_strings_finish_requests(tok, smollm2):
    smol = smollm2[0]
    chats = [tok.apply_chat_template([{"role": "user", "content": q}])
             for q in ["What is the capital of France?", "Name three colors."]]
    engine = Engine(smol, tok, num_blocks=128)
    out = engine.generate(chats, max_new_tokens=40)
    for c, r in zip(chats, out):
        ref = generate(smol, tok, c, max_new_tokens=40)
        assert (r["token_ids"], r["text"], r["finish_reason"]) == (ref.token_ids, ref.text, ref.finish_reason)
    cut = Engine(smol, tok).generate(chats[:1], max_new_tokens=40, stop=["France"])[0]
    assert cut["finish_reason"] == "stop" and "France" not in cut["text"]


def test_bad_requests_fail_alone(tiny, tok):
    engine = Engine(tiny, tok)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        engine.add_request([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], max_new_tokens=3)
    assert not engine.has_unfinished()
