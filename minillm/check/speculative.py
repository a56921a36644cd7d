"""Exercise checks of notebook 19 (plumbing): speculative decoding's sampling rule, and its exploration.

The rule is random, so its check is statistical: on a small vocabulary it draws thousands of guesses
from a drafter's q, applies the student's rule, and compares the frequencies of the first token
emitted with the model's p (total variation, against a bound five times the sampling noise). A
wrong rule is named by the distribution it produces, computed exactly here for each known mistake.
Two deterministic properties come first: a drafter equal to the model has every guess kept, and a
guess the model gives probability 0 is always rejected.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from minillm.api import load
from minillm.bench.speculative import TASKS
from minillm.check.harness import close_to, fail, run_check, run_explore
from minillm.runtime.speculative import NgramDrafter, SpeculationStats, stream

DRAWS = 6_000
# The first token each known mistake emits, as a distribution over the vocabulary, from p and q rows.
_MISTAKES = {
    "keep a guess with probability min(1, p(x) / q(x)), a random draw against the ratio; keeping it "
    "whenever p(x) > q(x) favours the drafter": lambda p, q, r: _mix(q * (p > q), r),
    "on a rejection draw from the residual, max(0, p - q) normalised, not from p: the kept guesses "
    "already gave min(p, q)": lambda p, q, r: _mix(torch.minimum(p, q), p),
    "the ratio is p(x) / q(x), the model's probability over the drafter's": lambda p, q, r: _mix(
        q * torch.clamp(q / p, max=1), r),
}


def _mix(kept: torch.Tensor, then: torch.Tensor) -> torch.Tensor:
    """P(first token) when each token is kept with mass `kept`, and the rest of the mass goes to `then`."""
    return kept + (1 - kept.sum()) * then / then.sum()


def _toy(seed: int = 1, V: int = 6, k: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(k + 1, V, generator=g), -1), torch.softmax(2 * torch.randn(k, V, generator=g), -1)


def _result(fn, p, q, draft, g) -> tuple[int, int]:
    out = fn(p, q, draft, g)
    if not (isinstance(out, tuple) and len(out) == 2):
        fail(f"accept_sampled returned {out!r}, expected (drafts kept, the token after them)")
    return int(out[0]), int(out[1])


def accept_sampled(fn) -> bool:
    """accept_sampled(p (k+1, V), q (k, V), draft, generator) -> (kept, token): the emitted tokens follow p."""
    def body():
        g = torch.Generator().manual_seed(0)
        p, q = _toy()
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        try:
            kept, _ = _result(fn, p, p[:2].clone(), draft, g)
        except NotImplementedError:  # a RuntimeError too: the stub, reported as such by run_check
            raise
        except RuntimeError as exc:  # e.g. a draw from an all-zero residual: p - q = 0 when q equals p
            fail(f"with q equal to p your code raised RuntimeError: {exc}",
                 "with q equal to p every guess is kept (p/q = 1): keep guess x when a uniform draw is below "
                 "min(1, p(x) / q(x)), so the residual (all zeros here) is never drawn from")
        if kept != 2:
            fail(f"with q equal to p every guess must be kept (p/q = 1), but {kept} of 2 were",
                 "keep guess x when a uniform draw is below min(1, p(x) / q(x))")
        zero = p.clone()
        zero[0, 3] = 0.0
        zero[0] /= zero[0].sum()
        one_hot = torch.zeros(2, 6)
        one_hot[0, 3] = one_hot[1, 1] = 1.0
        kept, token = _result(fn, zero, one_hot, [3, 1], g)
        if kept != 0 or token == 3:
            fail(f"a guess the model gives probability 0 must be rejected and never emitted; got kept {kept}, "
                 f"token {token}", "a guess with p(x) = 0 has ratio p(x) / q(x) = 0, so it is never kept, and the "
                 "residual max(0, p - q) is 0 there, so it is never drawn")
        counts = torch.zeros(6)
        for _ in range(DRAWS):
            guesses = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            kept, token = _result(fn, p, q, guesses, g)
            counts[guesses[0] if kept else token] += 1
        freq, noise = counts / DRAWS, 0.5 * (6 / DRAWS) ** 0.5
        tv = 0.5 * float((freq - p[0]).abs().sum())
        if tv <= 5 * noise:
            return
        r = (p[0] - q[0]).clamp(min=0)
        message = f"over {DRAWS} rounds the first token emitted is {tv:.3f} (total variation) from the model's p"
        distances = {hint: 0.5 * float((freq - wrong(p[0], q[0], r)).abs().sum()) for hint, wrong in _MISTAKES.items()}
        hint = min(distances, key=distances.get)
        fail(message, hint if distances[hint] <= 5 * noise else None)
    return run_check("accept_sampled", body)


# ------------------------------------------------------------------ the exploration: what prompt lookup saves

EDIT = TASKS["copy-edit"]  # the benchmark's copy-edit task, notebook 19's too


@lru_cache(maxsize=1)
def lookup_forwards_saved(num_draft: int = 8) -> float:
    """The share of SmolLM2's decode forwards that prompt lookup (up to num_draft guesses) saves on the
    copy-edit task: 1 - forwards / tokens after the first (greedy, up to 96 tokens, ended by end-of-turn)."""
    llm = load(device="cpu")
    ids = llm.encode_chat([{"role": "user", "content": EDIT}])
    stats = SpeculationStats()
    for _ in stream(llm.model, llm.tokenizer, ids, NgramDrafter(), max_new_tokens=96, num_draft=num_draft, stats=stats):
        pass
    return 1 - stats.rounds / stats.emitted


def explore_lookup_forwards_saved(value) -> bool:
    """The share of forwards prompt lookup with num_draft=8 saves on notebook 19's copy-edit; within 0.02."""
    def body():
        want = lookup_forwards_saved()
        close_to("lookup_forwards_saved", value, want, abs_=0.02, mistakes=[
            ("that is the share of forwards run; the question asks for the share saved (1 minus it)", 1 - want),
            ("tokens per forward is not a share: saved = 1 - forwards / tokens", 1 / (1 - want)),
            ("with num_draft=8, not the default 4", lookup_forwards_saved.__wrapped__(4))],
            hint="run stream with NgramDrafter() and num_draft=8 on the copy-edit prompt, with a "
                 "SpeculationStats; plain decoding runs one forward per token after the first")
    return run_explore("lookup_forwards_saved", body)


EXPLORE = {"lookup_forwards_saved": explore_lookup_forwards_saved}
