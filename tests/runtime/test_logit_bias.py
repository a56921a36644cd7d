"""logit_bias (OpenAI's): checked at the boundary, one tensor op in the sampler, carried by every path.

The reference is transformers twice over: its SequenceBiasLogitsProcessor (a bias on one-token
sequences is OpenAI's logit_bias) for the processor, and its own model's logits plus the bias,
argmax per step (a full recompute, no cache), for stream, generate_batch and the engine."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import SequenceBiasLogitsProcessor

from support import DATA
from minillm.model.decoder import from_folder
from minillm.runtime.engine import Engine
from minillm.runtime.generate import generate, generate_batch
from minillm.runtime.sampling import SamplingParams, apply_logit_bias, make_generator, process_logits, sample
from minillm.text.tokenizer import Tokenizer
from minillm.weights.embedded import embedded_gguf_path

V = 320  # the tiny models' vocabulary


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(embedded_gguf_path())  # decodes any id < 320: the tiny models have no tokenizer


@pytest.fixture(scope="module")
def tiny():
    return from_folder(DATA / "tiny-llama")


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(DATA / "tiny-llama", attn_implementation="eager").eval()


@torch.no_grad()
def hf_greedy(hf, prompt, n, bias=None):
    """transformers' logits at every step, plus the bias as a dense (V,) row, argmax: the definition."""
    dense = torch.zeros(V)
    for token, value in (bias or {}).items():
        dense[token] = value
    ids = list(prompt)
    for _ in range(n):
        ids.append(int((hf(torch.tensor([ids])).logits[0, -1] + dense).argmax()))
    return ids[len(prompt):]


PROMPTS = [[5, 17, 200, 33, 41], [250, 8, 9], list(range(40, 90))]


def first_greedy(hf, prompt):
    return hf_greedy(hf, prompt, 1)[0]


def test_processor_equals_transformers_sequence_bias():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g) * 4
    bias = {3: -100.0, 17: 2.5, 319: 100.0, 0: -0.75}
    params = SamplingParams(logit_bias=bias)
    theirs = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()])(
        torch.zeros(5, 1, dtype=torch.long), logits.clone())
    torch.testing.assert_close(process_logits(logits, params), theirs, rtol=0, atol=0)
    ids, values = params.bias_tensors(torch.device("cpu"))
    assert ids.tolist() == sorted(bias) and values.tolist() == [bias[t] for t in sorted(bias)]


def test_sampled_with_bias_equals_sampling_biased_logits():
    """A seeded draw with logit_bias is the same draw as from logits + the dense bias: bias first, then
    penalties, temperature and the filters; logprobs stay the model's own (unbiased)."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1)) * 3
    bias = {7: 4.0, 8: -100.0, 100: 1.5}
    dense = torch.zeros(V)
    dense[list(bias)] = torch.tensor(list(bias.values()))
    knobs = dict(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=5)
    seen = [[7, 9, 100], [8], [1, 2], [100]]
    ours = sample(logits, SamplingParams(**knobs, logit_bias=bias), make_generator(5), token_ids=seen)
    ref = sample(logits + dense, SamplingParams(**knobs), make_generator(5), token_ids=seen)
    assert ours.tokens.tolist() == ref.tokens.tolist()
    assert 8 not in ours.tokens.tolist()
    torch.testing.assert_close(ours.logprobs, torch.log_softmax(logits, -1).gather(-1, ours.tokens[:, None])[:, 0])


def test_greedy_ban_and_force_match_transformers(tiny, hf, tok):
    for prompt in PROMPTS:
        first = first_greedy(hf, prompt)
        ban = {first: -100}
        ours = generate(tiny, tok, prompt, params=SamplingParams(temperature=0, logit_bias=ban),
                        max_new_tokens=12, eos_token_ids=()).token_ids
        assert first not in ours  # banned at every step, not only the first
        assert ours == hf_greedy(hf, prompt, 12, ban)
        forced = (first + 1) % V
        ours = generate(tiny, tok, prompt, params=SamplingParams(temperature=0, logit_bias={forced: 100}),
                        max_new_tokens=6, eos_token_ids=()).token_ids
        assert ours == [forced] * 6


def test_moderate_bias_changes_answers_as_transformers_does(tiny, hf, tok):
    prompt = PROMPTS[2]
    unbiased = hf_greedy(hf, prompt, 10)
    bias = {unbiased[0]: -3.0, unbiased[3]: -2.0, 77: 2.0, 78: 1.5}
    expected = hf_greedy(hf, prompt, 10, bias)
    assert expected != unbiased  # the bias matters, without forcing anything
    ours = generate(tiny, tok, prompt, params=SamplingParams(temperature=0, logit_bias=bias),
                    max_new_tokens=10, eos_token_ids=()).token_ids
    assert ours == expected
    batch = generate_batch(tiny, tok, PROMPTS, params=SamplingParams(temperature=0, logit_bias=bias),
                           max_new_tokens=10, eos_token_ids=())
    assert batch == [hf_greedy(hf, p, 10, bias) for p in PROMPTS]


@pytest.mark.parametrize("num_blocks", [256, 12], ids=["roomy", "forced-preemption"])
def test_engine_biases_each_request_and_leaves_the_others_alone(tiny, hf, tok, num_blocks):
    biases = [None, {first_greedy(hf, PROMPTS[1]): -100}, None, {61: 100},
              {first_greedy(hf, PROMPTS[1]): -100}, {5: 3.0, 6: -2.0}]
    prompts = [PROMPTS[k % 3] for k in range(len(biases))]
    engine = Engine(tiny, tok, num_blocks=num_blocks, block_size=8)
    params = [SamplingParams(temperature=0, logit_bias=b) for b in biases]
    out = engine.generate(prompts, params, max_new_tokens=10, eos_token_ids=())
    assert [r["token_ids"] for r in out] == [hf_greedy(hf, p, 10, b) for p, b in zip(prompts, biases)]
    assert out[3]["token_ids"] == [61] * 10
    assert engine.manager.num_free_blocks == num_blocks


def test_bad_logit_bias_is_refused_by_name(tiny, tok):
    for bad, says in [({5: 101}, "logit_bias[5] must be a number in [-100, 100]"),
                      ({5: float("nan")}, "logit_bias[5]"), ({"5": 1}, "logit_bias key must be a token id"),
                      ({True: 1}, "logit_bias key"), ({-1: 1}, "logit_bias key"), ([5, 1], "must be a dict"),
                      ({5: "1"}, "logit_bias[5]"), (((5, 1), (5, 2)), "without a repeated token id")]:
        with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
            SamplingParams(logit_bias=bad)
    params = SamplingParams(temperature=0, logit_bias={V: 1.0})  # valid alone: the vocabulary is the model's
    with pytest.raises(ValueError, match="logit_bias token id 320 is out of range: the model's vocabulary has 320"):
        generate(tiny, tok, [5, 6], params=params, max_new_tokens=2)
    with pytest.raises(ValueError, match="logit_bias token id 320"):
        generate_batch(tiny, tok, [[5, 6]], params=params, max_new_tokens=2)
    engine = Engine(tiny, tok, num_blocks=16)
    with pytest.raises(ValueError, match="logit_bias token id 320"):
        engine.add_request([5, 6], params, max_new_tokens=2)
    assert not engine.has_unfinished()


def test_params_stay_hashable_and_equal_by_value():
    a, b = SamplingParams(logit_bias={9: 1, 2: -3.5}), SamplingParams(logit_bias={2: -3.5, 9: 1.0})
    assert a == b and hash(a) == hash(b) and a.logit_bias == ((2, -3.5), (9, 1.0))
    assert SamplingParams(logit_bias={}).logit_bias is None and SamplingParams(logit_bias={}) == SamplingParams()
    assert a != SamplingParams(logit_bias={2: -3.5})


def test_minus_inf_stays_removed_and_input_untouched():
    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    out = apply_logit_bias(logits, torch.tensor([1, 2]), torch.tensor([100.0, -1.0]))
    assert out.tolist() == [[0.0, float("-inf"), 0.0]] and logits.tolist() == [[0.0, float("-inf"), 1.0]]
