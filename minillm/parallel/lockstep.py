# Generated from notebooks/21_tensor_parallel.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Keeping tensor-parallel ranks in step: rank 0 leads, the other ranks follow.

Built in notebooks/21_tensor_parallel.ipynb. Every rank runs the same program (SPMD): the logits
of minillm/parallel/tensor_parallel.py are whole on every rank, so the same inputs give every rank the
same tokens, the same finished sequences and the same schedule. Only rank 0 hears the outside
world (a line typed into the chat, an HTTP request, a client hanging up), so it sends what it
heard to the others before it acts on it, over a gloo group of its own: a CUDA run keeps NCCL
for the tensors. The engine of rank 0 (LeadEngine) sends, before each step, the requests added
and aborted since the last one; a follower (`follow`) applies them to its own engine, then steps.
In the manner of nano-vllm, whose rank 0 sends each model call to the other ranks.

References:
- nano-vllm (engine/model_runner.py: rank 0 writes each call for the others to replay).
- torch.distributed: new_group, broadcast_object_list.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from minillm.runtime.engine import Engine
from minillm.runtime.sequence import Sequence
from minillm.parallel.tensor_parallel import RankLost

IDLE_TIMEOUT = timedelta(days=7)  # a follower may wait this long for rank 0's next message (an idle server)


class Control:
    """Rank 0's messages to every rank: `share(obj)` on rank 0 returns obj on all of them."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)  # collective: every rank calls it
        self.rank = dist.get_rank()
        torch.manual_seed(self.share(torch.initial_seed()))  # unseeded sampling: the same draws on every rank

    def share(self, obj=None):
        box = [obj if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as exc:  # a rank died: its socket closed
            raise RankLost(f"tensor parallel rank {self.rank}: lost the other ranks ({exc})") from exc
        return box[0]

    def read_line(self, prompt: str = "you> ") -> str | None:
        """A line typed on rank 0, on every rank; None at the end of the input."""
        return self.share(read_line(prompt) if self.rank == 0 else None)


def read_line(prompt: str = "you> ") -> str | None:
    """input(), or None at the end of the input (Ctrl-D) or on Ctrl-C."""
    try:
        return input(prompt)
    except (EOFError, KeyboardInterrupt):
        return None


class LeadEngine(Engine):
    """Rank 0's engine: each step first sends the followers what changed since the last one."""

    def __init__(self, model, tokenizer, *args, control: Control, **kwargs):
        super().__init__(model, tokenizer, *args, **kwargs)
        self.control, self.events, self.requests = control, [], {}
        control.share(("engine", args, kwargs))  # the followers build the same engine

    def make_request(self, prompt_ids, *args, **kwargs) -> Sequence:
        seq = super().make_request(prompt_ids, *args, **kwargs)  # checked here: a bad one never reaches a follower
        self.requests[seq.id] = ((list(prompt_ids), *args), kwargs)
        return seq

    def submit(self, seq: Sequence) -> int:
        self.events.append(("add", self.requests.pop(seq.id), [s.id for s in (seq, *seq.forks)]))
        return super().submit(seq)

    def abort(self, request_id: int) -> None:
        self.events.append(("abort", request_id))
        super().abort(request_id)

    def step(self):
        events, self.events = self.events, []
        self.control.share(("step", events))
        return super().step()

    def close(self) -> None:
        """Tell the followers to stop (after the last step)."""
        self.control.share(None)


def apply_events(engine: Engine, events: list) -> None:
    """A follower replays rank 0's requests and aborts, with rank 0's request ids."""
    for event in events:
        if event[0] == "abort":
            engine.abort(event[1])
            continue
        (args, kwargs), ids = event[1], event[2]
        seq = engine.make_request(*args, **kwargs)
        for s, rid in zip((seq, *seq.forks), ids):
            s.id = rid
        engine.submit(seq)


def follow(model, tokenizer, control: Control) -> int:
    """A follower rank's engine loop, until rank 0 closes: build the engine rank 0 built, then for each
    of its steps apply the same events and step. Returns the number of steps taken."""
    _, args, kwargs = control.share()
    engine, steps = Engine(model, tokenizer, *args, **kwargs), 0
    while (message := control.share()) is not None:
        apply_events(engine, message[1])
        try:
            engine.step()
        except RankLost:
            raise
        except Exception:  # rank 0's step failed the same way: its aborts arrive with the next message
            pass
        steps += 1
    return steps
