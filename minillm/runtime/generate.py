# Generated from notebooks/10_generate.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The generation loop: prefill, decode, sample, stream, stop; metrics.

Built in notebooks/10_generate.ipynb from the model (05), weights (06), tokenizer (07),
KV cache (08) and sampling (09). The loop is a generator of `Step`s, so streaming, stopping
early and Ctrl-C need nothing special. Metrics follow the Candle article's InferenceMetrics.
`LLM`, a model and its tokenizer in one object, is minillm/runtime/llm.py (same notebook).

Shape legend: B batch, T tokens, V vocab.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from minillm.model.devices import peak_memory_mib, reset_peak_memory, synchronized_time
from minillm.cache.dense import make_cache
from minillm.model.decoder import CausalLM
from minillm.runtime.sampling import SamplingParams, make_generator, sample, validate_logit_bias
from minillm.text.tokenizer import StreamDecoder, Tokenizer
from minillm.utils.validate import is_int, is_positive_int


class StopStrings:
    """Holds back text that might be the start of a stop string; finds the first complete one."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """The text and the finish rule of one request, shared by `stream` and the engine (notebook 17).

    push(token) takes each sampled token and returns (the text it completes, the finish reason or
    None): "stop" for an end-of-turn token (not itself text) or a stop string (cut before it),
    "length" at max_new_tokens or when the context is full."""

    def __init__(self, tokenizer: Tokenizer, prompt_len: int, max_new_tokens: int, context: int,
                 eos_token_ids: Iterable[int], stop: Sequence[str] = ()):
        self.decoder, self.stops = StreamDecoder(tokenizer, skip_special_tokens=True), StopStrings(stop)
        self.eos = frozenset(eos_token_ids)
        self.tokens, self.prompt_len, self.max_new_tokens, self.context = 0, prompt_len, max_new_tokens, context

    def push(self, token: int) -> tuple[str, str | None]:
        self.tokens += 1  # generated so far, this one included
        if token in self.eos:
            return self.drain(), "stop"
        text, hit = self.stops.push(self.decoder.push(token))
        if hit:
            return text, "stop"
        if self.tokens == self.max_new_tokens or self.prompt_len + self.tokens == self.context:
            return text + self.drain(), "length"
        return text, None

    def drain(self) -> str:
        """At the end: whatever the decoder and the stop-string holder still hold."""
        text, hit = self.stops.push(self.decoder.flush())
        return text if hit else text + self.stops.flush()


@dataclass
class Metrics:
    """What one generation cost. Times in milliseconds; memory in MiB (process peak RSS on CPU,
    torch.cuda.max_memory_allocated on CUDA)."""

    prompt_tokens: int
    generated_tokens: int
    prefill_ms: float
    time_to_first_token_ms: float
    decode_ms_per_token: float
    tokens_per_s: float
    peak_memory_mib: float
    device: str

    def __str__(self) -> str:
        return (f"prompt {self.prompt_tokens} tokens, generated {self.generated_tokens}; "
                f"prefill {self.prefill_ms:.0f} ms ({self.prompt_tokens / max(self.prefill_ms, 1e-9) * 1e3:.0f} tok/s), "
                f"first token {self.time_to_first_token_ms:.0f} ms, decode {self.decode_ms_per_token:.1f} ms/token "
                f"({self.tokens_per_s:.1f} tok/s), peak memory {self.peak_memory_mib:.0f} MiB on {self.device}")


def generation_metrics(prompt_tokens: int, generated: int, start: float, prefill_done: float, first_token_at: float,
             end: float, device: torch.device) -> Metrics:
    """Metrics from the loop's four clock readings (seconds): the first token's time is in the
    time to first token, so decoding is the generated - 1 tokens after it."""
    decode_s = end - first_token_at
    return Metrics(
        prompt_tokens=prompt_tokens,
        generated_tokens=generated,
        prefill_ms=(prefill_done - start) * 1e3,
        time_to_first_token_ms=(first_token_at - start) * 1e3,
        decode_ms_per_token=decode_s * 1e3 / max(generated - 1, 1),
        tokens_per_s=(generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
        peak_memory_mib=peak_memory_mib(device),
        device=device.type,
    )


def validate_prompt(prompt_ids: Sequence[int], max_new_tokens: int, context: int, vocab_size: int,
                    params: SamplingParams | None = None) -> list[int]:
    """The one check of a request's prompt, length and logit_bias ids, for `stream`, `generate_batch` and
    the engine: the ids as a list of ints, or ValueError naming what is wrong and the numbers involved."""
    validate_logit_bias(params, vocab_size)  # notebook 09: SamplingParams checked the rest of logit_bias
    if not is_positive_int(max_new_tokens):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    ids = [operator.index(i) for i in prompt_ids]  # TypeError for floats and strings
    if not ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:  # checked here, in Python: the model reads ids on a GPU without checking them
        raise ValueError(f"token id {bad} is out of range: the model's vocabulary has {vocab_size} ids")
    if len(ids) >= context:
        raise ValueError(f"the prompt has {len(ids)} tokens but the context holds {context}; "
                         "shorten the prompt (at least one token must be left to generate)")
    return ids


@dataclass
class Step:
    """One step of the loop: the text it completed ('' while a character or a possible stop
    string is pending), the token chosen and its logprob; the last step has finish_reason and metrics."""

    text: str
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    metrics: Metrics | None = None


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: Metrics
    logprobs: list[float] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)  # notebook 24's LLM.chat(tools=...), parsed as in 14
    reasoning: str | None = None  # LLM.chat with a template that thinks: the reasoning, apart from text


def apply_constraints(logits: torch.Tensor, constraints: Sequence) -> torch.Tensor:
    """(B, V) logits with -inf wherever row b's constraint (None: no constraint) forbids the token."""
    if all(c is None for c in constraints):
        return logits
    allowed = torch.stack([torch.ones(logits.shape[-1], dtype=torch.bool) if c is None else c.mask()
                           for c in constraints]).to(logits.device)  # (B, V)
    return logits.masked_fill(~allowed, float("-inf"))


@torch.no_grad()
def stream(model: CausalLM, tokenizer: Tokenizer, prompt_ids: Sequence[int],
           params: SamplingParams = SamplingParams(temperature=0), max_new_tokens: int = 256,
           stop: Sequence[str] = (), eos_token_ids: Sequence[int] | None = None, constraint=None,
           cache_factory=make_cache) -> Iterator[Step]:
    """Generate after prompt_ids, yielding a Step per token; the last Step has finish_reason and metrics
    (`generation_metrics` of `synchronized_time` at the start, the prefill, the first token and the end).
    `cache_factory` makes the cache (a hybrid model's: notebook 22); `constraint`: notebook 14's hook."""
    device = next(model.parameters()).device
    context = model.config.max_position_embeddings
    prompt_ids = validate_prompt(prompt_ids, max_new_tokens, context, model.config.vocab_size, params)
    eos = tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids
    text_stream = TextStream(tokenizer, len(prompt_ids), max_new_tokens, context, eos, stop)
    total = min(len(prompt_ids) + max_new_tokens, context)  # the cache never needs more
    cache = cache_factory(model.config, 1, total, dtype=next(model.parameters()).dtype, device=device)
    generator = make_generator(params.seed, device)
    reset_peak_memory(device)

    start = synchronized_time(device)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    logits = model(ids, cache=cache, start_pos=0, logits_to_keep=1)[:, -1]  # prefill: (1, V), the last position only
    prefill_done = synchronized_time(device)
    seen, finish, first_token_at = list(prompt_ids), None, None
    while finish is None:
        logits = apply_constraints(logits, [constraint])  # structured outputs (notebook 14); None: unchanged
        pick = sample(logits, params, generator, token_ids=[seen], prompt_lengths=[len(prompt_ids)])
        token = int(pick.tokens[0])  # the one read-back a step needs: the host decides what comes next
        first_token_at = first_token_at or synchronized_time(device)
        seen.append(token)
        if constraint is not None:
            constraint.advance(token)
        text, finish = text_stream.push(token)
        step = Step(text, token, float(pick.logprobs[0]), pick.top_logprobs[0] if pick.top_logprobs else None, finish)
        if finish is None:
            logits = model(pick.tokens.view(1, 1), cache=cache, start_pos=len(seen) - 1)[:, -1]  # decode: (1, V)
            yield step
    end = synchronized_time(device)
    step.metrics = generation_metrics(len(prompt_ids), len(seen) - len(prompt_ids), start, prefill_done, first_token_at, end, device)
    yield step


def collect(steps: Iterable[Step]) -> Completion:
    """Steps collected: the whole text, the generated ids, the finish reason and the metrics."""
    texts, ids, logprobs = [], [], []
    for step in steps:
        texts.append(step.text)
        ids.append(step.token_id)
        logprobs.append(step.logprob)
    return Completion("".join(texts), ids, step.finish_reason, step.metrics, logprobs)


def generate(model: CausalLM, tokenizer: Tokenizer, prompt_ids: Sequence[int], **kwargs) -> Completion:
    """stream(...) collected into a Completion."""
    return collect(stream(model, tokenizer, prompt_ids, **kwargs))


@torch.no_grad()
def generate_batch(model: CausalLM, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                   params: SamplingParams = SamplingParams(temperature=0), max_new_tokens: int = 256,
                   eos_token_ids: Sequence[int] | None = None, constraints: Sequence | None = None,
                   cache_factory=make_cache) -> list[list[int]]:
    """Generated ids for each prompt, as one left-padded batch; constraints and cache_factory as stream's."""
    device = next(model.parameters()).device
    prompts = [validate_prompt(p, max_new_tokens, model.config.max_position_embeddings, model.config.vocab_size, params)
               for p in prompts]
    B, T = len(prompts), max(len(p) for p in prompts)
    eos = set(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
    total = min(T + max_new_tokens, model.config.max_position_embeddings)
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    mask = torch.zeros(B, total, dtype=torch.long, device=device)  # 1 = real token, over the whole cache
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p, device=device)  # left padding
        mask[b, T - len(p):] = 1
    cache = cache_factory(model.config, B, total, dtype=next(model.parameters()).dtype, device=device)
    generator = make_generator(params.seed, device)
    logits = model(ids, attention_mask=mask[:, :T], cache=cache)[:, -1]  # (B, V)
    seen, out, done = [list(p) for p in prompts], [[] for _ in prompts], [False] * B
    for pos in range(T, total):
        logits = apply_constraints(logits, constraints or [None] * B)  # (B, V): -inf where a row's constraint forbids
        tokens = sample(logits, params, generator, token_ids=seen, prompt_lengths=[len(p) for p in prompts]).tokens
        for b, t in enumerate(tokens.tolist()):
            if not done[b]:
                out[b].append(t)
                seen[b].append(t)
                if constraints and constraints[b] is not None:
                    constraints[b].advance(t)
                done[b] = t in eos or len(out[b]) == max_new_tokens
        if all(done) or pos + 1 == total:
            break
        logits = model(tokens[:, None], attention_mask=mask[:, : pos + 1], cache=cache, start_pos=pos)[:, -1]
    return out


@dataclass
class PromptLogprobs:
    """logprobs[i]: log P(token_ids[i] | token_ids[:i]), None for the first (nothing predicts it);
    top_logprobs[i]: the n most likely [(id, logprob)] there, when asked (None for the first)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


def score_tokens(logits: torch.Tensor, targets: Sequence[int], top: int | None = None) -> list[tuple]:
    """(logprob of targets[t] under row t of (T, V) logits, its top-n [(id, logprob)] or None) per row."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (T, V)
    chosen = logp.gather(-1, torch.tensor(list(targets), device=logp.device)[:, None])[:, 0].tolist()  # (T,)
    if top is None:
        return [(c, None) for c in chosen]
    values, indices = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)  # (T, n)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, indices.tolist(), values.tolist())]


def as_prompt_logprobs(token_ids: list[int], scores: list[tuple], top: int | None) -> PromptLogprobs:
    """score_tokens' pairs for tokens 1.. as a PromptLogprobs of the whole prompt (the first: None)."""
    return PromptLogprobs(token_ids, [None] + [lp for lp, _ in scores],
                          None if top is None else [None] + [alternatives for _, alternatives in scores])


@torch.no_grad()
def prompt_logprobs(model: CausalLM, prompt_ids: Sequence[int], top_logprobs: int | None = None) -> PromptLogprobs:
    """Each prompt token's logprob given the tokens before it, from one prefill keeping every position."""
    if top_logprobs is not None and not (is_int(top_logprobs) and top_logprobs >= 0):
        raise ValueError(f"top_logprobs must be an int >= 0 or None, got {top_logprobs!r}")
    context = model.config.max_position_embeddings  # scoring generates nothing: the whole context may be prompt
    ids = validate_prompt(prompt_ids, 1, context + 1, model.config.vocab_size)
    logits = model(torch.tensor([ids], device=next(model.parameters()).device))[0]  # (T, V): every position
    return as_prompt_logprobs(ids, score_tokens(logits[:-1], ids[1:], top_logprobs), top_logprobs)
