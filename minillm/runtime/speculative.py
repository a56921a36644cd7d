# Generated from notebooks/19_speculative.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Speculative decoding: a cheap drafter proposes k tokens, the model checks them in one forward.

Built in notebooks/19_speculative.ipynb. A decode step of a small model on a CPU is bound by
reading the weights, so a forward over k + 1 positions costs about as much as over one. Greedy:
the drafts equal to the model's argmax are kept, then the model's own token, so the text is
exactly plain greedy decoding's. Sampling: draft x, drawn from the drafter's q, is kept with
probability min(1, p(x) / q(x)); at the first rejection the token is drawn from the normalised
(p - q)+, which makes every token distributed exactly as p (Leviathan, Kalman and Matias 2023,
"Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling").

Drafters: `NgramDrafter` (prompt lookup), `ModelDrafter` (any model with the same vocabulary),
`int4_drafter(model)` (the model's own int4 fast path). The KV cache is positional, so rolling
back rejected positions is free: the next forward writes over them.

Shape legend: k draft tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from minillm.model.devices import reset_peak_memory, synchronized_time
from minillm.speed.fast import FastCausalLM
from minillm.runtime.generate import Step, TextStream, generation_metrics, validate_prompt
from minillm.cache.dense import make_cache
from minillm.runtime.sampling import SamplingParams, make_generator, process_logits, sample
from minillm.utils.validate import is_positive_int


def accept_greedy(choices: torch.Tensor, draft: Sequence[int]) -> tuple[int, int]:
    """choices (k+1,): the model's argmax at each position -> (drafts kept, the token after them)."""
    chosen = choices.tolist()
    j = 0
    while j < len(draft) and draft[j] == chosen[j]:
        j += 1
    return j, chosen[j]


def accept_sampled(p: torch.Tensor, q: torch.Tensor, draft: Sequence[int],
                   generator: torch.Generator | None) -> tuple[int, int]:
    """p (k+1, V) the model's probabilities, q (k, V) the drafter's, draft (k,) drawn from q ->
    (drafts kept, the token after them), each token distributed as p."""
    for i, x in enumerate(draft):
        ratio = float(p[i, x] / q[i, x])  # q[i, x] > 0: x was drawn from q
        if ratio >= 1 or (ratio > 0 and float(torch.rand((), generator=generator, device=p.device)) < ratio):
            continue
        residual = (p[i] - q[i]).clamp(min=0)  # (V,): where the model wants more than the drafter gave
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(draft), int(torch.multinomial(p[-1], 1, generator=generator))


def one_hot_rows(draft: Sequence[int], vocab_size: int, device=None) -> torch.Tensor:
    """q (k, V) of a drafter that chose deterministically: probability 1 on each drafted token."""
    q = torch.zeros(len(draft), vocab_size, device=device)
    q[torch.arange(len(draft)), torch.tensor(list(draft), dtype=torch.long)] = 1.0
    return q


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max_ngram down to
    min_ngram) and propose the k tokens that followed it. Deterministic; needs no model."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramDrafter: need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, max_len: int) -> None:
        pass

    def propose(self, seen: list[int], k: int, params: SamplingParams, generator, prompt_len: int):
        for n in range(min(self.max_ngram, len(seen) - 1), self.min_ngram - 1, -1):
            tail = seen[-n:]
            for i in range(len(seen) - n - 1, -1, -1):  # latest first; the tail itself excluded
                if seen[i:i + n] == tail:
                    return seen[i + n:i + n + k], None
        return [], None


class ModelDrafter:
    """A draft model with the target's vocabulary, decoding k tokens ahead with its own KV cache."""

    def __init__(self, model):
        self.model = model
        self.cache, self.fed = None, []  # `fed`: the tokens whose keys and values the cache holds

    def start(self, max_len: int) -> None:
        weight = next(self.model.parameters())
        self.cache = make_cache(self.model.config, 1, max_len, dtype=weight.dtype, device=weight.device)
        self.fed = []

    def propose(self, seen: list[int], k: int, params: SamplingParams, generator, prompt_len: int):
        device = next(self.model.parameters()).device
        n = 0  # the cached prefix that is still right: rejected drafts fall out here
        while n < min(len(self.fed), len(seen) - 1) and self.fed[n] == seen[n]:
            n += 1
        ids, draft, rows = seen[n:], [], []
        for _ in range(k):
            logits = self.model(torch.tensor([ids], device=device), cache=self.cache, start_pos=n,
                                logits_to_keep=1)[:, -1]  # (1, V)
            self.fed[n:] = ids
            n += len(ids)
            processed = process_logits(logits.float(), params, [seen + draft], [prompt_len])  # (1, V)
            if params.greedy:
                token = int(processed.argmax(-1))
            else:
                rows.append(torch.softmax(processed, -1)[0])
                token = int(torch.multinomial(rows[-1], 1, generator=generator))
            draft.append(token)
            ids = [token]
        return draft, torch.stack(rows) if rows else None


def int4_drafter(model, group_size: int = 32) -> ModelDrafter:
    """Self-speculation: the model's own int4 fast path drafts for it (notebooks 12 and 13)."""
    return ModelDrafter(FastCausalLM(model, quantize="int4", group_size=group_size))


def validate_drafter(model, drafter) -> None:
    """A drafter has start() and propose(); a draft model's vocabulary must be the model's."""
    if not hasattr(drafter, "propose") or not hasattr(drafter, "start"):
        raise TypeError(f"speculative: a drafter has start() and propose(), got {type(drafter).__name__}")
    draft_model = getattr(drafter, "model", None)
    if draft_model is not None and draft_model.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"speculative: the draft model's vocabulary has {draft_model.config.vocab_size} ids, "
                         f"the model's {model.config.vocab_size}; a drafter must share the tokenizer")


def _prepare(model, tokenizer, prompt_ids, drafter, max_new_tokens, stop, eos_token_ids, num_draft, cache_factory=make_cache):
    """stream's checks and set-up -> (prompt ids, text stream, cache length, the model's cache)."""
    if not is_positive_int(num_draft):
        raise ValueError(f"num_draft must be an int >= 1, got {num_draft!r}")
    validate_drafter(model, drafter)
    weight, context = next(model.parameters()), model.config.max_position_embeddings
    prompt_ids = validate_prompt(prompt_ids, max_new_tokens, context, model.config.vocab_size)
    eos = tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids
    text_stream = TextStream(tokenizer, len(prompt_ids), max_new_tokens, context, eos, stop)
    total = min(len(prompt_ids) + max_new_tokens, context)  # the cache never needs more
    cache = cache_factory(model.config, 1, total, dtype=weight.dtype, device=weight.device)
    drafter.start(total)
    return prompt_ids, text_stream, total, cache


def judge(logits, seen, draft, q, params, generator, prompt_len):
    """The rule on the model's logits (k+1, V) at the last token and the drafts -> (kept, next token,
    logprobs of all k+1 rows). seen: the text so far, its last token included."""
    logits = logits.float()
    histories = [seen + draft[:i] for i in range(len(draft) + 1)]
    processed = process_logits(logits, params, histories, [prompt_len] * len(histories))  # (k+1, V)
    if params.greedy:
        kept, token = accept_greedy(processed.argmax(-1), draft)
    else:
        p = torch.softmax(processed, -1)
        q = one_hot_rows(draft, p.shape[-1], p.device) if q is None else q
        kept, token = accept_sampled(p, q, draft, generator)
    return kept, token, torch.log_softmax(logits, -1)


def _verify(model, cache, seen, draft, q, params, generator, prompt_len):
    """One forward over the last token and the drafts, then `judge` -> (kept, next token, logprob rows).
    A recurrent state (Qwen3.5's, notebook 22) cannot forget rejected drafts by position: it is saved
    before the forward and, after a rejection, restored and run over the kept tokens only."""
    ids = torch.tensor([[seen[-1], *draft]], device=next(model.parameters()).device)  # (1, k+1)
    states = [entry for entry in cache if hasattr(entry, "snapshot")]
    saved = [state.snapshot() for state in states]
    logits = model(ids, cache=cache, start_pos=len(seen) - 1)[0]  # (k+1, V)
    kept, token, logp = judge(logits, seen, draft, q, params, generator, prompt_len)
    if states and kept < len(draft):
        for state, copy in zip(states, saved):
            state.restore(copy)
        model(ids[:, : kept + 1], cache=cache, start_pos=len(seen) - 1, logits_to_keep=1)
    return kept, token, logp


def _round(model, cache, drafter, seen, k, params, generator, prompt_len):
    """Draft up to k tokens, verify them in one forward -> (tokens to emit, logprob rows, number drafted)."""
    draft, q = drafter.propose(seen, k, params, generator, prompt_len) if k > 0 else ([], None)
    kept, token, logp = _verify(model, cache, seen, draft, q, params, generator, prompt_len)
    return [*draft[:kept], token], logp, len(draft)


@dataclass
class SpeculationStats:
    """Counts of one generation after its prefill: the model's forwards (rounds), tokens drafted,
    drafts accepted, and tokens emitted (kept drafts plus the model's own token of each round)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    def add_round(self, drafted: int, kept: int) -> None:
        self.rounds, self.drafted, self.accepted = self.rounds + 1, self.drafted + drafted, self.accepted + kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens emitted per forward of the model after the prefill (1.0 without speculation)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def __str__(self) -> str:
        return (f"{self.accepted}/{self.drafted} drafts accepted ({self.acceptance_rate:.0%}), "
                f"{self.tokens_per_forward:.2f} tokens per forward over {self.rounds} forwards")


def next_k(k: int, num_draft: int, drafted: int, kept: int) -> int:
    """Adaptive k: one more after a round that kept every draft, one fewer after a miss (1..num_draft)."""
    if not drafted:
        return k
    return min(num_draft, k + 1) if kept == drafted else max(1, k - 1)


def top_logprob_pairs(logp: torch.Tensor, n: int | None) -> list[tuple[int, float]] | None:
    """The n most likely tokens of one row of logprobs (V,), as sample() reports them."""
    if n is None:
        return None
    values, indices = torch.topk(logp, min(n, logp.shape[-1]))
    return list(zip(indices.tolist(), values.tolist()))


@torch.no_grad()
def stream(model, tokenizer, prompt_ids: Sequence[int], drafter, params: SamplingParams = SamplingParams(temperature=0),
           max_new_tokens: int = 256, stop: Sequence[str] = (), eos_token_ids: Sequence[int] | None = None,
           num_draft: int = 4, adaptive: bool = True, stats: SpeculationStats | None = None,
           cache_factory=make_cache) -> Iterator[Step]:
    """generate.stream with a drafter: the same Steps (token ids, text, finish), fewer forwards.

    num_draft: the most tokens drafted per round (adaptive: see next_k); stats, if given, receives the counts;
    cache_factory: as generate.stream's."""
    prompt_ids, text_stream, total, cache = _prepare(model, tokenizer, prompt_ids, drafter, max_new_tokens, stop,
                                                     eos_token_ids, num_draft, cache_factory)
    device = next(model.parameters()).device
    generator, stats, k = make_generator(params.seed, device), stats or SpeculationStats(), num_draft
    reset_peak_memory(device)
    start = synchronized_time(device)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache, logits_to_keep=1)[:, -1]  # prefill (1, V)
    prefill_done = synchronized_time(device)
    pick = sample(logits, params, generator, token_ids=[prompt_ids], prompt_lengths=[len(prompt_ids)])
    first_token_at, seen = synchronized_time(device), [*prompt_ids, int(pick.tokens[0])]
    text, finish = text_stream.push(seen[-1])
    step = Step(text, seen[-1], float(pick.logprobs[0]), pick.top_logprobs[0] if pick.top_logprobs else None, finish)
    while finish is None:
        yield step
        room = min(total - len(seen), max_new_tokens - (len(seen) - len(prompt_ids)) - 1)  # slots for drafts
        tokens, logp, drafted = _round(model, cache, drafter, seen, min(k, room), params, generator, len(prompt_ids))
        stats.add_round(drafted, len(tokens) - 1)
        k = next_k(k, num_draft, drafted, len(tokens) - 1) if adaptive else k
        for i, t in enumerate(tokens):
            if finish is not None:
                break
            if i:
                yield step
            seen.append(t)
            stats.emitted += 1
            text, finish = text_stream.push(t)
            step = Step(text, t, float(logp[i, t]), top_logprob_pairs(logp[i], params.logprobs), finish)
    end = synchronized_time(device)
    step.metrics = generation_metrics(len(prompt_ids), len(seen) - len(prompt_ids), start, prefill_done, first_token_at, end, device)
    yield step
