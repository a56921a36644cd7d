# Generated from notebooks/17_engine.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""One request's state in the engine (notebook 17): `Sequence`, a step's `Output`, the request checks."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from minillm.runtime.generate import PromptLogprobs, TextStream, as_prompt_logprobs, score_tokens, validate_prompt
from minillm.cache.paged import BlockManager
from minillm.runtime.sampling import SamplingParams
from minillm.text.tokenizer import Tokenizer
from minillm.utils.validate import is_int

WAITING, PREFILLING, RUNNING, FINISHED = "waiting", "prefilling", "running", "finished"


@dataclass
class Sequence:
    """One request: prompt and output ids, sampling parameters, stop rules and streaming state."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    text: TextStream  # the text and finish rule, shared with generate.stream
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    pending: int | None = None  # sampled, KV not yet computed
    finish_reason: str | None = None
    error: str | None = None
    num_cached: int = 0  # leading tokens whose KV the prefix cache already held at admission
    num_computed: int = 0  # leading tokens whose KV is computed, while PREFILLING (a chunk a step)
    forks: list[Sequence] = field(default_factory=list)  # choices 1..n-1, waiting for this one's prefill
    constraint: object | None = None  # structured outputs (notebook 14): masks its logits, reads its tokens
    lora: int = 0  # its LoRA adapter's index in the model (notebook 20), 0: none
    prompt_logprobs: int | None = None  # score the prompt (nb 10), with this many alternatives; None: no
    prompt_scores: dict[int, tuple] = field(default_factory=dict)  # position -> (logprob, top), as computed

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_salt(self):
        """Heads its prefix-cache keys: an adapter's keys and values are its own (nb 20); a prompt being
        scored shares no prefix, since every position's logits must be computed."""
        return ("scored", self.id) if self.prompt_logprobs is not None else self.lora or None


@dataclass
class Output:
    """What one step produced for one request: new text (may be ''), the token, its logprob
    (and the top-n when params.logprobs asks), and the end."""

    request_id: int
    token_id: int | None
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when the request asked (nb 10)


def validate_request(tokenizer: Tokenizer, context: int, vocab_size: int, prompt_ids: Seq[int],
                  params: SamplingParams | None = None, max_new_tokens: int = 256, stop: Seq[str] = (),
                  eos_token_ids: Seq[int] | None = None) -> tuple[list[int], SamplingParams, TextStream]:
    """A request's checked prompt, its parameters (default greedy) and its TextStream; ValueError if bad."""
    prompt_ids = validate_prompt(prompt_ids, max_new_tokens, context, vocab_size, params)
    params = params or SamplingParams(temperature=0)
    eos = tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids
    return prompt_ids, params, TextStream(tokenizer, len(prompt_ids), max_new_tokens, context, eos, stop)


def validate_chunk(prefill_chunk: int | None) -> int | None:
    """The engine's prefill budget: prompt tokens computed per step (an int >= 1), or None for no limit."""
    if prefill_chunk is not None and (not is_int(prefill_chunk)
                                      or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be an int >= 1 (prompt tokens per step) or None, got {prefill_chunk!r}")
    return prefill_chunk


def never_fits(manager: BlockManager, seq: Sequence, max_model_len: int) -> str:
    """Why a request can never run: its tokens need more KV blocks than the whole pool."""
    blocks = manager.blocks_needed(len(seq.token_ids) + 1)
    return (f"request of {len(seq.token_ids)} tokens needs {blocks} KV blocks "
            f"(context {max_model_len}); the pool has {manager.num_blocks}")


def validate_prompt_logprobs(prompt_logprobs: int | None, lora: int) -> int | None:
    """A request's prompt_logprobs: None (off) or the number of alternatives per position, an int >= 0."""
    if prompt_logprobs is not None and not (is_int(prompt_logprobs) and prompt_logprobs >= 0):
        raise ValueError(f"prompt_logprobs must be an int >= 0 or None, got {prompt_logprobs!r}")
    if prompt_logprobs is not None and lora:
        raise ValueError("prompt_logprobs with a LoRA adapter is not supported: its padded forward keeps one position")
    return prompt_logprobs


def prompt_columns(chunks: list[tuple[Sequence, int]], ends: torch.Tensor) -> tuple[torch.Tensor, list[int] | None]:
    """The packed forward's columns to keep: each row's last (ends), and every column of a prompt chunk
    being scored. Returns (columns, where each row's last sits among them), or (ends, None) if none is."""
    if all(s.prompt_logprobs is None for s, _ in chunks):
        return ends, None
    keep, rows, start = [], [], 0  # chunks fill the first columns in order, then one per decode row
    for s, n in chunks:
        keep += range(start, start + n) if s.prompt_logprobs is not None else [start + n - 1]
        rows.append(len(keep) - 1)
        start += n
    decode = range(start, start + len(ends) - len(chunks))
    rows += range(len(keep), len(keep) + len(decode))
    return torch.tensor(keep + list(decode), device=ends.device), rows


def record_prompt_logprobs(chunks: list[tuple[Sequence, int]], logits: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """Score the prompt tokens each scored chunk predicts (column p predicts token p + 1); returns the
    rows' last logits (rows, V), to sample from. Called before advance_prefill: num_computed is the chunk's start."""
    if rows is None:
        return logits
    column = 0
    for s, n in chunks:
        if s.prompt_logprobs is not None:
            targets = s.prompt_ids[s.num_computed + 1 : s.num_computed + n + 1]  # the last chunk predicts one fewer
            scores = score_tokens(logits[column : column + len(targets)], targets, s.prompt_logprobs)
            s.prompt_scores.update(zip(range(s.num_computed + 1, s.num_computed + 1 + len(targets)), scores))
        column += n if s.prompt_logprobs is not None else 1
    return logits[rows]


def take_prompt_logprobs(seq: Sequence) -> PromptLogprobs | None:
    """With a scored request's first token: its PromptLogprobs, once (a recompute after preemption scores nothing)."""
    if seq.prompt_logprobs is None:
        return None
    scores, top, seq.prompt_logprobs = seq.prompt_scores, seq.prompt_logprobs, None
    seq.prompt_scores = {}
    return as_prompt_logprobs(seq.prompt_ids, [scores[p] for p in range(1, len(seq.prompt_ids))], top)


def adapter_names(model: torch.nn.Module) -> list[str]:
    """The LoRA adapters a model serves: its `names` after the base model's "" (notebook 20), else none."""
    return list(getattr(model, "names", [""])[1:])


def adapter_index(model: torch.nn.Module, name: str | None) -> int:
    """The index of adapter `name` in the model's `names`, 0 for None (the base model); ValueError otherwise."""
    if name is None:
        return 0
    if name not in adapter_names(model):
        raise ValueError(f"no LoRA adapter named {name!r}; this model serves {', '.join(adapter_names(model)) or 'none'}")
    return model.names.index(name)
