"""minillm.runtime.sampling against transformers' logits processors, generate(num_beams=...) and statistics.

Every processor is run next to its transformers twin on random logits and must give the same
-inf positions and the same values (atol 1e-6). The sampler's histograms must match the
processed softmax (total variation < 0.02 over 20,000 seeded draws). Planted bugs show that
the comparisons can fail.
"""

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from support import DATA
from minillm.runtime.sampling import (
    SampleResult,
    SamplingParams,
    apply_penalties,
    apply_temperature,
    beam_search,
    make_generator,
    min_p_filter,
    process_logits,
    sample,
    top_k_filter,
    top_p_filter,
    typical_filter,
)

NO_IDS = torch.zeros(1, 1, dtype=torch.long)  # the warpers ignore input_ids


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: one thread avoids torch's thread spin-waits on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_logits(seed, B=6, V=500, scale=3.0):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * scale  # (B, V)


def assert_same_filtered(ours, theirs):
    """Same -inf positions, same finite values."""
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), (
        f"-inf positions differ in {int((torch.isinf(ours) != torch.isinf(theirs)).sum())} places"
    )
    finite = torch.isfinite(theirs)
    torch.testing.assert_close(ours[finite], theirs[finite], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- each processor vs transformers


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("t", [0.3, 0.7, 1.0, 1.8])
def test_temperature_matches_transformers(seed, t):
    z = random_logits(seed)
    assert_same_filtered(apply_temperature(z, t), TemperatureLogitsWarper(t)(NO_IDS, z.clone()))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 2, 10, 50, 499, 500, 800])
def test_top_k_matches_transformers(seed, k):
    z = random_logits(seed)
    assert_same_filtered(top_k_filter(z, k), TopKLogitsWarper(k)(NO_IDS, z.clone()))


def test_top_k_keeps_ties_like_transformers():
    z = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    assert_same_filtered(top_k_filter(z, 2), TopKLogitsWarper(2)(NO_IDS, z.clone()))
    assert int(torch.isfinite(top_k_filter(z, 2)).sum()) == 3


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.8, 0.9, 0.99])
def test_top_p_matches_transformers(seed, p):
    z = random_logits(seed)
    assert_same_filtered(top_p_filter(z, p), TopPLogitsWarper(p)(NO_IDS, z.clone()))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("p", [0.0, 0.01, 0.1, 0.3, 0.8, 1.0])
def test_min_p_matches_transformers(seed, p):
    z = random_logits(seed)
    assert_same_filtered(min_p_filter(z, p), MinPLogitsWarper(p)(NO_IDS, z.clone()))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("p", [0.05, 0.2, 0.5, 0.9, 0.99])
def test_typical_matches_transformers(seed, p):
    z = random_logits(seed)
    assert_same_filtered(typical_filter(z, p), TypicalLogitsWarper(p)(NO_IDS, z.clone()))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(seed, penalty):
    z = random_logits(seed)
    ids = torch.randint(0, z.shape[1], (z.shape[0], 40), generator=torch.Generator().manual_seed(seed + 10))
    ids[:, 20:] = ids[:, :20]  # repeats: the penalty applies once per distinct token
    ours = apply_penalties(z, ids.tolist(), repetition_penalty=penalty)
    assert_same_filtered(ours, RepetitionPenaltyLogitsProcessor(penalty)(ids, z.clone()))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.2, temperature=0.7, top_k=40, top_p=0.9),
    dict(temperature=1.3, top_p=0.8, min_p=0.05),
    dict(repetition_penalty=0.8, temperature=0.5, typical_p=0.7),
    dict(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, typical_p=0.9),
])
def test_process_logits_matches_transformers_pipeline(seed, params):
    """The whole chain, in transformers' order (penalty, temperature, top-k, top-p, min-p, typical)."""
    z = random_logits(seed)
    ids = torch.randint(0, z.shape[1], (z.shape[0], 30), generator=torch.Generator().manual_seed(seed))
    p = SamplingParams(**params)
    chain = LogitsProcessorList()
    if p.repetition_penalty != 1:
        chain.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    chain.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        chain.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        chain.append(MinPLogitsWarper(p.min_p))
    if p.typical_p < 1:
        chain.append(TypicalLogitsWarper(p.typical_p))
    assert_same_filtered(process_logits(z, p, ids.tolist()), chain(ids, z.clone()))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(1, 60), scale=st.floats(0.01, 20.0),
       p=st.floats(0.01, 0.99), k=st.integers(1, 70))
def test_filters_match_transformers_on_any_shape(seed, V, scale, p, k):
    z = random_logits(seed, B=3, V=V, scale=scale)
    assert_same_filtered(top_k_filter(z, k), TopKLogitsWarper(k)(NO_IDS, z.clone()))
    assert_same_filtered(top_p_filter(z, p), TopPLogitsWarper(p)(NO_IDS, z.clone()))
    assert_same_filtered(min_p_filter(z, p), MinPLogitsWarper(p)(NO_IDS, z.clone()))
    assert_same_filtered(typical_filter(z, p), TypicalLogitsWarper(p)(NO_IDS, z.clone()))
    for out in (top_k_filter(z, k), top_p_filter(z, p), min_p_filter(z, p), typical_filter(z, p)):
        assert torch.isfinite(out).any(dim=-1).all()  # never an empty row


def test_notebook_literals_recomputed_live():
    """The notebook stores these transformers results as literals; recompute them here."""
    z = torch.tensor([[2.1, 1.7, 1.5, 0.9, 0.4, 0.1, -0.3, -0.8, -1.2, -2.0]])
    peaked = torch.tensor([[3.0] + [1.0] * 9])

    def kept(out):
        return torch.isfinite(out[0]).nonzero().flatten().tolist()

    assert kept(TopKLogitsWarper(3)(NO_IDS, z.clone())) == [0, 1, 2]
    assert kept(TopPLogitsWarper(0.7)(NO_IDS, z.clone())) == [0, 1, 2]
    assert kept(MinPLogitsWarper(0.3)(NO_IDS, z.clone())) == [0, 1, 2, 3]
    assert kept(TypicalLogitsWarper(0.7)(NO_IDS, z.clone())) == [0, 1, 2, 3]
    assert kept(TypicalLogitsWarper(0.5)(NO_IDS, peaked.clone())) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    penalised = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[0, 3, 3, 7]]), z.clone())[0]
    torch.testing.assert_close(penalised, torch.tensor([1.4, 1.7, 1.5, 0.6, 0.4, 0.1, -0.3, -1.2, -1.2, -2.0]),
                               atol=1e-6, rtol=0)


# ---------------------------------------------------------------- planted bugs are caught


def test_planted_top_p_bug_is_caught():
    """Dropping the token that crosses the threshold (cumsum > p) must fail the comparison."""
    def buggy(logits, p):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        remove = torch.softmax(sorted_logits, -1).cumsum(-1) > p
        return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))

    z = random_logits(0)
    with pytest.raises(AssertionError):
        assert_same_filtered(buggy(z, 0.8), TopPLogitsWarper(0.8)(NO_IDS, z.clone()))


def test_planted_repetition_penalty_bug_is_caught():
    """Always dividing (also negative logits, which then *gain* probability) must fail."""
    z = random_logits(0)
    ids = torch.randint(0, z.shape[1], (z.shape[0], 40), generator=torch.Generator().manual_seed(1))
    buggy = z.clone()
    for b in range(z.shape[0]):
        seen = ids[b].unique()
        buggy[b, seen] = z[b, seen] / 1.5
    with pytest.raises(AssertionError):
        assert_same_filtered(buggy, RepetitionPenaltyLogitsProcessor(1.5)(ids, z.clone()))


def test_planted_sampling_bug_is_caught_by_total_variation():
    """Sampling from the unfiltered softmax (forgetting top-p) puts draws outside the kept set."""
    z = random_logits(3, B=1, V=30, scale=1.5)
    params = SamplingParams(top_p=0.6)
    target = torch.softmax(process_logits(z, params), -1)[0]
    draws = torch.multinomial(torch.softmax(z, -1).expand(20_000, -1), 1, generator=make_generator(0)).squeeze(-1)
    empirical = torch.bincount(draws, minlength=30).float() / 20_000
    assert 0.5 * (empirical - target).abs().sum() > 0.02


# ---------------------------------------------------------------- penalties (OpenAI semantics)


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    z = torch.tensor([[2.0, -1.0, 0.5, 0.0, 1.0], [2.0, -1.0, 0.5, 0.0, 1.0]])
    ids = [[0, 1, 2, 2, 2], [4, 4, 0]]
    out = apply_penalties(z, ids, presence_penalty=0.5, frequency_penalty=0.25, prompt_lengths=[2, 1])
    expected = z.clone()
    expected[0, 2] -= 0.5 + 0.25 * 3  # generated: 2, 2, 2
    expected[1, 4] -= 0.5 + 0.25 * 1  # generated: 4, 0
    expected[1, 0] -= 0.5 + 0.25 * 1
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    # prompt_lengths None: every id counts as generated
    out_all = apply_penalties(z[:1], [[0, 0, 3]], presence_penalty=1.0, frequency_penalty=0.5)
    torch.testing.assert_close(out_all, z[:1] - torch.tensor([[2.0, 0, 0, 1.5, 0]]), atol=1e-6, rtol=0)
    # negative penalties encourage repetition
    assert apply_penalties(z[:1], [[4]], presence_penalty=-1.0)[0, 4] == 2.0


def test_penalties_leave_input_untouched_and_neutral_is_identity():
    z = random_logits(0, B=2, V=20)
    before = z.clone()
    assert torch.equal(apply_penalties(z, [[1, 2], [3]]), z)
    apply_penalties(z, [[1, 2], [3]], repetition_penalty=2.0, presence_penalty=1.0)
    assert torch.equal(z, before)


# ---------------------------------------------------------------- sampling, seeds, logprobs


def test_same_seed_same_tokens_and_different_seed_differs():
    z = random_logits(0, B=64, V=100, scale=1.0)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    a = sample(z, p, make_generator(p.seed, "cpu")).tokens
    b = sample(z, p, make_generator(p.seed, "cpu")).tokens
    c = sample(z, p, make_generator(8, "cpu")).tokens
    assert torch.equal(a, b) and not torch.equal(a, c)
    # a generator carries on: the second step of one request differs from its first
    g = make_generator(7, "cpu")
    assert not torch.equal(sample(z, p, g).tokens, sample(z, p, g).tokens)
    assert make_generator(None, "cpu") is None


def test_greedy_is_argmax_and_uses_no_random_numbers():
    z = random_logits(1)
    g = make_generator(0, "cpu")
    state = g.get_state()
    result = sample(z, SamplingParams(temperature=0), g)
    assert torch.equal(result.tokens, z.argmax(-1))
    assert torch.equal(g.get_state(), state)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    # greedy still applies penalties: a seen argmax 1.5 above the next token loses to it
    z2 = torch.tensor([[3.0, 1.5, 0.0], [0.0, 1.0, 2.5]])
    penalised = sample(z2, SamplingParams(temperature=0, frequency_penalty=2.0), token_ids=[[0], [2]]).tokens
    assert penalised.tolist() == [1, 1] and z2.argmax(-1).tolist() == [0, 2]
    # a temperature too small to divide by in float32 counts as greedy
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=1e-5).greedy
    # process_logits for greedy keeps exactly the argmax
    assert torch.equal(torch.isfinite(process_logits(z, SamplingParams(temperature=0))).sum(-1), torch.ones(6, dtype=torch.long))


@pytest.mark.parametrize("params", [
    dict(temperature=0.9, top_k=8, top_p=0.9),
    dict(temperature=1.2, min_p=0.1),
    dict(typical_p=0.6),
    dict(temperature=0.7, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
])
def test_20k_samples_match_the_processed_distribution(params):
    z = random_logits(4, B=1, V=30, scale=1.5)
    ids = [[0, 1, 1, 2, 5, 5, 5]]
    p = SamplingParams(seed=123, **params)
    target = torch.softmax(process_logits(z, p, ids, prompt_lengths=[2]), -1)[0]
    N = 20_000
    draws = sample(z.expand(N, -1), p, make_generator(p.seed, "cpu"), ids * N, [2] * N).tokens
    empirical = torch.bincount(draws, minlength=30).float() / N
    assert 0.5 * (empirical - target).abs().sum() < 0.02
    assert empirical[target == 0].sum() == 0


def test_logprobs_are_log_softmax_of_unprocessed_logits():
    z = random_logits(2, B=5, V=50)
    p = SamplingParams(temperature=0.5, top_k=5, logprobs=4)
    result = sample(z, p, make_generator(0, "cpu"))
    assert isinstance(result, SampleResult)
    assert result.tokens.shape == (5,) and result.tokens.dtype == torch.long
    logp = torch.log_softmax(z, -1)
    torch.testing.assert_close(result.logprobs, logp.gather(-1, result.tokens[:, None])[:, 0], atol=1e-6, rtol=0)
    values, indices = logp.topk(4, dim=-1)
    for b, row in enumerate(result.top_logprobs):
        assert [i for i, _ in row] == indices[b].tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in row]), values[b], atol=1e-6, rtol=0)
        assert all(row[j][1] >= row[j + 1][1] for j in range(len(row) - 1))
    assert sample(z, SamplingParams(), make_generator(0)).top_logprobs is None
    assert sample(z, SamplingParams(logprobs=0), make_generator(0)).top_logprobs == [[]] * 5
    assert len(sample(z, SamplingParams(logprobs=99), make_generator(0)).top_logprobs[0]) == 50


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_k", -1), ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.01), ("top_p", float("nan")),
    ("min_p", -0.1), ("min_p", 1.5), ("typical_p", 0.0), ("typical_p", 1.2),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("nan")),
    ("presence_penalty", float("nan")), ("frequency_penalty", float("inf")),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("presence_penalty", 1e39),
    ("seed", 1.5), ("seed", 2**64), ("seed", -2**63 - 1), ("logprobs", -1),
])
def test_invalid_sampling_params_name_field_and_value(field, value):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value)


def test_invalid_filter_arguments():
    z = random_logits(0)
    for call, name in [(lambda: apply_temperature(z, 0.0), "temperature"), (lambda: top_k_filter(z, -1), "top_k"),
                       (lambda: top_p_filter(z, 0.0), "top_p"), (lambda: min_p_filter(z, 2.0), "min_p"),
                       (lambda: typical_filter(z, float("nan")), "typical_p"),
                       (lambda: apply_penalties(z, [[1]] * 6, repetition_penalty=0.0), "repetition_penalty")]:
        with pytest.raises(ValueError, match=name):
            call()


def test_bad_logits():
    p = SamplingParams()
    with pytest.raises(ValueError, match="logits contain NaN"):
        sample(torch.tensor([[0.0, float("nan")]]), p)
    with pytest.raises(ValueError, match="logits contain NaN"):
        top_p_filter(torch.full((2, 3), float("nan")), 0.5)
    with pytest.raises(ValueError, match="-inf"):
        sample(torch.full((1, 3), float("-inf")), p)
    with pytest.raises(ValueError, match=r"\+inf"):
        sample(torch.tensor([[0.0, float("inf")]]), p)
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        sample(torch.zeros(5), p)
    with pytest.raises(TypeError, match="logits"):
        sample(torch.zeros(1, 5, dtype=torch.long), p)
    with pytest.raises(ValueError, match=r"token_ids\[0\]"):
        apply_penalties(torch.zeros(1, 5), [[5]], repetition_penalty=1.2)
    with pytest.raises(ValueError, match="token_ids"):
        apply_penalties(torch.zeros(2, 5), [[1]], repetition_penalty=1.2)
    with pytest.raises(ValueError, match=r"prompt_lengths\[0\]"):
        apply_penalties(torch.zeros(1, 5), [[1, 2]], presence_penalty=0.5, prompt_lengths=[3])
    with pytest.raises(TypeError, match="params"):
        process_logits(torch.zeros(1, 5), {"temperature": 1.0})


# ---------------------------------------------------------------- beam search


def toy_step_fn(V=4, seed=3):
    table = torch.randn(V ** 3, V, generator=torch.Generator().manual_seed(seed)) * 2

    def step(seqs):
        rows = [sum((t + 1) * 5 ** i for i, t in enumerate(s)) % len(table) for s in seqs]
        return table[rows]  # (len(seqs), V)
    return step


@pytest.mark.parametrize("seed", [0, 3, 7])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beam_search_equals_exhaustive_search_when_nothing_is_pruned(seed, length_penalty):
    V, n, prompt = 4, 3, [1, 2]
    step = toy_step_fn(V, seed)

    def score(seq):
        total = sum(torch.log_softmax(step([prompt + seq[:i]])[0], -1)[seq[i]].item() for i in range(n))
        return total / n ** length_penalty

    exhaustive = sorted(((list(s), score(list(s))) for s in itertools.product(range(V), repeat=n)),
                        key=lambda h: -h[1])
    beams = beam_search(step, prompt, num_beams=V ** (n - 1), max_new_tokens=n, length_penalty=length_penalty)
    assert [ids for ids, _ in beams] == [ids for ids, _ in exhaustive[: V ** (n - 1)]]
    torch.testing.assert_close(torch.tensor([s for _, s in beams]),
                               torch.tensor([s for _, s in exhaustive[: V ** (n - 1)]]), atol=1e-5, rtol=0)
    greedy = []
    for _ in range(n):
        greedy.append(int(step([prompt + greedy])[0].argmax()))
    assert beam_search(step, prompt, num_beams=1, max_new_tokens=n)[0][0] == greedy


def test_beam_search_bad_input():
    step = toy_step_fn()
    with pytest.raises(ValueError, match="num_beams"):
        beam_search(step, [1], 0, 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        beam_search(step, [1], 2, 0)
    with pytest.raises(ValueError, match="length_penalty"):
        beam_search(step, [1], 2, 3, length_penalty=float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        beam_search(lambda seqs: torch.full((len(seqs), 4), float("nan")), [1], 2, 3)
    with pytest.raises(ValueError, match="one row per sequence"):
        beam_search(lambda seqs: torch.zeros(len(seqs) + 1, 4), [1], 2, 3)


@pytest.fixture(scope="module")
def hf_llama():
    return AutoModelForCausalLM.from_pretrained(DATA / "tiny-llama", attn_implementation="eager").eval()


def hf_beams(model, prompt, num_beams, max_new_tokens, eos, length_penalty):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=num_beams, num_return_sequences=num_beams, do_sample=False, early_stopping=True,
            length_penalty=length_penalty, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0],
            return_dict_in_generate=True, output_scores=True, use_cache=False,
            temperature=None, top_k=None, top_p=None,
        )
    hyps = []
    for seq, score in zip(out.sequences, out.sequences_scores):
        ids = seq[len(prompt):].tolist()
        end = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))  # padding follows the EOS
        hyps.append((ids[:end], score.item()))
    return hyps


def beam_cases(n=12, seed=1):
    """Random prompts, beam counts and length penalties; eos is chosen from the model's own favourites
    (its second greedy token, sometimes with a second eos id) so that hypotheses end early, at
    different lengths, and early stopping happens before max_new_tokens."""
    rng = random.Random(seed)
    cases = [([1, 261, 74, 147, 74], 4, 1.0, None)]  # the notebook's example, with the fixture's eos 2
    for i in range(n):
        prompt = [1] + [rng.randrange(3, 320) for _ in range(4)]
        cases.append((prompt, rng.choice([2, 3, 4]), rng.choice([1.0, 0.0, 2.0, -1.0]), i % 2 == 1))
    return cases


def eos_for(step, prompt, two_eos):
    if two_eos is None:
        return [2]
    first = int(step([prompt])[0].argmax())
    eos = [int(step([prompt + [first]])[0].argmax())]  # greedy's second token
    if two_eos:
        eos.append(int(step([prompt])[0].topk(3).indices[2]))  # the third-best first token
    return eos


@pytest.mark.parametrize("prompt, num_beams, length_penalty, two_eos", beam_cases())
def test_beam_search_matches_transformers_generate(hf_llama, prompt, num_beams, length_penalty, two_eos):
    """Same model as step_fn (transformers' own), so only the search differs."""
    def step(seqs):
        with torch.no_grad():
            return hf_llama(torch.tensor(seqs)).logits[:, -1]  # (beams, V)

    eos = eos_for(step, prompt, two_eos)
    ours = beam_search(step, prompt, num_beams, max_new_tokens=8, eos_token_ids=eos, length_penalty=length_penalty)
    theirs = hf_beams(hf_llama, prompt, num_beams, 8, eos, length_penalty)
    assert [ids for ids, _ in ours] == [ids for ids, _ in theirs]
    torch.testing.assert_close(torch.tensor([s for _, s in ours]), torch.tensor([s for _, s in theirs]),
                               atol=1e-4, rtol=0)


def test_beam_search_cases_exercise_early_endings(hf_llama):
    """Guard the fixture choice: some hypotheses end before max_new_tokens, and some searches stop early."""
    lengths = []
    for prompt, num_beams, length_penalty, two_eos in beam_cases()[1:]:
        def step(seqs):
            with torch.no_grad():
                return hf_llama(torch.tensor(seqs)).logits[:, -1]
        eos = eos_for(step, prompt, two_eos)
        lengths.append([len(ids) for ids, _ in beam_search(step, prompt, num_beams, 8, eos, length_penalty)])
    assert sum(any(n < 8 for n in ls) and any(n == 8 for n in ls) for ls in lengths) >= 2  # mixed lengths
    assert sum(max(ls) < 8 for ls in lengths) >= 2  # the whole search stopped early


@pytest.mark.parametrize("params", [
    dict(temperature=1e-300), dict(temperature=1e-6), dict(top_p=1e-300), dict(temperature=0.7, top_p=1e-300),
    dict(temperature=1e30), dict(presence_penalty=2, frequency_penalty=-2, temperature=1e-5),
    dict(presence_penalty=-2, frequency_penalty=2, min_p=0.9, temperature=2.0),
], ids=str)
def test_extreme_but_valid_params_sample_a_token(params):
    """Each value was once a NaN in torch.multinomial (found by probing the server): valid, so a token."""
    z = random_logits(1) * 30
    ids = [list(range(0, 50, 3)) + [int(z[b].argmax())] * 5 for b in range(z.shape[0])]
    tokens = sample(z, SamplingParams(**params, seed=0), make_generator(0), token_ids=ids).tokens
    assert tokens.shape == (z.shape[0],) and ((0 <= tokens) & (tokens < z.shape[1])).all()
