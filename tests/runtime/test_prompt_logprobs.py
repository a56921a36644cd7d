"""Prompt logprobs: log_softmax of transformers' logits at every position, from our prefill and the engine's.

The reference is data/tiny-*/reference.safetensors: transformers' logits at every position of
three prompts (1, 9 and 80 tokens). The engine's scores (chunked, batched, preempted, beside
prefix-cached prompts) must equal our own one-forward `prompt_logprobs`."""

import pytest
import torch
from safetensors.torch import load_file

from support import DATA, TINY, logits_tolerance
from minillm.model.decoder import from_folder
from minillm.runtime.engine import Engine
from minillm.runtime.generate import generate, prompt_logprobs
from minillm.text.tokenizer import Tokenizer
from minillm.weights.embedded import embedded_gguf_path


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(embedded_gguf_path())  # decodes any id < 320: the tiny models have no tokenizer


@pytest.fixture(scope="module")
def tiny():
    return from_folder(DATA / "tiny-qwen3")


def reference(name, i):
    ref = load_file(DATA / name / "reference.safetensors")
    return ref[f"input_ids_{i}"].tolist(), ref[f"logits_{i}"]


@pytest.mark.parametrize("name", TINY)
def test_prompt_logprobs_equal_transformers_log_softmax(name):
    model = from_folder(DATA / name)
    for i in (1, 2):
        ids, logits = reference(name, i)
        logp = torch.log_softmax(logits, -1)  # (T, V)
        scored = prompt_logprobs(model, ids, top_logprobs=5)
        assert scored.token_ids == ids and scored.logprobs[0] is None and scored.top_logprobs[0] is None
        expected = logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        ours = torch.tensor(scored.logprobs[1:])
        torch.testing.assert_close(ours, expected, atol=logits_tolerance(logits), rtol=0)
        for p in range(1, len(ids)):
            top_ids = [t for t, _ in scored.top_logprobs[p]]
            assert top_ids[0] == int(logp[p - 1].argmax()) and len(top_ids) == 5
            values = torch.tensor([v for _, v in scored.top_logprobs[p]])
            torch.testing.assert_close(values, logp[p - 1, top_ids], atol=logits_tolerance(logits), rtol=0)


def test_single_token_and_bad_arguments(tiny):
    assert prompt_logprobs(tiny, [7]).logprobs == [None] and prompt_logprobs(tiny, [7]).top_logprobs is None
    assert prompt_logprobs(tiny, [7, 8], top_logprobs=0).top_logprobs == [None, []]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="top_logprobs must be an int >= 0"):
            prompt_logprobs(tiny, [7, 8], top_logprobs=bad)
    with pytest.raises(ValueError, match="out of range"):
        prompt_logprobs(tiny, [7, 320])


def engine_run(engine, requests):
    """Run (prompt, prompt_logprobs) requests; per request its PromptLogprobs and generated ids."""
    ids = [engine.add_request(p, max_new_tokens=6, eos_token_ids=(), prompt_logprobs=k) for p, k in requests]
    scored, tokens = {}, {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += [] if out.token_id is None else [out.token_id]
            if out.prompt_logprobs is not None:
                assert out.request_id not in scored  # once, with the first token
                scored[out.request_id] = out.prompt_logprobs
    return [scored.get(i) for i in ids], [tokens[i] for i in ids]


@pytest.mark.parametrize("engine_kwargs", [dict(num_blocks=256), dict(num_blocks=256, prefill_chunk=7),
                                           dict(num_blocks=14, block_size=8), dict(num_blocks=256, max_prefill_tokens=5)],
                         ids=["roomy", "chunked", "forced-preemption", "small-forwards"])
def test_engine_prompt_logprobs_equal_one_forward(tiny, tok, engine_kwargs):
    system = list(range(10, 58))  # a shared prefix: the scored requests must not take it from the cache
    prompts = [system + [100, 101], system + [102], list(range(200, 240)), system + [100, 101], [9, 8, 7]]
    flags = [None, 3, 0, 2, None]
    engine = Engine(tiny, tok, enable_prefix_caching=True, **engine_kwargs)
    engine_run(engine, [(system + [99], None)])  # the prefix is in the cache now
    scored, tokens = engine_run(engine, list(zip(prompts, flags)))
    for prompt, k, got, toks in zip(prompts, flags, scored, tokens):
        assert toks == generate(tiny, tok, prompt, max_new_tokens=6, eos_token_ids=()).token_ids  # answers unchanged
        if k is None:
            assert got is None
            continue
        want = prompt_logprobs(tiny, prompt, top_logprobs=k)
        assert got.token_ids == prompt and got.logprobs[0] is None
        tol = 1e-4  # our float32 paths against each other: packed and chunked against one forward
        torch.testing.assert_close(torch.tensor(got.logprobs[1:]), torch.tensor(want.logprobs[1:]), atol=tol, rtol=0)
        assert [[t for t, _ in alts] for alts in got.top_logprobs[1:]] == [[t for t, _ in alts] for alts in want.top_logprobs[1:]]
    assert engine.manager.num_free_blocks == engine_kwargs["num_blocks"]


def test_engine_refuses_bad_prompt_logprobs(tiny, tok):
    engine = Engine(tiny, tok, num_blocks=16)
    with pytest.raises(ValueError, match="prompt_logprobs must be an int >= 0 or None"):
        engine.add_request([5, 6], prompt_logprobs=-1)
    assert not engine.has_unfinished()


def test_llm_prompt_logprobs_takes_ids_or_text(tiny, tok):
    from minillm.api import LLM  # the front door over the same function

    llm = LLM(tiny, tok)
    ids = tok.encode("a b c")
    assert llm.prompt_logprobs("a b c", top_logprobs=2) == prompt_logprobs(tiny, ids, top_logprobs=2)
    assert llm.prompt_logprobs(ids).logprobs == prompt_logprobs(tiny, ids).logprobs
