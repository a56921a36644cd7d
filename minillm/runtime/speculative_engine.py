# Generated from notebooks/19_speculative.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Speculation inside the continuous-batching engine (notebook 17): `SpeculativeEngine`.

Built in notebooks/19_speculative.ipynb. While at most `max_batch` sequences decode, each drafts
up to num_draft tokens with a drafter of its own (a copy of the one given, started per sequence),
and the step verifies them all in one packed forward: every sequence's pending token and drafts
are a segment of the packed row (minillm/cache/packed.py), causal after the keys it has cached, with
logits kept at every position. `judge` (notebook 19's rule) decides per sequence; the blocks the
rejected drafts took are given back (`rollback`). Above max_batch a step runs as notebook 17's:
a batched decode step is no longer memory-bound, so k + 1 positions stop costing about one.

Shape legend: k draft tokens, V vocabulary, N packed tokens.
"""

from __future__ import annotations

import copy

import torch

from minillm.runtime.engine import Engine, advance
from minillm.cache.packed import kv_pool_blocks, packed_layout, packed_views
from minillm.cache.paged import BlockManager
from minillm.runtime.sequence import Output, Sequence
from minillm.runtime.speculative import SpeculationStats, top_logprob_pairs, validate_drafter, judge, next_k
from minillm.utils.validate import is_positive_int


def rollback(manager: BlockManager, seq_id, num_tokens: int) -> None:
    """Forget the sequence's tokens past num_tokens (rejected drafts): the blocks they alone filled go
    back to the free list, and a block left part-full is no longer findable by the prefix cache."""
    table, tokens = manager.tables[seq_id], manager.tokens[seq_id]
    keep = manager.blocks_needed(num_tokens)
    for block in table[keep:]:  # drafted into by this sequence alone, so never shared
        manager._forget(block)
        manager._release(block)
    del table[keep:], tokens[num_tokens:]
    if num_tokens % manager.block_size:
        manager._forget(table[-1])  # registered while a rejected draft filled it


def accept(seq: Sequence, logits: torch.Tensor, draft: list[int], q: torch.Tensor | None) -> tuple[list[Output], int]:
    """logits (k+1, V) at seq's pending token and its k drafts -> (the Outputs of the kept drafts and of
    the model's own token, as decode steps would have produced them, drafts kept); the last is pending."""
    seq.output_ids.append(seq.pending)  # its KV is computed now
    seq.pending = None
    try:
        kept, last, logp = judge(logits, seq.token_ids, draft, q, seq.params, seq.generator, len(seq.prompt_ids))
    except (ValueError, RuntimeError) as exc:  # NaN logits...: this request fails, not the others
        return [Output(seq.id, None, "", True, "error", str(exc))], 0
    outputs = []
    for i, token in enumerate([*draft[:kept], last]):
        if seq.pending is not None:  # a kept draft: its KV was computed in this forward
            seq.output_ids.append(seq.pending)
            seq.pending = None
        out = advance(seq, token)
        out.logprob, out.top_logprobs = float(logp[i, token]), top_logprob_pairs(logp[i], seq.params.logprobs)
        outputs.append(out)
        if out.finished:
            break
    return outputs, kept


def draft_tokens(manager: BlockManager, seq: Sequence, drafter, k: int) -> tuple[list[int], torch.Tensor | None]:
    """Up to k tokens guessed after seq's pending one (fewer near its limits, or with no block free),
    appended to its blocks -> (draft, q: the drafter's probabilities, or None if it chose greedily)."""
    text = seq.text  # text.tokens: generated so far, the pending token included
    k = min(k, text.max_new_tokens - text.tokens - 1, text.context - text.prompt_len - text.tokens - 1)
    seen = [*seq.token_ids, seq.pending]
    draft, q = drafter.propose(seen, k, seq.params, seq.generator, len(seq.prompt_ids)) if k > 0 else ([], None)
    for i, token in enumerate(draft):
        if not manager.can_append(seq.id):  # a guess never preempts a request
            return draft[:i], None if q is None else q[:i]
        manager.append(seq.id, token)
    return draft, q


def forward_verify(model, cache: list, manager: BlockManager, decoding: list[Sequence],
                   drafts: list[list[int]]) -> torch.Tensor:
    """One packed forward over every sequence's pending token and drafts -> logits (sum of 1 + k, V)."""
    device, chunks, ids, keep = next(model.parameters()).device, [], [], []
    for seq, draft in zip(decoding, drafts):
        new = 1 + len(draft)
        chunks.append((seq.id, manager.num_tokens(seq.id) - new, new))  # causal after its cached keys
        keep += range(len(ids), len(ids) + new)  # every column's logits, not only the last
        ids += [seq.pending, *draft]
    layout = packed_layout(manager, chunks, [], kv_pool_blocks(cache), device)
    logits = model(torch.tensor([ids], device=device), positions=layout.positions,
                   cache=packed_views(cache, layout), logits_to_keep=torch.tensor(keep, device=device))
    return logits[0]  # (1, N, V) -> (N, V)


def drafter_of(drafters: dict, prototype, num_draft: int, seq: Sequence) -> list:
    """[seq's own drafter, its k now] from drafters (sequence id -> that pair); at seq's first draft,
    a copy of the prototype, started for it (start() gives the copy a state of its own)."""
    if seq.id not in drafters:
        drafter = copy.copy(prototype)
        drafter.start(min(len(seq.prompt_ids) + seq.text.max_new_tokens, seq.text.context))
        drafters[seq.id] = [drafter, num_draft]
    return drafters[seq.id]


class SpeculativeEngine(Engine):
    """notebook 17's Engine, drafting for each decoding sequence while at most max_batch decode.

    drafter: a drafter (NgramDrafter, ModelDrafter, int4_drafter(model)); each sequence gets a copy,
    started for it. stats: the counts of every speculating step, all sequences together."""

    def __init__(self, model, tokenizer, *args, drafter, num_draft: int = 4, max_batch: int = 2, **kwargs):
        super().__init__(model, tokenizer, *args, **kwargs)
        validate_drafter(model, drafter)
        for name, value in (("num_draft", num_draft), ("max_batch", max_batch)):
            if not is_positive_int(value):
                raise ValueError(f"SpeculativeEngine: {name} must be an int >= 1, got {value!r}")
        self.drafter, self.num_draft, self.max_batch = drafter, num_draft, max_batch
        self.drafters: dict[int, list] = {}  # id -> [its drafter, its k now], for the last step's speculating
        self.stats = SpeculationStats()

    def verify(self, decoding: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:  # Qwen3.5's adds to it: A6
        return forward_verify(self.model, self.cache, self.manager, decoding, drafts)

    def speculates(self, decoding: list[Sequence]) -> bool:
        """Draft this step? While few decode; never for a constrained (nb 14) or LoRA (nb 20) row."""
        return 0 < len(decoding) <= self.max_batch and not any(s.constraint or s.lora for s in decoding)

    @torch.no_grad()
    def step(self) -> list[Output]:
        prefills, decoding, rejected = self.scheduler.schedule()
        if not self.speculates(decoding):
            self.drafters = {}  # a drafter's cache may hold a whole context: only the speculating keep one
            return self.run(prefills, decoding, rejected)  # notebook 17's step
        self.drafters = {seq.id: drafter_of(self.drafters, self.drafter, self.num_draft, seq) for seq in decoding}
        drafts = [draft_tokens(self.manager, seq, *self.drafters[seq.id]) for seq in decoding]
        outputs = self.run(prefills, [], rejected)  # the prompt chunks (and the block copies drafting made)
        logits = self.verify(decoding, [d for d, _ in drafts])
        for seq, (draft, q), rows in zip(decoding, drafts, logits.split([1 + len(d) for d, _ in drafts])):
            outs, kept = accept(seq, rows, draft, q)  # (1 + k, V) rows
            self.stats.add_round(len(draft), kept)
            self.stats.emitted += sum(out.token_id is not None for out in outs)
            state = self.drafters[seq.id]
            state[1] = next_k(state[1], self.num_draft, len(draft), kept)
            if outs[-1].finished:
                self._finish(seq, outs[-1].finish_reason, outs[-1].error)
            else:
                rollback(self.manager, seq.id, len(seq.token_ids))  # the new pending token is not cached yet
            outputs += outs
        return outputs
