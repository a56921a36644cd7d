# Generated from notebooks/09_sampling.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Sampling: logits processors, seeded sampling with logprobs, and beam search.

Built in notebooks/09_sampling.ipynb, which explains each step; tests/runtime/test_sampling.py checks
every processor transformers also has against its LogitsProcessors, and the sampler's histograms
against the target distribution.

Order of processing: logit_bias first (as vLLM), then the order transformers applies them:
penalties, temperature, top-k, top-p, min-p, typical. Every processor maps (B, V) logits to (B, V) logits, with removed
tokens set to -inf. V is the vocabulary size, B the batch.

References:
- A. Holtzman et al., "The Curious Case of Neural Text Degeneration" (2019): top-p (nucleus).
- N. Nguyen et al., "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM Outputs" (2024).
- C. Meister et al., "Locally Typical Sampling" (2022).
- N. S. Keskar et al., "CTRL" (2019): the repetition penalty.
- OpenAI API reference: presence and frequency penalties, logprobs / top_logprobs.
- transformers' generation/logits_process.py and beam search in generation/utils.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence

import torch

from minillm.model.devices import on_host
from minillm.utils.validate import is_int, is_number, shown


def _validate_logits(logits: torch.Tensor, name: str = "logits") -> None:
    """Type and shape always; the values (NaN, +inf, a row all -inf) where the logits are on the CPU.

    Reading values back from a GPU would stall it once per token, so there only type and shape
    are checked: the values come from the model, not from a request."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {type(logits).__name__}"
                        + (f" of dtype {logits.dtype}" if isinstance(logits, torch.Tensor) else ""))
    if logits.ndim != 2 or logits.shape[-1] == 0:
        raise ValueError(f"{name} must have shape (B, V) with V >= 1, got {tuple(logits.shape)}")
    if not on_host(logits):
        return
    row_max = logits.amax(dim=-1)  # (B,): one pass finds all three; NaN wins a max, then +inf
    if bool(torch.isfinite(row_max).all()):
        return  # the common case: one test; the three below only name what went wrong
    if torch.isnan(row_max).any():
        raise ValueError(f"{name} contain NaN")
    if torch.isposinf(row_max).any():
        raise ValueError(f"{name} contain +inf")
    if torch.isneginf(row_max).any():
        raise ValueError(f"{name} have a row where every value is -inf (nothing left to sample)")


def _check(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _is_real(x) -> bool:
    return is_number(x) and math.isfinite(x)


def _validate_penalty_args(B: int, token_ids, repetition_penalty, presence_penalty, frequency_penalty,
                        prompt_lengths) -> None:
    """apply_penalties' argument checks, each naming the argument and its value."""
    _check("repetition_penalty", repetition_penalty, _is_real(repetition_penalty) and repetition_penalty > 0, "> 0")
    _check("presence_penalty", presence_penalty, _is_real(presence_penalty), "a finite number")
    _check("frequency_penalty", frequency_penalty, _is_real(frequency_penalty), "a finite number")
    _check("token_ids", f"{len(token_ids)} rows", len(token_ids) == B, f"one list per logits row ({B} rows)")
    if prompt_lengths is not None:
        _check("prompt_lengths", f"{len(prompt_lengths)} entries", len(prompt_lengths) == B, f"one per row ({B})")


def _validate_beam_args(num_beams, max_new_tokens, length_penalty) -> None:
    _check("num_beams", num_beams, is_int(num_beams) and num_beams >= 1, "an int >= 1")
    _check("max_new_tokens", max_new_tokens, is_int(max_new_tokens) and max_new_tokens >= 1, "an int >= 1")
    _check("length_penalty", length_penalty, _is_real(length_penalty), "a finite number")


def _validate_step_logits(logits: torch.Tensor, rows: int) -> None:
    """step_fn's logits: valid logits, one row per running sequence."""
    _validate_logits(logits, "step_fn logits")
    _check("step_fn logits", f"{logits.shape[0]} rows", logits.shape[0] == rows, f"one row per sequence ({rows})")


def apply_temperature(logits: torch.Tensor, t: float) -> torch.Tensor:
    """logits / t for t > 0 (t < 1 sharpens, t > 1 flattens). Temperature 0 is greedy: see `sample`."""
    _validate_logits(logits)
    _check("temperature", t, _is_real(t) and t > 0, "> 0 here (temperature 0 means greedy, handled by sample)")
    return (logits / t).clamp(max=torch.finfo(logits.dtype).max)  # an overflow: the largest float, not +inf


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row (and ties with the k-th); k = 0 or k >= V keeps all."""
    _validate_logits(logits)
    _check("top_k", k, is_int(k) and k >= 0, "an int >= 0 (0 = off)")
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1): the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the most likely tokens until their mass reaches p; the token that crosses p is kept."""
    _validate_logits(logits)
    _check("top_p", p, _is_real(p) and 0 < p <= 1, "in (0, 1]")
    if p == 1:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V): mass of the more likely tokens
    remove_sorted = mass_before >= p
    remove_sorted[:, 0] = False  # the most likely token always stays (a p below float32's range rounds to 0)
    remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep tokens with probability >= p * (probability of the most likely token)."""
    _validate_logits(logits)
    _check("min_p", p, _is_real(p) and 0 <= p <= 1, "in [0, 1]")
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    remove = probs < p * probs.amax(dim=-1, keepdim=True)  # the top token never satisfies this
    return logits.masked_fill(remove, float("-inf"))


def typical_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Locally typical sampling: keep tokens whose surprise -log p_i is closest to the entropy, up to mass p."""
    _validate_logits(logits)
    _check("typical_p", p, _is_real(p) and 0 < p <= 1, "in (0, 1]")
    if p == 1:
        return logits
    logp = torch.log_softmax(logits, dim=-1)  # (B, V)
    entropy = -(logp.exp() * logp).nansum(dim=-1, keepdim=True)  # (B, 1); 0 * -inf counts as 0
    distance = (-logp - entropy).abs()  # (B, V): how atypical each token is
    sorted_distance, order = torch.sort(distance, dim=-1)  # most typical first
    mass = torch.softmax(logits.gather(-1, order), dim=-1).cumsum(dim=-1)  # (B, V)
    last = (mass < p).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)  # (B, 1): crosses p
    remove_sorted = sorted_distance > sorted_distance.gather(-1, last)
    remove_sorted[:, 0] = False  # keep at least one token
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    token_ids: Sequence[Sequence[int]],
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    prompt_lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """Penalise tokens already seen. token_ids[b]: row b's ids so far (prompt + generated).

    repetition_penalty (as transformers): every seen token's logit is divided by it if > 0,
    multiplied if < 0. presence/frequency (as OpenAI): subtract presence * [count > 0] +
    frequency * count, counting only generated ids (ids after prompt_lengths[b]; all ids
    when prompt_lengths is None).
    """
    _validate_logits(logits)
    B, V = logits.shape
    _validate_penalty_args(B, token_ids, repetition_penalty, presence_penalty, frequency_penalty, prompt_lengths)
    out = logits.clone()
    for b, ids in enumerate(token_ids):
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= V):  # checked in Python, before the ids go to the device
            raise ValueError(f"token_ids[{b}] must be in [0, {V}), got min {min(ids)} max {max(ids)}")
        ids = torch.as_tensor(ids, dtype=torch.long, device=logits.device)
        if repetition_penalty != 1.0 and ids.numel():
            seen = ids.unique()
            z = out[b, seen]
            out[b, seen] = torch.where(z < 0, z * repetition_penalty, z / repetition_penalty)
        if presence_penalty != 0.0 or frequency_penalty != 0.0:
            start = 0 if prompt_lengths is None else prompt_lengths[b]
            _check(f"prompt_lengths[{b}]", start, is_int(start) and 0 <= start <= len(ids), f"an int in [0, {len(ids)}]")
            generated = ids[start:]
            counts = torch.bincount(generated, minlength=V).to(out.dtype)  # (V,)
            seen = counts > 0  # only seen tokens are touched: a huge penalty gives -inf there, never inf * 0 = NaN
            out[b] -= torch.where(seen, presence_penalty + frequency_penalty * counts, torch.zeros_like(counts))
            out[b].clamp_(max=torch.finfo(out.dtype).max)  # a huge negative penalty: the largest float, not +inf
    return out


def apply_logit_bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """OpenAI's logit_bias: values (K,) added to columns ids (K,) of every row of (B, V) logits, in one
    tensor op. -inf stays -inf (a removed token is not brought back); ids are checked at the boundary."""
    _validate_logits(logits)
    bias = values.to(logits.dtype)[None].expand(logits.shape[0], -1)  # (B, K)
    return logits.index_add(-1, ids, bias)


GREEDY_BELOW = 1e-5  # a temperature below this is greedy


@dataclass(frozen=True)
class SamplingParams:
    """Sampling knobs of one request; neutral defaults. temperature 0 = greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # return the top-n logprobs per token
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias in [-100, 100]; kept as sorted pairs

    def __post_init__(self):
        _validate_params(self)
        _freeze_bias(self)  # the dict becomes a hashable tuple of pairs, and two tensors (Plumbing, below)

    def bias_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (K,) ids and (K,) values on `device`: made at validation, copied once per device."""
        if device not in self._bias:
            ids, values = self._bias["cpu"]
            self._bias[device] = (ids.to(device), values.to(device))
        return self._bias[device]

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below GREEDY_BELOW: dividing by a tinier one overflows float32 (as vLLM does)."""
        return self.temperature < GREEDY_BELOW


def _validate_params(params: SamplingParams) -> None:
    """SamplingParams' field checks, each naming the field and its value (called by __post_init__)."""
    _check("temperature", params.temperature, _is_real(params.temperature) and params.temperature >= 0, ">= 0 (0 = greedy)")
    _check("top_k", params.top_k, is_int(params.top_k) and params.top_k >= 0, "an int >= 0 (0 = off)")
    _check("top_p", params.top_p, _is_real(params.top_p) and 0 < params.top_p <= 1, "in (0, 1]")
    _check("min_p", params.min_p, _is_real(params.min_p) and 0 <= params.min_p <= 1, "in [0, 1]")
    _check("typical_p", params.typical_p, _is_real(params.typical_p) and 0 < params.typical_p <= 1, "in (0, 1]")
    _check("repetition_penalty", params.repetition_penalty,
           _is_real(params.repetition_penalty) and params.repetition_penalty > 0, "> 0")
    for name in ("presence_penalty", "frequency_penalty"):  # OpenAI's range (and vLLM's)
        value = getattr(params, name)
        _check(name, value, _is_real(value) and -2 <= value <= 2, "in [-2, 2]")
    _check("seed", params.seed, params.seed is None or (is_int(params.seed) and -2**63 <= params.seed < 2**64),
           "an int in [-2**63, 2**64) or None (what torch.Generator takes)")
    _check("logprobs", params.logprobs, params.logprobs is None or (is_int(params.logprobs) and params.logprobs >= 0),
           "an int >= 0 or None")
    _validate_bias(params.logit_bias)


def _bias_pairs(bias) -> list[tuple]:
    """logit_bias's (id, bias) pairs, from a dict or from the sorted pairs a SamplingParams keeps."""
    if isinstance(bias, Mapping):
        return list(bias.items())
    pairs = list(bias) if isinstance(bias, (list, tuple)) else None
    if pairs is None or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise ValueError(f"logit_bias must be a dict {{token id: bias}} or None, got {shown(bias)}")
    return pairs


def _validate_bias(bias) -> None:
    """Each logit_bias key a token id (an int >= 0; a JSON client's "504" is the server's to convert),
    each value a number in [-100, 100] (OpenAI's range). The vocabulary's end: validate_logit_bias."""
    if bias is None:
        return
    pairs = _bias_pairs(bias)
    for token, value in pairs:
        _check("logit_bias key", token, is_int(token) and token >= 0, "a token id (an int >= 0)")
        _check(f"logit_bias[{token}]", value, _is_real(value) and -100 <= value <= 100, "a number in [-100, 100]")
    _check("logit_bias", shown(bias), len({t for t, _ in pairs}) == len(pairs), "without a repeated token id")


def _freeze_bias(params: SamplingParams) -> None:
    """A validated logit_bias as sorted (id, bias) pairs, None when empty: hashable, so that equal
    requests still share one sampling call; and its ids and values as tensors, built once, here."""
    pairs = tuple(sorted((int(t), float(b)) for t, b in _bias_pairs(params.logit_bias or {})))
    object.__setattr__(params, "logit_bias", pairs or None)
    ids, values = (torch.tensor([t for t, _ in pairs], dtype=torch.long), torch.tensor([b for _, b in pairs]))
    object.__setattr__(params, "_bias", {"cpu": (ids, values)})  # not a field: neither compared nor hashed


def validate_logit_bias(params: SamplingParams | None, vocab_size: int) -> None:
    """At a request's boundary (stream, generate_batch, the engine): every logit_bias id inside the
    model's vocabulary, which SamplingParams cannot know. Its pairs are sorted: the last is the largest."""
    if params is not None and params.logit_bias and params.logit_bias[-1][0] >= vocab_size:
        raise ValueError(f"logit_bias token id {params.logit_bias[-1][0]} is out of range: "
                         f"the model's vocabulary has {vocab_size} ids")


def biased_and_penalised(logits: torch.Tensor, params: SamplingParams, token_ids: Sequence[Sequence[int]] | None = None,
                         prompt_lengths: Sequence[int] | None = None) -> torch.Tensor:
    """The first steps of process_logits (validated): logit_bias, then the penalties (when token_ids is given)."""
    _validate_logits(logits)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    if params.logit_bias:
        logits = apply_logit_bias(logits, *params.bias_tensors(logits.device))
    penalised = params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0
    if penalised and token_ids is not None:
        logits = apply_penalties(logits, token_ids, params.repetition_penalty, params.presence_penalty,
                                 params.frequency_penalty, prompt_lengths)
    return logits


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    token_ids: Sequence[Sequence[int]] | None = None,
    prompt_lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """(B, V) logits -> (B, V) logits to sample from: logit_bias (first, as vLLM), then transformers'
    order: penalties (only when token_ids is given), temperature, top-k, top-p, min-p, typical.
    Greedy (temperature 0) keeps only the argmax of the penalised logits."""
    logits = biased_and_penalised(logits, params, token_ids, prompt_lengths)
    if params.greedy:
        best = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        return torch.full_like(logits, float("-inf")).scatter(-1, best, logits.gather(-1, best))
    if params.temperature != 1:
        logits = apply_temperature(logits, params.temperature)
    if params.top_k:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p < 1:
        logits = top_p_filter(logits, params.top_p)
    if params.min_p > 0:
        logits = min_p_filter(logits, params.min_p)
    if params.typical_p < 1:
        logits = typical_filter(logits, params.typical_p)
    return logits


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A torch.Generator on `device` seeded with `seed`, or None (use torch's global RNG) when seed is None."""
    if seed is None:
        return None
    _check("seed", seed, is_int(seed), "an int or None")
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class SampleResult:
    """tokens (B,) long; logprobs (B,): log-softmax of the unprocessed logits at each chosen token;
    top_logprobs: per row, [(token_id, logprob)] for the top-n tokens, most likely first, or None."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_logprobs: list[list[tuple[int, float]]] | None = None


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    prompt_lengths: Sequence[int] | None = None,
) -> SampleResult:
    """Choose one token per row of (B, V) logits: argmax when params.greedy, else a draw with `generator`."""
    if params.greedy:  # the argmax of process_logits' output, without building its -inf rows
        tokens = biased_and_penalised(logits, params, token_ids, prompt_lengths).argmax(dim=-1)  # (B,), validates
    else:
        processed = process_logits(logits, params, token_ids, prompt_lengths)  # (B, V), validates
        probs = torch.softmax(processed.float(), dim=-1)  # (B, V)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, V), of the unprocessed logits
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)  # (B,)
    top = None
    if params.logprobs is not None:
        values, indices = torch.topk(logp, min(params.logprobs, logp.shape[-1]), dim=-1)  # (B, n)
        top = [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
    return SampleResult(tokens, chosen, top)


def beam_search(
    step_fn: Callable[[list[list[int]]], torch.Tensor],
    input_ids: list[int],
    num_beams: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    length_penalty: float = 1.0,
) -> list[tuple[list[int], float]]:
    """Beam search as transformers' generate(num_beams=n, early_stopping=True, do_sample=False).

    step_fn(sequences) -> (len(sequences), V) next-token logits for each full sequence (prompt +
    generated). Returns up to num_beams (generated ids, score), best first; the ids include the EOS
    that ended a hypothesis; score = sum of token logprobs / len(ids) ** length_penalty."""
    _validate_beam_args(num_beams, max_new_tokens, length_penalty)
    eos = set(eos_token_ids)
    keep = max(2, 1 + len(eos)) * num_beams  # candidates kept per step, as transformers
    running: list[tuple[list[int], float]] = [([], 0.0)]  # (generated ids, sum of logprobs)
    finished: list[tuple[list[int], float]] = []  # (generated ids, length-penalised score)
    for step in range(max_new_tokens):
        logits = step_fn([list(input_ids) + ids for ids, _ in running])
        _validate_step_logits(logits, len(running))
        V = logits.shape[-1]
        sums = torch.tensor([s for _, s in running], dtype=torch.float32, device=logits.device)
        total = torch.log_softmax(logits.float(), dim=-1) + sums[:, None]  # (beams, V)
        values, flat = torch.topk(total.flatten(), min(keep, total.numel()))  # best candidates
        last = step == max_new_tokens - 1
        pool_full = len(finished) == num_beams  # early stopping: the pool takes nothing more
        next_running, new_finished = [], []
        for rank, (score, index) in enumerate(zip(values.tolist(), flat.tolist())):
            beam, token = divmod(index, V)
            ids = running[beam][0] + [token]
            if token in eos or last:
                if rank < num_beams and not pool_full:
                    new_finished.append((ids, score / len(ids) ** length_penalty))
            elif len(next_running) < num_beams:
                next_running.append((ids, score))
        finished = sorted(finished + new_finished, key=lambda h: -h[1])[:num_beams]  # stable: older first on ties
        running = next_running
        if len(finished) == num_beams or not running:
            break
    return finished
