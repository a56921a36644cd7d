"""Speculative decoding (minillm/runtime/speculative.py): greedy output identical to plain greedy decoding for
every drafter, the sampling rule's output distributed exactly as the model's (a planted bug fails),
and rejected positions rolled back in both caches."""

from __future__ import annotations

import inspect

import pytest
import torch
from safetensors.torch import load_file

from support import DATA, TINY
from minillm.runtime import speculative as sp
from minillm.api import LLM
from minillm.runtime.generate import generate
from minillm.cache.dense import make_cache
from minillm.model.decoder import from_folder
from minillm.runtime.sampling import SamplingParams

SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little"]


class ScriptedDrafter:
    """Proposes the plain greedy continuation with one token made wrong at draft position `wrong_at`
    (None: never wrong), to force a rejection at the first or the last position of every round."""

    def __init__(self, continuation: list[int], prompt_len: int, wrong_at: int | None, vocab_size: int):
        self.continuation, self.prompt_len, self.wrong_at, self.vocab_size = continuation, prompt_len, wrong_at, vocab_size

    def start(self, max_len):
        pass

    def propose(self, seen, k, params, generator, prompt_len):
        at = len(seen) - self.prompt_len
        draft = list(self.continuation[at:at + k])
        if self.wrong_at is not None and self.wrong_at < len(draft):
            draft[self.wrong_at] = (draft[self.wrong_at] + 1) % self.vocab_size
        return draft, None


def model_drafters(model) -> dict:
    """The drafters that hold a model: built once per model (int4 quantizes SmolLM2 in a few seconds)."""
    found = {"ngram": sp.NgramDrafter(), "int4": sp.int4_drafter(model)}
    if model.config.vocab_size == 320:  # the tiny checkpoints share a vocabulary: one drafts for another
        found["small_model"] = sp.ModelDrafter(from_folder(DATA / "tiny-qwen2-tied"))
    return found


def scripted_drafters(continuation, prompt_len, vocab_size) -> dict:
    return {label: ScriptedDrafter(continuation, prompt_len, wrong_at, vocab_size)
            for label, wrong_at in [("wrong_first", 0), ("wrong_last", 3), ("right", None)]}


def speculative_ids(model, tokenizer, ids, drafter, n, stats=None, **kwargs):
    return [s.token_id for s in sp.stream(model, tokenizer, ids, drafter, max_new_tokens=n, eos_token_ids=(),
                                          num_draft=4, stats=stats, **kwargs)]


@pytest.mark.parametrize("name", [*TINY, "smollm2"])
def test_greedy_speculation_equals_plain_greedy_for_every_drafter(name, smollm2):
    smol, tokenizer = smollm2  # its tokenizer decodes any id < 320: it serves the tiny models too
    model = smol if name == "smollm2" else from_folder(DATA / name)
    if name == "smollm2":
        prompts, n = [tokenizer.encode(p) for p in SMOL_PROMPTS], 64
    else:
        ref = load_file(DATA / name / "reference.safetensors")
        prompts, n = [ref[f"input_ids_{i}"].tolist() for i in range(3)], 32
    shared = model_drafters(model)
    for ids in prompts:
        plain = generate(model, tokenizer, ids, max_new_tokens=n, eos_token_ids=()).token_ids
        for label, drafter in {**shared, **scripted_drafters(plain, len(ids), model.config.vocab_size)}.items():
            stats = sp.SpeculationStats()
            assert speculative_ids(model, tokenizer, ids, drafter, n, stats) == plain, f"{name} {label}"
            assert stats.emitted == n - 1  # the prefill's token, then every round's
            if label == "right":
                assert stats.accepted == stats.drafted and stats.tokens_per_forward > 3
            if label == "wrong_first":
                assert stats.accepted == 0 and stats.tokens_per_forward == 1.0


def test_a_planted_bug_in_the_greedy_rule_fails(smollm2):
    """Keeping the first draft unconditionally changes the text: the comparison above can fail."""
    model, tokenizer = smollm2
    ids = tokenizer.encode(SMOL_PROMPTS[0])
    plain = generate(model, tokenizer, ids, max_new_tokens=16, eos_token_ids=()).token_ids
    source = inspect.getsource(sp.accept_greedy).replace("j = 0\n", "j = 1 if draft else 0\n")
    namespace = dict(vars(sp))
    exec(compile(source, "planted", "exec"), namespace)
    original, sp.accept_greedy = sp.accept_greedy, namespace["accept_greedy"]
    try:
        got = speculative_ids(model, tokenizer, ids, ScriptedDrafter(plain, len(ids), 0, 49152), 16)
    finally:
        sp.accept_greedy = original
    assert got != plain


def _first_tokens(rule, p, q, draws: int, seed: int = 0) -> torch.Tensor:
    """The distribution of the first token the rule emits, x drawn from q[0], over many draws."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(draws):
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(q.shape[0])]
        kept, token = rule(p, q, draft, g)
        counts[draft[0] if kept > 0 else token] += 1
    return counts / draws


def _toy(seed=1, V=6, k=2):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(k + 1, V, generator=g), -1)
    q = torch.softmax(2 * torch.randn(k, V, generator=g), -1)
    return p, q


def test_the_sampling_rule_emits_the_models_distribution():
    """Total variation between the emitted token's frequencies and p: only sampling noise (about
    0.5 x sqrt(V / draws) = 0.009 here); the drafter's q, far from p, leaves no trace."""
    p, q = _toy()
    assert 0.5 * (p[0] - q[0]).abs().sum() > 0.3  # a drafter that disagrees a lot
    freq = _first_tokens(sp.accept_sampled, p, q, 20_000)
    assert 0.5 * (freq - p[0]).abs().sum() < 0.025


def test_a_planted_bug_in_the_sampling_rule_fails():
    """Accepting x whenever p(x) > q(x), instead of with probability min(1, p/q), skews the output."""
    source = inspect.getsource(sp.accept_sampled)
    old = "if ratio >= 1 or (ratio > 0 and float(torch.rand((), generator=generator, device=p.device)) < ratio):"
    assert old in source
    namespace = dict(vars(sp))
    exec(compile(source.replace(old, "if ratio > 1:"), "planted", "exec"), namespace)
    p, q = _toy()
    freq = _first_tokens(namespace["accept_sampled"], p, q, 20_000)
    assert 0.5 * (freq - p[0]).abs().sum() > 0.1


def test_sampled_speculation_is_seeded_and_uses_the_drafter(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer.encode(SMOL_PROMPTS[2])
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    drafter = sp.int4_drafter(model)
    stats = sp.SpeculationStats()
    a = speculative_ids(model, tokenizer, ids, drafter, 24, stats, params=params)
    b = speculative_ids(model, tokenizer, ids, drafter, 24, params=params)
    assert a == b and len(a) == 24
    assert stats.accepted > stats.drafted / 2  # int4 SmolLM2 agrees with float32 most of the time


@torch.no_grad()
def test_rejected_positions_are_rolled_back_in_both_caches():
    """After rounds with rejections, each cache's valid positions equal a plain prefill of the tokens kept."""
    model, draft_model = from_folder(DATA / "tiny-llama"), from_folder(DATA / "tiny-qwen2-tied")
    ids = load_file(DATA / "tiny-llama" / "reference.safetensors")["input_ids_1"].tolist()  # 9 tokens
    params = SamplingParams(temperature=0)
    cache = make_cache(model.config, 1, 64)
    model(torch.tensor([ids]), cache=cache)
    seen = ids + [int(model(torch.tensor([ids]))[0, -1].argmax())]
    drafter = sp.ModelDrafter(draft_model)
    drafter.start(64)
    rejected = 0
    for _ in range(4):
        draft, q = drafter.propose(seen, 4, params, None, len(ids))
        kept, token, _ = sp._verify(model, cache, seen, draft, q, params, None, len(ids))
        rejected += kept < len(draft)
        seen += [*draft[:kept], token]
        plain = make_cache(model.config, 1, 64)
        model(torch.tensor([seen[:-1]]), cache=plain)
        n = len(seen) - 1
        for layer, ref in zip(cache, plain):
            torch.testing.assert_close(layer.k[:, :, :n], ref.k[:, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer.v[:, :, :n], ref.v[:, :, :n], atol=1e-5, rtol=1e-5)
    assert rejected >= 2  # two random models disagree: the rollback was exercised
    n = next(i for i, (a, b) in enumerate(zip(drafter.fed + [None], seen)) if a != b)
    plain = make_cache(draft_model.config, 1, 64)
    draft_model(torch.tensor([seen[:n]]), cache=plain)
    for layer, ref in zip(drafter.cache, plain):  # the drafter's cache: right up to its first wrong token
        torch.testing.assert_close(layer.k[:, :, :n], ref.k[:, :, :n], atol=1e-5, rtol=1e-5)


def test_bad_arguments_name_the_problem(smollm2):
    model, tokenizer = smollm2
    with pytest.raises(ValueError, match="num_draft must be an int >= 1"):
        next(sp.stream(model, tokenizer, [1, 2], sp.NgramDrafter(), num_draft=0))
    with pytest.raises(ValueError, match="the draft model's vocabulary has 320 ids, the model's 49152"):
        next(sp.stream(model, tokenizer, [1, 2], sp.ModelDrafter(from_folder(DATA / "tiny-llama"))))
    with pytest.raises(TypeError, match="a drafter has start"):
        next(sp.stream(model, tokenizer, [1, 2], "int4"))
    with pytest.raises(ValueError, match="min_ngram"):
        sp.NgramDrafter(max_ngram=1, min_ngram=2)


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = sp.NgramDrafter(max_ngram=2)
    seen = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6]
    assert d.propose(seen, 3, SamplingParams(temperature=0), None, 0) == ([9, 2, 5], None)  # latest "5 6"
    assert d.propose([1, 2, 3], 3, SamplingParams(temperature=0), None, 0) == ([], None)  # no earlier match


def test_the_api_takes_a_drafter_by_name(smollm2):
    """LLM.chat / generate / stream with speculative= give the answer of plain decoding."""
    llm = LLM(*smollm2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = llm.chat(messages, max_new_tokens=24)
    for speculative in ("ngram", "int4", sp.NgramDrafter(max_ngram=2)):
        assert llm.chat(messages, max_new_tokens=24, speculative=speculative).token_ids == plain.token_ids
    assert "".join(llm.stream(messages, max_new_tokens=24, speculative="ngram")) == plain.text
    assert llm.generate("The capital of France is", max_new_tokens=8, speculative="ngram").text == \
        llm.generate("The capital of France is", max_new_tokens=8).text
