"""Speculation inside the engine (minillm/runtime/speculative_engine.py): greedy answers and logprobs equal to
the plain engine's for every drafter, with rejections forced at the first and the last draft, small
blocks and a pool short of blocks; the blocks of rejected drafts given back (checked against a
manager that never saw them); sampling seeded; fallback above max_batch; bad arguments."""

from __future__ import annotations

from functools import partial

import openai
import pytest
import torch
from safetensors.torch import load_file

from support import DATA, TINY
from minillm.runtime import speculative as sp
from minillm.api import LLM
from minillm.runtime.engine import Engine
from minillm.runtime.generate import generate
from minillm.model.decoder import from_folder
from minillm.cache.paged import BlockManager
from minillm.runtime.sampling import SamplingParams
from minillm.serve.server import BackgroundServer, create_app
from minillm.runtime.speculative_engine import SpeculativeEngine, rollback

SMOL_PROMPTS = ["The capital of France is", "Repeat after me: one two three, one two three, one two",
                "def fibonacci(n):"]


class ScriptedDrafter:
    """Proposes each prompt's plain greedy continuation with draft position `wrong_at` made wrong
    (None: never), to force a rejection at the first or the last draft of every round."""

    def __init__(self, continuations: dict[tuple, list[int]], wrong_at: int | None, vocab_size: int):
        self.continuations, self.wrong_at, self.vocab_size = continuations, wrong_at, vocab_size

    def start(self, max_len):
        pass

    def propose(self, seen, k, params, generator, prompt_len):
        draft = list(self.continuations[tuple(seen[:prompt_len])][len(seen) - prompt_len:][:k])
        if self.wrong_at is not None and self.wrong_at < len(draft):
            draft[self.wrong_at] = (draft[self.wrong_at] + 1) % self.vocab_size
        return draft, None


def answers(engine, prompts, n, **kwargs):
    return engine.generate(prompts, max_new_tokens=n, eos_token_ids=(), params=SamplingParams(temperature=0, logprobs=0),
                           **kwargs)


def logprobs_of(engine, prompts, n):
    """Each answer's tokens and their logprobs, streamed step by step."""
    ids = [engine.add_request(p, SamplingParams(temperature=0, logprobs=0), n, eos_token_ids=()) for p in prompts]
    got = {i: ([], []) for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                got[out.request_id][0].append(out.token_id)
                got[out.request_id][1].append(out.logprob)
    return [got[i] for i in ids]


@pytest.mark.parametrize("name", [*TINY, "smollm2"])
def test_greedy_engine_speculation_equals_the_plain_engine(name, smollm2):
    smol, tokenizer = smollm2  # its tokenizer decodes any id < 320: it serves the tiny models too
    model = smol if name == "smollm2" else from_folder(DATA / name)
    if name == "smollm2":
        prompts, n = [tokenizer.encode(p) for p in SMOL_PROMPTS], 32
    else:
        ref = load_file(DATA / name / "reference.safetensors")
        prompts, n = [ref[f"input_ids_{i}"].tolist() for i in range(3)], 32
    # block_size 4: drafts cross blocks and rejections free them; 24 blocks: short, so drafts get cut
    plain = logprobs_of(Engine(model, tokenizer, num_blocks=24 if name != "smollm2" else 64, block_size=4), prompts, n)
    continuations = {tuple(p): ids for p, (ids, _) in zip(prompts, plain)}
    drafters = {"ngram": sp.NgramDrafter(), "int4": sp.int4_drafter(model),
                **{label: ScriptedDrafter(continuations, wrong_at, model.config.vocab_size)
                   for label, wrong_at in [("wrong_first", 0), ("wrong_last", 3), ("right", None)]}}
    if name != "smollm2":
        drafters["small_model"] = sp.ModelDrafter(from_folder(DATA / "tiny-qwen2-tied"))
    for label, drafter in drafters.items():
        engine = SpeculativeEngine(model, tokenizer, num_blocks=24 if name != "smollm2" else 64, block_size=4,
                                   drafter=drafter, num_draft=4, max_batch=3)
        got = logprobs_of(engine, prompts, n)
        for (ids, logp), (ref_ids, ref_logp) in zip(got, plain):
            assert ids == ref_ids, f"{name} {label}"
            torch.testing.assert_close(torch.tensor(logp), torch.tensor(ref_logp), atol=2e-4, rtol=0)
        stats = engine.stats
        assert stats.emitted <= 3 * (n - 1)  # the rest: sampled after a prefill (a preempted one recomputes)
        assert (engine.scheduler.num_preemptions > 0) == (name != "smollm2")  # the short pool was short
        assert engine.manager.num_free_blocks == engine.manager.num_blocks  # nothing leaked
        if label == "right":
            assert stats.tokens_per_forward > 2.5 and stats.accepted == stats.drafted
        if label == "wrong_first":
            assert stats.accepted == 0


def test_rollback_leaves_the_manager_as_if_the_drafts_never_came():
    """Append drafts across blocks, roll back: tables, token counts, free blocks and prefix-cache
    hits equal a manager that appended only the kept tokens; a rejected block is never found."""
    prompt, kept, rejected = list(range(10)), [50, 51, 52], [60, 61, 62, 63, 64, 65]
    spec, ref = BlockManager(16, 4), BlockManager(16, 4)
    for manager, tokens in ((spec, kept + rejected), (ref, kept)):
        manager.allocate("a", prompt)
        for t in tokens:
            manager.append("a", t)
    assert len(spec.prefix_hits(prompt + kept + rejected[:3])) == 4  # the block with rejected drafts: found
    rollback(spec, "a", len(prompt) + len(kept))
    assert spec.tokens == ref.tokens and len(spec.tables["a"]) == len(ref.tables["a"])
    assert spec.num_free_blocks == ref.num_free_blocks
    assert len(spec.prefix_hits(prompt + kept + rejected[:3])) == 3  # now forgotten (part-full again)
    for t in [70, 71, 72, 73]:  # both go on decoding alike
        spec.append("a", t), ref.append("a", t)
    probe = prompt + kept + [70, 71, 72]  # 16 tokens: the 4th block is registered once decoding moved past it
    assert len(spec.prefix_hits(probe)) == len(ref.prefix_hits(probe)) == 4
    spec.free("a")
    assert spec.num_free_blocks == 16


def test_a_planted_bug_in_the_rollback_fails(smollm2, monkeypatch):
    """Without the rollback the rejected drafts stay in the cache: the answers change."""
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(p) for p in SMOL_PROMPTS[:2]]
    plain = answers(Engine(model, tokenizer, num_blocks=64, block_size=4), prompts, 24)
    from minillm.runtime import speculative_engine
    monkeypatch.setattr(speculative_engine, "rollback", lambda manager, seq_id, num_tokens: None)
    drafter = ScriptedDrafter({tuple(p): a["token_ids"] for p, a in zip(prompts, plain)}, 0, 49152)
    engine = SpeculativeEngine(model, tokenizer, num_blocks=64, block_size=4, drafter=drafter)
    assert [a["token_ids"] for a in answers(engine, prompts, 24)] != [a["token_ids"] for a in plain]


def test_sampled_engine_speculation_is_seeded(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(p) for p in SMOL_PROMPTS]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s) for s in (1, 2, 3)]
    runs = []
    for _ in range(2):
        engine = SpeculativeEngine(model, tokenizer, num_blocks=64, drafter=sp.int4_drafter(model), max_batch=3)
        runs.append([a["token_ids"] for a in engine.generate(prompts, params, 24, eos_token_ids=())])
        assert engine.stats.accepted > engine.stats.drafted / 2  # int4 SmolLM2 agrees with float32 mostly
    assert runs[0] == runs[1] and all(len(ids) == 24 for ids in runs[0])


def test_above_max_batch_the_engine_steps_plainly(smollm2):
    """max_batch=1 with three requests: no drafting until only one is left decoding; same answers."""
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(p) for p in SMOL_PROMPTS]
    plain = answers(Engine(model, tokenizer, num_blocks=64), prompts, [8, 16, 40])
    engine = SpeculativeEngine(model, tokenizer, num_blocks=64, drafter=sp.NgramDrafter(), max_batch=1)
    assert answers(engine, prompts, [8, 16, 40]) == plain
    assert 0 < engine.stats.emitted <= 40 - 16  # only the longest request, alone, speculated
    engine = SpeculativeEngine(model, tokenizer, num_blocks=64, drafter=sp.int4_drafter(model), max_batch=1)
    first = engine.add_request(prompts[0], None, 40, eos_token_ids=())
    for _ in range(3):  # its prefill, then two speculating steps alone
        engine.step()
    assert list(engine.drafters) == [first]
    for ids in prompts[1:]:
        engine.add_request(ids, None, 16, eos_token_ids=())
    engine.step(), engine.step()  # the two prefill (the first speculates on), then three decode
    assert not engine.drafters  # a drafter's cache may hold a context: only the speculating keep one


def test_bad_arguments_name_the_problem(smollm2):
    model, tokenizer = smollm2
    with pytest.raises(ValueError, match="num_draft must be an int >= 1"):
        SpeculativeEngine(model, tokenizer, drafter=sp.NgramDrafter(), num_draft=0)
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        SpeculativeEngine(model, tokenizer, drafter=sp.NgramDrafter(), max_batch=True)
    with pytest.raises(ValueError, match="the draft model's vocabulary has 320 ids"):
        SpeculativeEngine(model, tokenizer, drafter=sp.ModelDrafter(from_folder(DATA / "tiny-llama")))
    with pytest.raises(TypeError, match="a drafter has start"):
        SpeculativeEngine(model, tokenizer, drafter="int4")


def test_the_server_speculates_with_the_plain_answers(smollm2):
    """create_app with the speculative engine (what `serve --speculative int4` runs): the answers of
    plain greedy generation, through the official client, streamed and not."""
    model, tokenizer = smollm2
    llm = LLM(model, tokenizer)
    engine = partial(SpeculativeEngine, drafter=sp.int4_drafter(model))
    background = BackgroundServer(create_app(llm, model_name="smol", num_blocks=64, engine_class=engine))
    try:
        client = openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for question in ("What is the capital of France?", "Name three colours."):
            messages = [{"role": "user", "content": question}]
            want = generate(model, tokenizer, llm.encode_chat(messages), max_new_tokens=24).text
            answer = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0)
            assert answer.choices[0].message.content == want
            chunks = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0,
                                                    stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    finally:
        background.stop()
