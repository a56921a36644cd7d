"""Chunked prefill: a long prompt is computed a budget of tokens per step, and every answer stays
token for token what one-at-a-time generation gives (preempted, aborted, sharing a prefix)."""

import pytest
import torch

from support import DATA
from minillm.runtime import engine as engine_module
from minillm.weights.embedded import embedded_gguf_path
from minillm.runtime.engine import Engine
from minillm.runtime.generate import generate
from minillm.model.decoder import from_folder
from minillm.runtime.sequence import PREFILLING
from minillm.text.tokenizer import Tokenizer

FIXTURES = ["tiny-qwen3", "tiny-qwen2-untied", "tiny-llama"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(embedded_gguf_path())  # decodes any id < 320: the tiny models have no tokenizer


@pytest.fixture(scope="module", params=FIXTURES)
def tiny(request):
    return from_folder(DATA / request.param)


@pytest.fixture(scope="module")
def qwen3():
    return from_folder(DATA / "tiny-qwen3")


def mixed(n, seed=0, longest=90):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 320, (int(k),), generator=g).tolist() for k in torch.randint(1, longest, (n,), generator=g)]
    limits = [int(k) for k in torch.randint(1, 30, (n,), generator=g)]
    return prompts, limits


def alone(model, tok, prompts, limits):
    return [generate(model, tok, p, max_new_tokens=m, eos_token_ids=()).token_ids for p, m in zip(prompts, limits)]


def recording(monkeypatch):
    """Record, per engine step, the prompt tokens each forward computed."""
    steps = []
    real_step, real_forward = Engine.step, engine_module.forward_step

    def step(self):
        steps.append([])
        return real_step(self)

    def forward(model, cache, manager, batch, *rest):
        steps[-1].append(sum(n for _, n in batch))  # prompt tokens (a decode row counts 0)
        return real_forward(model, cache, manager, batch, *rest)

    monkeypatch.setattr(Engine, "step", step)
    monkeypatch.setattr(engine_module, "forward_step", forward)
    return steps


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("num_blocks", [512, 16], ids=["roomy", "forced-preemption"])
def test_chunked_engine_equals_one_at_a_time(tiny, tok, chunk, num_blocks, monkeypatch):
    prompts, limits = mixed(12, seed=chunk)
    steps = recording(monkeypatch)
    engine = Engine(tiny, tok, num_blocks=num_blocks, prefill_chunk=chunk)
    out = engine.generate(prompts, max_new_tokens=limits, eos_token_ids=())
    assert [r["token_ids"] for r in out] == alone(tiny, tok, prompts, limits)
    assert max(map(sum, steps)) <= chunk  # the budget holds in every step
    assert sum(map(sum, steps)) >= sum(map(len, prompts))  # every prompt computed (preempted ones again)
    assert engine.manager.num_free_blocks == num_blocks
    assert (engine.scheduler.num_preemptions > 0) == (num_blocks == 16)


def test_a_long_prompt_does_not_stall_the_running(qwen3, tok, monkeypatch):
    """A 200-token prompt arrives while two requests decode: with a budget of 32 tokens a step,
    they get a token in every step of its prefill, which takes ceil(200 / 32) steps."""
    steps = recording(monkeypatch)
    engine = Engine(qwen3, tok, num_blocks=64, prefill_chunk=32)
    running = [engine.add_request([5 + k, 6, 7], max_new_tokens=40, eos_token_ids=()) for k in range(2)]
    engine.step()
    long = engine.add_request(list(range(3, 203)), max_new_tokens=4, eos_token_ids=())
    per_step = []
    while True:
        outputs = engine.step()
        per_step.append({o.request_id for o in outputs})
        if long in per_step[-1]:
            break
    assert len(per_step) == -(-200 // 32)  # its first token comes with its last chunk
    assert all(set(running) <= ids for ids in per_step)  # nobody waited for it
    assert all(tokens == [32] for tokens in steps[1:-1]) and steps[-1] == [200 % 32]


def test_without_a_budget_the_prompt_is_one_forward(qwen3, tok, monkeypatch):
    steps = recording(monkeypatch)
    engine = Engine(qwen3, tok, num_blocks=64)
    engine.add_request(list(range(3, 203)), max_new_tokens=2, eos_token_ids=())
    engine.step()
    assert steps == [[200]]


def test_an_aborted_prefill_leaves_only_computed_blocks_findable(qwen3, tok):
    prompt = list(range(3, 103))  # 100 tokens: 6 full blocks, 2 of them computed before the abort
    engine = Engine(qwen3, tok, num_blocks=64, prefill_chunk=16)
    first = engine.add_request(prompt, max_new_tokens=6, eos_token_ids=())
    engine.step(), engine.step()
    engine.abort(first)
    assert len(engine.manager.prefix_hits(prompt)) == 2  # the blocks computed, and none past them
    result = engine.generate([prompt], max_new_tokens=6, eos_token_ids=())[0]
    assert result["token_ids"] == alone(qwen3, tok, [prompt], [6])[0]
    assert engine.manager.hits == 2


def test_planted_bug_naming_uncomputed_blocks_is_caught(qwen3, tok, monkeypatch):
    """With notebook 15's cache_computed a no-op, admission names all of a prompt's blocks at once (the rule for
    a prompt prefilled whole): an abort mid-prefill leaves named blocks that were never computed."""
    prompt = list(range(3, 103))
    monkeypatch.setattr(engine_module, "cache_computed", lambda manager, seq_id, num_computed: None)
    engine = Engine(qwen3, tok, num_blocks=64, prefill_chunk=16)
    first = engine.add_request(prompt, max_new_tokens=6, eos_token_ids=())
    engine.step(), engine.step()
    engine.abort(first)
    assert len(engine.manager.prefix_hits(prompt)) == 6  # the stale names the fix removes
    result = engine.generate([prompt], max_new_tokens=6, eos_token_ids=())[0]
    assert result["token_ids"] != alone(qwen3, tok, [prompt], [6])[0]


def test_preempted_mid_prefill_resumes_from_its_computed_blocks(qwen3, tok, monkeypatch):
    """A pool too small for everyone: the newest request is preempted while its prompt is half
    computed; readmitted, it reuses the blocks it had computed and still answers exactly."""
    victims = []
    real = engine_module.preempt_seq

    def preempt(manager, running, waiting, seq):
        victims.append((seq.status, seq.num_computed))
        return real(manager, running, waiting, seq)

    monkeypatch.setattr(engine_module, "preempt_seq", preempt)
    prompts = [list(range(3, 31)), list(range(50, 78)), list(range(100, 196))]  # 2 + 2 + 6 blocks: all of them
    engine = Engine(qwen3, tok, num_blocks=10, block_size=16, prefill_chunk=16)
    out = engine.generate(prompts, max_new_tokens=[10, 10, 4], eos_token_ids=())
    assert [r["token_ids"] for r in out] == alone(qwen3, tok, prompts, [10, 10, 4])
    assert any(status == PREFILLING and computed > 0 for status, computed in victims), victims
    assert engine.manager.hits > 0 and engine.manager.num_free_blocks == 10


def test_shared_system_prompt_chunked_with_prefix_caching(tiny, tok):
    system = list(range(10, 74))  # 64 shared tokens: 4 full blocks
    prompts = [system + list(range(100 + k, 110 + 3 * k)) for k in range(6)]
    engine = Engine(tiny, tok, num_blocks=128, prefill_chunk=24)
    out = engine.generate(prompts, max_new_tokens=8, eos_token_ids=())
    assert [r["token_ids"] for r in out] == alone(tiny, tok, prompts, [8] * 6)
    assert engine.manager.hits >= 4 * 5  # every later prompt reused the system prompt's blocks


def test_parallel_choices_fork_after_the_last_chunk(qwen3, tok):
    engine = Engine(qwen3, tok, num_blocks=64, prefill_chunk=16)
    prompt = list(range(3, 70))
    rid = engine.add_request(prompt, max_new_tokens=5, eos_token_ids=(), n=3)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    choices = {o.request_id for o in outputs}
    assert len(choices) == 3 and rid in choices
    for c in choices:
        assert [o.token_id for o in outputs if o.request_id == c] == alone(qwen3, tok, [prompt], [5])[0]


def test_smollm2_chunked_prefill_equals_generate(smollm2):
    model, tok = smollm2
    chats = [tok.apply_chat_template([{"role": "user", "content": q}])
             for q in ["What is the capital of France?", "Name three colors.", "Why is the sky blue?"]]
    out = Engine(model, tok, num_blocks=64, prefill_chunk=13).generate(chats, max_new_tokens=16)
    for chat, r in zip(chats, out):
        assert r["token_ids"] == generate(model, tok, chat, max_new_tokens=16).token_ids


@pytest.mark.parametrize("bad", [0, -4, 1.5, True, "512"])
def test_bad_prefill_chunk_is_refused(qwen3, tok, bad):
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        Engine(qwen3, tok, prefill_chunk=bad)
