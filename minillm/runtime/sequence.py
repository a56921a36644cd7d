# Generated from notebooks/12_engine.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""One request's state in the engine (notebook 12): `Sequence`, the `Output` of a step, and the
checks of a request.

A sequence is waiting, prefilling (admitted, its prompt computed a chunk per step), running
(decoding one token per step) or finished; `minillm.runtime.engine` moves it between them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from minillm.runtime.generate import TextStream, validate_prompt
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
    constraint: object | None = None  # structured outputs (notebook 18): masks its logits, reads its tokens
    lora: int = 0  # its LoRA adapter's index in the model (notebook 19), 0: none

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


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
