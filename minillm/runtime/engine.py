# Generated from notebooks/17_engine.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Continuous batching: admit, make_room -> Scheduler -> EngineCore.step -> Engine.

Built in notebooks/17_engine.ipynb on the block manager (notebook 15) and paged attention (16). Each
step admits waiting sequences while KV blocks allow (out of blocks: the newest is preempted and
recomputed later) and computes in one packed forward (minillm/cache/packed.py) every prompt chunk,
within a per-step budget, and one token per running sequence, each sampled with its own parameters.
n choices share one prefill's blocks (copy-on-write). In the manner of nano-vllm.

Shape legend: B batch (running sequences), T new tokens, V vocab.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from minillm.runtime.generate import apply_constraints
from minillm.text.constrained import Constraints
from minillm.runtime.sequence import adapter_index
from minillm.model.decoder import CausalLM
from minillm.speed.fast import reads_block_tables
from minillm.cache.packed import kv_pool_blocks, packed_layout, packed_views
from minillm.cache.paged_attention import (PAGED_MIN_TOKENS, BlockTableView, validate_attention, decode_layout,
                                           use_paged_attention)
from minillm.cache.paged import BlockManager, PagedView, batch_layout, cache_computed, make_paged_cache
from minillm.runtime.sampling import SamplingParams, make_generator, sample
from minillm.runtime.sequence import (FINISHED, PREFILLING, RUNNING, WAITING, Output, Sequence, validate_chunk,
                                      validate_request, never_fits, prompt_columns, record_prompt_logprobs,
                                      take_prompt_logprobs, validate_prompt_logprobs)
from minillm.text.tokenizer import Tokenizer
from minillm.utils.validate import is_positive_int


def admit(manager: BlockManager, waiting: deque[Sequence], running: list[Sequence], max_num_seqs: int,
          max_model_len: int) -> tuple[list[Sequence], list[Sequence]]:
    """Move waiting sequences to running, oldest first, while blocks and max_num_seqs allow.

    Returns (admitted: to prefill this step, rejected: can never fit)."""
    admitted, rejected = [], []
    fresh: set[int] = set()  # blocks newly given out in this call: their keys exist only after this step's prefill
    while waiting and len(running) < max_num_seqs:
        seq = waiting[0]
        ids, salt = seq.token_ids, seq.cache_salt  # an adapter's own keys (nb 20); a scored prompt shares none
        if manager.blocks_needed(len(ids) + 1) > manager.num_blocks or len(ids) >= max_model_len:
            waiting.popleft()
            rejected.append(seq)
            continue
        if not manager.can_allocate(ids, salt):
            break  # oldest first: wait for blocks
        if fresh.intersection(manager.prefix_hits(ids, salt)):
            break  # its prefix is being computed now (prefill batches may run in any order): next step
        waiting.popleft()
        seq.num_cached = manager.allocate(seq.id, ids, salt)
        fresh.update(manager.block_table(seq.id)[seq.num_cached // manager.block_size:])  # reused ones are computed
        seq.status = RUNNING
        running.append(seq)
        admitted.append(seq)
    return admitted, rejected


def preempt_seq(manager: BlockManager, running: list[Sequence], waiting: deque[Sequence], seq: Sequence) -> None:
    """Free all of seq's blocks and requeue it first; its pending token becomes output to recompute."""
    manager.free(seq.id)
    running.remove(seq)
    if seq.pending is not None:  # sampled and streamed already: keep it, its KV is recomputed
        seq.output_ids.append(seq.pending)
    seq.status, seq.pending = WAITING, None
    waiting.appendleft(seq)


def make_room(manager: BlockManager, running: list[Sequence], waiting: deque[Sequence]) -> tuple[list[Sequence], int]:
    """Reserve a slot for each running sequence's pending token, oldest first, preempting the newest
    while blocks are short. Returns (the sequences that decode this step, how many were preempted)."""
    decoding, preempted = [], 0
    for seq in list(running):  # oldest first
        if seq.status != RUNNING:
            continue  # preempted while making room for an older one
        while not manager.can_append(seq.id):
            victim = running[-1]
            preempt_seq(manager, running, waiting, victim)
            preempted += 1
            if victim is seq:
                break
        if seq.status == RUNNING:
            manager.append(seq.id, seq.pending)
            decoding.append(seq)
    return decoding, preempted


def start_prefill(manager: BlockManager, admitted: list[Sequence]) -> None:
    """Admitted sequences prefill from their cached prefix; their blocks past it are not findable yet."""
    for seq in admitted:
        seq.status, seq.num_computed = PREFILLING, seq.num_cached
        cache_computed(manager, seq.id, seq.num_computed)


def prefill_chunks(prefilling: list[Sequence], budget: float) -> list[tuple[Sequence, int]]:
    """(sequence, prompt tokens to compute this step), oldest first, within `budget` tokens in all."""
    chunks = []
    for seq in prefilling:
        n = min(len(seq.token_ids) - seq.num_computed, budget)
        if n == 0:
            break
        chunks.append((seq, n))
        budget -= n
    return chunks


def advance_prefill(manager: BlockManager, seq: Sequence, n: int) -> bool:
    """A forward computed n more prompt tokens of seq. True when that was the last: it runs now."""
    seq.num_computed += n
    cache_computed(manager, seq.id, seq.num_computed)  # the blocks it filled become findable
    if seq.num_computed == len(seq.token_ids):
        seq.status = RUNNING
    return seq.status == RUNNING


class Scheduler:
    """Who runs this step: admits waiting sequences while blocks allow; preempts the newest on shortage;
    gives each prefilling sequence its chunk of prompt, oldest first, within `prefill_chunk` tokens a step."""

    def __init__(self, manager: BlockManager, max_num_seqs: int, max_model_len: int, prefill_chunk: int | None = None):
        self.manager, self.max_num_seqs, self.max_model_len = manager, max_num_seqs, max_model_len
        self.prefill_chunk = prefill_chunk  # prompt tokens computed per step, all prompts together; None: no limit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.status in (PREFILLING, RUNNING):
            self.manager.free(seq.id)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason, seq.error = FINISHED, reason, error
        for fork in seq.forks:  # it ended before its prefill: the other choices are queued on their own
            if fork.status == WAITING:
                self.add(fork)
        seq.forks = []

    def preempt(self, seq: Sequence) -> None:
        """Free all of seq's blocks and requeue it first; its pending token becomes output to recompute."""
        preempt_seq(self.manager, self.running, self.waiting, seq)
        self.num_preemptions += 1

    def schedule(self) -> tuple[list[tuple[Sequence, int]], list[Sequence], list[Sequence]]:
        """Returns (prefills: (sequence, prompt tokens to compute now), decoding: to run one decode step,
        rejected: can never fit)."""
        decoding, preempted = make_room(self.manager, self.running, self.waiting)  # the running first
        self.num_preemptions += preempted
        budget = self.prefill_chunk or math.inf
        prefilling = [seq for seq in self.running if seq.status == PREFILLING]  # admitted in an earlier step
        admitted, rejected = [], []
        if sum(len(seq.token_ids) - seq.num_computed for seq in prefilling) < budget:  # room for more prompts
            admitted, rejected = admit(self.manager, self.waiting, self.running, self.max_num_seqs, self.max_model_len)
        start_prefill(self.manager, admitted)
        return prefill_chunks(prefilling + admitted, budget), decoding, rejected


def paged_step(attention: str, model: CausalLM, manager: BlockManager, seq_ids: list, T: int) -> bool:
    """Does this step read the blocks in place (notebook 16)? Only a decode step (T = 1): always with
    "paged"; with "auto", from PAGED_MIN_TOKENS tokens held, where the kernel runs (probed once)."""
    if T != 1 or attention == "gather":
        return False
    if attention == "auto" and sum(map(manager.num_tokens, seq_ids)) < PAGED_MIN_TOKENS:
        return False
    param = next(model.parameters())
    return use_paged_attention(attention, model.config, param.dtype, param.device)


def forward_batch(model: CausalLM, cache: list, manager: BlockManager, seqs: list[Sequence], new_ids: list[list[int]],
                  sink_slot: int, attention: str = "gather", lengths: list[int] | None = None) -> torch.Tensor:
    """Next-token logits (B, V): one forward computing each sequence's new tokens (left-padded to T).

    attention: how a decode step reads the cache ("auto", "paged" or "gather": `paged_step`).
    lengths: where each row's new tokens end, for a prefill (a chunk may end inside the prompt);
    None: at each sequence's last token, a decode step, which may read the blocks in place."""
    device, seq_ids, T = next(model.parameters()).device, [s.id for s in seqs], max(map(len, new_ids))
    ids = torch.tensor([[0] * (T - len(n)) + n for n in new_ids], device=device)  # (B, T)
    if lengths is None and paged_step(attention, model, manager, seq_ids, T):
        layout, mask = decode_layout(manager, seq_ids, kv_pool_blocks(cache), device), None
        views = [BlockTableView(c, layout) for c in cache]
    else:
        lengths = lengths or [manager.num_tokens(i) for i in seq_ids]
        layout = batch_layout(manager, seq_ids, [len(n) for n in new_ids], sink_slot, device, lengths)
        alike = len({(L, len(n)) for L, n in zip(lengths, new_ids)}) == 1  # no row padded
        views, mask = [PagedView(c, layout) for c in cache], None if alike else layout.attention_mask
    loras = {"adapter_ids": torch.tensor([s.lora for s in seqs], device=device)} if any(s.lora for s in seqs) else {}
    logits = model(ids, positions=layout.positions, attention_mask=mask, cache=views, start_pos=layout.start_pos,
                   logits_to_keep=1, **loras)  # (B, 1, V); LoRA: nb 20
    return logits[:, -1]  # every row's last new token sits in the last column


def copy_blocks(cache: list, manager: BlockManager) -> None:
    """Apply the block manager's pending copy-on-write copies to every layer, before the next forward."""
    pairs = manager.take_copies()
    if pairs:
        for layer in cache:
            layer.copy_blocks(pairs)


def packed_batches(prefills: list[tuple[Sequence, int]], decoding: list[Sequence], max_tokens: int,
                   max_model_len: int) -> list[list[tuple[Sequence, int]]]:
    """A step's forwards, each [(sequence, prompt tokens to compute, or 0: its pending token)]: the prompt
    chunks, then the decode tokens, in order; a new forward where max_tokens (or the context) would pass."""
    cap, batches, used = min(max_tokens, max_model_len), [[]], 0
    for seq, n in [*prefills, *((seq, 0) for seq in decoding)]:
        if batches[-1] and used + max(n, 1) > cap:
            batches.append([])
            used = 0
        batches[-1].append((seq, n))
        used += max(n, 1)
    return [batch for batch in batches if batch]


def forward_packed(model: CausalLM, cache: list, manager: BlockManager, batch: list[tuple[Sequence, int]],
                   attention: str = "gather") -> torch.Tensor:
    """Next-token logits (rows, V) of a packed batch: one forward over its new tokens side by side, no padding."""
    device = next(model.parameters()).device
    chunks, decoding = [(s, n) for s, n in batch if n], [s for s, n in batch if not n]
    ids = [t for s, n in chunks for t in s.token_ids[s.num_computed : s.num_computed + n]] + [s.pending for s in decoding]
    tables_only = not chunks and reads_block_tables(model)  # appendix A4's one call per layer
    paged = bool(decoding) and not tables_only and paged_step(attention, model, manager, [s.id for s in decoding], 1)
    layout = packed_layout(manager, [(s.id, s.num_computed, n) for s, n in chunks], [s.id for s in decoding],
                           kv_pool_blocks(cache), device, paged, tables_only)
    keep, rows = prompt_columns(chunks, layout.ends)  # a scored prompt's chunk keeps every column (nb 10)
    logits = model(torch.tensor([ids], device=device), positions=layout.positions,
                   cache=packed_views(cache, layout), logits_to_keep=keep)  # (1, kept, V)
    return record_prompt_logprobs(chunks, logits[0], rows)  # (rows, V)


def forward_step(model: CausalLM, cache: list, manager: BlockManager, batch: list[tuple[Sequence, int]],
                 sink_slot: int, attention: str = "gather") -> torch.Tensor:
    """Logits (rows, V) of one of a step's batches: packed, but where a row has a LoRA adapter (notebook
    20), whose weights are chosen per row: then a padded forward for the chunks and one for the decode."""
    if not any(s.lora for s, _ in batch):
        return forward_packed(model, cache, manager, batch, attention)
    chunks, decoding = [(s, n) for s, n in batch if n], [s for s, n in batch if not n]
    parts = [forward_batch(model, cache, manager, [s for s, _ in chunks],
                           [s.token_ids[s.num_computed : s.num_computed + n] for s, n in chunks], sink_slot,
                           attention, [s.num_computed + n for s, n in chunks])] if chunks else []
    if decoding:
        parts.append(forward_batch(model, cache, manager, decoding, [[s.pending] for s in decoding], sink_slot, attention))
    return torch.cat(parts)


def advance(seq: Sequence, token: int) -> Output:
    """Record a sampled token: stream its text; it becomes pending, or ends the sequence (Output.finished)."""
    if seq.constraint is not None:
        seq.constraint.advance(token)
    text, finish = seq.text.push(token)
    if finish is not None:
        seq.output_ids.append(token)
        return Output(seq.id, token, text, True, finish)
    seq.pending = token  # computed by the next decode step
    return Output(seq.id, token, text)


def sample_rows(seqs: list[Sequence], logits: torch.Tensor) -> list[Output]:
    """Sample rows that share parameters; on an error retry them one by one, so it fails only its own request."""
    first = seqs[0]
    try:
        pick = sample(logits, first.params, first.generator, token_ids=[s.token_ids for s in seqs],
                      prompt_lengths=[len(s.prompt_ids) for s in seqs])
    except (ValueError, RuntimeError) as exc:  # NaN logits, multinomial on NaN...: this one fails, not the others
        if len(seqs) > 1:
            return [out for b, seq in enumerate(seqs) for out in sample_rows([seq], logits[b : b + 1])]
        return [Output(first.id, None, "", True, "error", str(exc))]
    outputs = []
    for b, (seq, token) in enumerate(zip(seqs, pick.tokens.tolist())):
        out = advance(seq, token)
        out.logprob = float(pick.logprobs[b])
        out.top_logprobs = pick.top_logprobs[b] if pick.top_logprobs else None
        out.prompt_logprobs = take_prompt_logprobs(seq)  # the first token brings the prompt's scores, if asked
        outputs.append(out)
    return outputs


def sample_batch(seqs: list[Sequence], logits: torch.Tensor) -> list[Output]:
    """Each sequence's next token. Greedy ones with equal parameters share one call: no generator needed."""
    for seq in seqs:
        if seq.pending is not None:  # its KV was just computed: it is now part of the output
            seq.output_ids.append(seq.pending)
            seq.pending = None
    logits = apply_constraints(logits, [seq.constraint for seq in seqs])  # -inf where a row's constraint forbids
    groups = {}
    for b, seq in enumerate(seqs):
        groups.setdefault(seq.params if seq.params.greedy else b, []).append(b)
    outputs = []
    for rows in groups.values():
        outputs += sample_rows([seqs[b] for b in rows], logits[rows])
    return outputs


def choice_params(params: SamplingParams | None, n: int) -> list[SamplingParams | None]:
    """The parameters of n choices of one prompt: choice i samples with seed + i (no seed: every
    choice uses torch's global generator), so choice i equals a request of its own with that seed."""
    if not is_positive_int(n):
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if params is None or params.seed is None:
        return [params] * n
    return [replace(params, seed=params.seed + i) for i in range(n)]


def with_forks(choices: list[Sequence], prompt_logprobs: int | None = None) -> Sequence:
    """A request of n choices: the first, with the other n - 1 waiting in its `forks` for its prefill;
    the first alone scores the prompt when prompt_logprobs asks (the others share its prefill)."""
    choices[0].forks, choices[0].prompt_logprobs = choices[1:], validate_prompt_logprobs(prompt_logprobs, choices[0].lora)
    return choices[0]


def fork_choices(manager: BlockManager, running: list[Sequence], seqs: list[Sequence],
                 logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
    """After a prefill forward: each waiting fork of a prefilled sequence shares its blocks and its
    logits row, and runs. Returns the batch to sample: seqs then the forks, logits (B + forks, V)."""
    forks, rows = [], []
    for b, seq in enumerate(seqs):
        for fork in seq.forks:
            if fork.status == WAITING:  # an aborted choice is FINISHED already
                manager.fork(seq.id, fork.id)  # the same blocks, each one's reference count + 1
                fork.status = RUNNING
                running.append(fork)
                forks.append(fork)
                rows.append(b)
        seq.forks = []
    if not forks:
        return seqs, logits
    return seqs + forks, torch.cat([logits, logits[rows]])  # (B, V) -> (B + forks, V)


def run_batches(model: CausalLM, cache: list, manager: BlockManager, running: list[Sequence],
                batches: list[list[tuple[Sequence, int]]], sink_slot: int, attention: str = "gather") -> list[Output]:
    """A step's packed forwards once scheduled: the block copies applied, then each forward's rows sample
    (the decode rows, and the prefill rows whose prompt is now complete; n > 1: the other choices join)."""
    copy_blocks(cache, manager)
    outputs = []
    for batch in batches:
        logits = forward_step(model, cache, manager, batch, sink_slot, attention)
        done = [b for b, (s, n) in enumerate(batch) if n == 0 or advance_prefill(manager, s, n)]
        seqs, logits = fork_choices(manager, running, [batch[b][0] for b in done], logits[done])
        outputs += sample_batch(seqs, logits)
    return outputs


class EngineCore:
    """The stepping half of the engine: a model, a paged KV cache, a scheduler and `step`."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, num_blocks: int = 512, block_size: int = 16,
                 max_num_seqs: int = 64, enable_prefix_caching: bool = True, max_prefill_tokens: int = 4096,
                 attention: str = "auto", prefill_chunk: int | None = None):
        self.model, self.tokenizer, self.device = model, tokenizer, (param := next(model.parameters())).device
        self.manager, self.cache = self.make_pools(num_blocks, block_size, enable_prefix_caching, param.dtype)
        self.sink_slot = num_blocks * block_size  # the extra block: where padding tokens' keys are written
        self.attention = validate_attention(attention, model.config, param.dtype, self.device)  # decode reads: nb 16
        self.max_prefill_tokens = max_prefill_tokens  # new tokens per packed forward
        self.scheduler = Scheduler(self.manager, max_num_seqs, model.config.max_position_embeddings, validate_chunk(prefill_chunk))
        self.sequences: dict[int, Sequence] = {}  # unfinished requests only: a finished one is forgotten
        self.finish_reasons: Counter[str] = Counter()  # how requests ended: stop, length, abort, error
        self._ids, self.constraints = itertools.count(), Constraints(tokenizer, model.config.vocab_size)  # nb 14

    def make_pools(self, num_blocks: int, block_size: int, prefix_caching: bool, dtype) -> tuple[BlockManager, list]:
        """The block manager, and a KV pool per layer with one block more: the sink (below)."""
        manager = BlockManager(num_blocks, block_size, prefix_caching)
        return manager, make_paged_cache(self.model.config, num_blocks + 1, block_size, dtype=dtype, device=self.device)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(seq, reason, error)  # frees its blocks; its last Output says what a caller needs
        del self.sequences[seq.id]
        self.finish_reasons[reason] += 1

    @torch.no_grad()
    def step(self) -> list[Output]:
        """One round: schedule, prefill the admitted, one decode forward for the running, sample, finish."""
        return self.run(*self.scheduler.schedule())

    def run(self, prefills: list[tuple[Sequence, int]], decoding: list[Sequence], rejected: list[Sequence]) -> list[Output]:
        """What was scheduled: the never-fitting fail, the packed forwards run and sample, the finished end."""
        for seq in rejected:
            self._finish(seq, "error", never_fits(self.manager, seq, self.scheduler.max_model_len))
        batches = packed_batches(prefills, decoding, self.max_prefill_tokens, self.scheduler.max_model_len)
        outputs = run_batches(self.model, self.cache, self.manager, self.scheduler.running, batches, self.sink_slot,
                              self.attention)
        for out in outputs:
            if out.finished:
                self._finish(self.sequences[out.request_id], out.finish_reason, out.error)
        return [Output(seq.id, None, "", True, "error", seq.error) for seq in rejected] + outputs


class Engine(EngineCore):
    """A model, a paged KV cache and a scheduler: add_request, step, abort, generate."""

    def add_request(self, prompt_ids: Seq[int], *args, **kwargs) -> int:  # make_request's arguments
        return self.submit(self.make_request(prompt_ids, *args, **kwargs))  # its id; bad arguments: ValueError here

    def make_request(self, prompt_ids: Seq[int], params: SamplingParams | None = None, max_new_tokens: int = 256,
                     stop: Seq[str] = (), eos_token_ids: Seq[int] | None = None, n: int = 1,
                     response_format=None, adapter: str | None = None, prompt_logprobs: int | None = None,
                     thinking: bool | None = None, reasoning_budget: int | None = None) -> Sequence:  # nb 14's gate
        """A checked request of n choices, not yet queued (no engine state touched: any thread may call it)."""
        def choice(params: SamplingParams | None) -> Sequence:
            ids, params, text = validate_request(self.tokenizer, self.scheduler.max_model_len, self.model.config.vocab_size,
                                              prompt_ids, params, max_new_tokens, stop, eos_token_ids)
            return Sequence(next(self._ids), ids, params, text, make_generator(params.seed, self.device),
                            constraint=self.constraints.for_format(response_format, thinking, reasoning_budget, ids),
                            lora=adapter_index(self.model, adapter))  # nb 20: 0, or its adapter's index
        return with_forks([choice(p) for p in choice_params(params, n)], prompt_logprobs)

    def submit(self, seq: Sequence) -> int:
        """Queue a request made by make_request (its forks join after its prefill); returns its id."""
        self.sequences.update((s.id, s) for s in (seq, *seq.forks))
        self.scheduler.add(seq)
        return seq.id

    def abort(self, request_id: int) -> None:
        """Stop a request now (a client hung up) and free everything it held."""
        if (seq := self.sequences.get(request_id)) is not None:  # None once finished: nothing left to free
            self._finish(seq, "abort")

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 max_new_tokens: int | Seq[int] = 256, **kwargs) -> list[dict]:
        """Run many requests to the end; per request: token_ids, text, finish_reason (and error)."""
        params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        limits = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
        ids = [self.add_request(p, q, m, **kwargs) for p, q, m in zip(prompts, params, limits)]
        results = {i: {"token_ids": [], "text": "", "finish_reason": None, "error": None} for i in ids}
        while self.has_unfinished():
            for out in self.step():  # the outputs say everything: finished requests are forgotten
                r = results[out.request_id]
                r["token_ids"] += [] if out.token_id is None else [out.token_id]
                r["text"] += out.text
                if out.finished:
                    r["finish_reason"], r["error"] = out.finish_reason, out.error
        return [results[i] for i in ids]
