"""Exercise checks of notebooks 17 and 18: the scheduler's admission and preemption, server-sent events.

Each takes a student's function and returns True (PASS) or False (FAIL, with feedback); see
minillm/check/__init__.py for how they are called. The scheduler checks replay scripted traces (arrivals,
growth, a small block pool that forces preemption, a request that never fits) through the
student's function and through a reference scheduler written here, on the package's
BlockManager, and report the first step where they part. The SSE check parses the student's
events with a small parser written here and compares them with the reference events.
"""

from __future__ import annotations

import json
from collections import deque
from functools import partial

from minillm.check.harness import bounded, close_to, fail, run_check, run_explore
from minillm.runtime.engine import FINISHED, RUNNING, WAITING, Output, Sequence
from minillm.serve.openai_protocol import Reply
from minillm.cache.paged import BlockManager
from minillm.runtime.sampling import SamplingParams
from minillm.utils.validate import is_number


# ------------------------------------------------------------------ 12 engine: the reference scheduler


def _admit_ref(manager, waiting, running, max_num_seqs, max_model_len, *, skip=False, cap=True, plus_one=True,
               fresh_rule=True, reject=True):
    """The admission rule of notebook 17, with switches that plant the known mistakes."""
    admitted, rejected, fresh, i = [], [], set(), 0
    while i < len(waiting) and (not cap or len(running) < max_num_seqs):
        seq = waiting[i]
        ids = seq.token_ids
        if reject and (manager.blocks_needed(len(ids) + plus_one) > manager.num_blocks or len(ids) >= max_model_len):
            del waiting[i]
            rejected.append(seq)
            continue
        if not manager.can_allocate(ids) or (fresh_rule and fresh.intersection(manager.prefix_hits(ids))):
            if skip:
                i += 1
                continue
            break
        del waiting[i]
        seq.num_cached = manager.allocate(seq.id, ids)
        fresh.update(manager.block_table(seq.id)[seq.num_cached // manager.block_size:])
        seq.status = RUNNING
        running.append(seq)
        admitted.append(seq)
    return admitted, rejected


def _preempt_ref(manager, running, waiting, seq, *, keep_pending=True, front=True):
    manager.free(seq.id)
    running.remove(seq)
    if seq.pending is not None and keep_pending:
        seq.output_ids.append(seq.pending)
    seq.status, seq.pending = WAITING, None
    waiting.appendleft(seq) if front else waiting.append(seq)


def _make_room_ref(manager, running, waiting, *, preempt=_preempt_ref, oldest=False, reserve=True):
    decoding, preempted = [], 0
    for seq in list(running):
        if seq.status != RUNNING:
            continue
        while not manager.can_append(seq.id):
            victim = running[0] if oldest else running[-1]
            preempt(manager, running, waiting, victim)
            if victim in running or victim.id in manager.tables:
                fail(f"preempt_seq left sequence {victim.id} {'in running' if victim in running else 'holding blocks'}",
                     "preempt_seq frees the sequence's blocks (manager.free) and removes it from running")
            preempted += 1
            if victim is seq:
                break
        if seq.status == RUNNING:
            if reserve:
                manager.append(seq.id, seq.pending)
            decoding.append(seq)
    return decoding, preempted


# ------------------------------------------------------------------ 12 engine: the scripted traces

# (what, pool blocks, block size 4, prefix caching, max_num_seqs, max_model_len, new tokens per request,
#  {step: [(name, prompt)]})
_P = list(range(200, 208))  # a shared 8-token system prompt (two full blocks)
_SCENARIOS = [
    ("max_num_seqs=2 in a pool of 20 blocks: A, B, C 3 tokens, L 64 tokens (fills the context of 64), D 3",
     20, False, 2, 64, 3, {0: [("A", 3), ("B", 3), ("C", 3), ("L", 64), ("D", 3)]}),
    ("a queue in a pool of 6 blocks: A 9 tokens, B 6, E 24 (needs 7 blocks with its next token), C 7, D 2; "
     "F 3 at step 3", 6, False, 3, 64, 5,
     {0: [("A", 9), ("B", 6), ("E", 24), ("C", 7), ("D", 2)], 3: [("F", 3)]}),
    ("growth in a pool of 6 blocks: A, B, C 8 tokens each fill it; every one needs a new block for its next token",
     6, False, 3, 64, 6, {0: [("A", 8), ("B", 8), ("C", 8)]}),
    ("growth in a pool of 5 blocks, max_num_seqs=2: A, B, C 6 tokens (notebook 17's timeline)",
     5, False, 2, 64, 6, {0: [("A", 6), ("B", 6), ("C", 6)]}),
    ("prefix caching, pool of 16: A and B share an 8-token system prompt (2 blocks), C with it at step 3",
     16, True, 4, 64, 3, {0: [("A", _P + [1, 2]), ("B", _P + [3])], 3: [("C", _P + [4, 5, 6])]}),
]


def _sequence(seq_id: int, prompt) -> Sequence:
    ids = list(range(10 + 10 * seq_id, 10 + 10 * seq_id + prompt)) if isinstance(prompt, int) else list(prompt)
    return Sequence(seq_id, ids, SamplingParams(temperature=0), text=None)


def _replay(admit_fn, make_room_fn, scenario, steps: int = 16) -> list[dict]:
    """Each step: make room, admit, then play the engine (sample a token for each admitted and decoding
    sequence, finish those with enough new tokens). The log: who was admitted, rejected, preempted..."""
    _, num_blocks, prefix, max_num_seqs, max_len, new_tokens, arrivals = scenario
    manager = BlockManager(num_blocks, 4, enable_prefix_caching=prefix)
    waiting, running, names, log = deque(), [], {}, []
    show = lambda seqs: "".join(names[s.id] for s in seqs) or "-"
    for step in range(steps):
        for name, prompt in arrivals.get(step, []):
            names[len(names)] = name
            waiting.append(_sequence(len(names) - 1, prompt))
        before = list(running)
        result = bounded(make_room_fn, "make_room")(manager, running, waiting)
        if not (isinstance(result, tuple) and len(result) == 2):
            fail(f"make_room returned {result!r}, expected a tuple (decoding, number preempted)")
        decoding, n_preempted = result
        preempted = [s for s in before if s not in running]
        result = bounded(admit_fn, "admit")(manager, waiting, running, max_num_seqs, max_len)
        if not (isinstance(result, tuple) and len(result) == 2):
            fail(f"admit returned {result!r}, expected a tuple (admitted, rejected)")
        admitted, rejected = result
        log.append({"admitted": show(admitted), "rejected": show(rejected), "preempted": show(preempted),
                    "decoding": show(decoding), "preemptions counted": n_preempted,
                    "running": show(running), "waiting": show(waiting),
                    "free blocks": manager.num_free_blocks,
                    "tokens of the preempted": {names[s.id]: (len(s.token_ids), s.pending) for s in preempted},
                    "tokens of the admitted": {names[s.id]: len(s.token_ids) for s in admitted}})
        for seq in rejected:
            seq.status = FINISHED
        for seq in admitted + decoding:  # the engine's part: the pending token is computed, a new one sampled
            if seq.status != RUNNING:
                continue
            seq.output_ids += [] if seq.pending is None else [seq.pending]
            seq.pending = 1000 + 10 * step + seq.id
            if len(seq.output_ids) + 1 >= new_tokens:
                seq.output_ids.append(seq.pending)
                seq.pending, seq.status = None, FINISHED
                manager.free(seq.id)
                running.remove(seq)
        if not (waiting or running) and step >= max(arrivals):
            break
    return log


def _first_difference(got: list[dict], expected: list[dict]) -> str:
    for step, (g, e) in enumerate(zip(got, expected)):
        for key in e:
            if g[key] != e[key]:
                return (f"at step {step}: {key} {g[key]!r}, expected {e[key]!r} "
                        f"(the reference at that step: {', '.join(f'{k} {v!r}' for k, v in e.items() if v not in ('-', {}))})")
    return f"{len(got)} steps, expected {len(expected)}"


def _trace_check(name: str, student, build, mistakes) -> bool:
    """Replay every scenario with build(student) and build(reference); on a difference, name the likely mistake."""
    def body():
        for scenario in _SCENARIOS:
            expected = _replay(*build(None), scenario)
            got = _replay(*build(student), scenario)
            if got != expected:
                message = f"{scenario[0]}: {_first_difference(got, expected)}"
                for hint, variant in mistakes:
                    try:
                        if _replay(*build(variant), scenario) == got:
                            fail(message, hint)
                    except (AssertionError, KeyError, ValueError, IndexError):
                        continue
                fail(message)
    return run_check(name, body)


_ADMIT_MISTAKES = [
    ("oldest first: when the oldest waiting request does not fit, stop (break); skipping it to admit a smaller "
     "one behind it could starve it", partial(_admit_ref, skip=True)),
    ("at most max_num_seqs sequences may be running: loop only while len(running) < max_num_seqs",
     partial(_admit_ref, cap=False)),
    ("a request needs blocks for its tokens plus the one it will sample: reject it when "
     "blocks_needed(len(ids) + 1) > num_blocks", partial(_admit_ref, plus_one=False)),
    ("a request that can never fit (more blocks than the pool, or len(ids) >= max_model_len) is rejected: "
     "take it off the queue, add it to rejected, and go on with the next", partial(_admit_ref, reject=False)),
    ("a prompt whose prefix_hits include a block allocated earlier in this same call waits one step "
     "(the fresh set): that block's keys are written only by this step's prefill",
     partial(_admit_ref, fresh_rule=False)),
]

_PREEMPT_MISTAKES = [
    ("keep the pending token: it was sampled and streamed already, so it moves into output_ids before "
     "pending is cleared (the re-prefill computes its KV)", partial(_preempt_ref, keep_pending=False)),
    ("the preempted sequence goes back to the FRONT of the queue (appendleft): it was admitted before "
     "anyone still waiting", partial(_preempt_ref, front=False)),
]

_MAKE_ROOM_MISTAKES = [
    ("preempt the NEWEST running sequence (running[-1]), not the oldest: it has done the least work",
     partial(_make_room_ref, oldest=True)),
    ("reserve the slot: once can_append allows, manager.append(seq.id, seq.pending) before adding the "
     "sequence to decoding", partial(_make_room_ref, reserve=False)),
    *[(hint, partial(_make_room_ref, preempt=wrong)) for hint, wrong in _PREEMPT_MISTAKES],
]


def admit(fn) -> bool:
    """admit(manager, waiting, running, max_num_seqs, max_model_len) -> (admitted, rejected), replayed on traces."""
    return _trace_check("admit", fn, lambda f: (f or _admit_ref, _make_room_ref), _ADMIT_MISTAKES)


def preempt_seq(fn) -> bool:
    """preempt_seq(manager, running, waiting, seq): free, requeue first, keep the pending token."""
    return _trace_check("preempt_seq", fn, lambda f: (_admit_ref, partial(_make_room_ref, preempt=f or _preempt_ref)),
                        [(h, v.keywords["preempt"]) for h, v in _MAKE_ROOM_MISTAKES if "preempt" in v.keywords])


def make_room(fn) -> bool:
    """make_room(manager, running, waiting) -> (decoding, preempted): oldest first, preempting the newest."""
    return _trace_check("make_room", fn, lambda f: (_admit_ref, f or _make_room_ref), _MAKE_ROOM_MISTAKES)


def explore_speedup_16(speedup_16, rates: dict | None = None) -> bool:
    """Exploration (notebook 17): the engine's throughput with 16 concurrent requests over that with 1.

    rates: the notebook's measurements, {concurrent requests: tokens/s}. The check computes the reference
    from them and accepts 1% either way, naming the likely slip. Without them (a measurement it cannot
    see) it asks for a plausible number: more than 1 and at most about 16."""
    def body():
        if not is_number(speedup_16):
            fail(f"speedup_16 is {speedup_16!r}, expected a number (tokens/s at 16 requests over tokens/s at 1)")
        if rates is not None:
            want = rates[16] / rates[1]
            close_to("speedup_16", speedup_16, want, rel=0.01, mistakes=[
                ("divide the throughput at 16 requests by the throughput at 1, not the reverse", 1 / want),
                ("that is per request: the question asks for all 16 requests' tokens per second together", want / 16),
                *[(f"compare 16 requests with 1, not {n} with 1", rates[n] / rates[1]) for n in rates if n not in (1, 16)],
                *[(f"compare 16 requests with 1, not with {n}", rates[16] / rates[n]) for n in rates if n not in (1, 16)],
            ], hint="the ratio of two entries of the measured rates: the one at 16 over the one at 1")
            return
        if speedup_16 < 1:
            fail(f"speedup_16 = {speedup_16:.3g}, below 1",
                 "divide the throughput at 16 requests by the throughput at 1, not the reverse" if speedup_16 > 0 else None)
        if speedup_16 > 20:
            fail(f"speedup_16 = {speedup_16:.3g}: more than 16 requests' worth; 16 sequences cannot make "
                 "a step cheaper than one", "compare tokens per second (generated tokens / seconds), both measured "
                 "the same way, after a warm-up")
    return run_explore("speedup_16", body)


# ------------------------------------------------------------------ 14 server: one output, its events


def parse_sse(stream: str) -> list[str]:
    """The data of each event in an SSE stream (the WHATWG rules the OpenAI client follows, for the
    `data` field): events end at a blank line, a field is `name: value` (one space after the colon
    dropped), several data lines join with newlines, comment lines (`:`) and other fields are skipped."""
    events, data = [], []
    for line in stream.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if line == "":
            if data:
                events.append("\n".join(data))
            data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    return events


class _Tokens:
    """A tokenizer with one byte string per token id and no special tokens (all output_events needs)."""

    special_ids = frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        return {42: b"Par", 43: b"\xc3", 44: b"\xa9 is", 45: b".", 7: b"<|im_end|>"}.get(token_id, b"?")


def _reply(chat: bool):
    reply = Reply(chat, "checker-model", prompt_tokens=5)
    reply.head.update(id="chatcmpl-check" if chat else "cmpl-check", created=1700000000)
    return reply


def _lp(out: Output) -> dict:
    def entry(tid: int, logprob: float) -> dict:
        raw = _Tokens().token_bytes(tid)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
    return {**entry(out.token_id, out.logprob), "top_logprobs": [entry(t, p) for t, p in (out.top_logprobs or [])]}


def _events_ref(out: Output, reply, logprobs: bool, *, skip_empty=True, finish=True, empty_delta=True,
                finish_on_text=False, with_logprobs=True) -> list[dict]:
    """The chunks (as JSON objects) that one output sends; the switches plant the known mistakes."""
    head = {**reply.head, "object": reply.chunk_object}

    def choice(text, reason, lp):
        if not reply.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "delta": {"content": text},
                "logprobs": None if lp is None else {"content": lp, "refusal": None}, "finish_reason": reason}

    lp = [_lp(out)] if logprobs and with_logprobs and out.token_id is not None else None
    events = []
    if out.text or lp or not skip_empty:
        events.append({**head, "choices": [choice(out.text, out.finish_reason if finish_on_text else None, lp)]})
    if out.finished and finish and not (finish_on_text and events):
        last = choice("", out.finish_reason, None)
        if reply.chat and empty_delta:
            last["delta"] = {}
        events.append({**head, "choices": [last]})
    return events


_OUTPUTS = [
    ("a token with text", Output(0, 42, "Par", logprob=-0.25, top_logprobs=[(42, -0.25), (45, -2.0)])),
    ("a token whose text waits for the next one (half a UTF-8 character)", Output(0, 43, "", logprob=-0.5)),
    ("the last token, with text, finish_reason 'length'", Output(0, 44, "é is", True, "length", logprob=-1.0)),
    ("a last output without token or text (a stop string), finish_reason 'stop'", Output(0, None, "", True, "stop")),
]


def output_events(fn) -> bool:
    """output_events(out, reply, tokenizer, logprobs) -> the SSE strings one engine Output sends."""
    def body():
        for chat in (True, False):
            for logprobs in (False, True) if chat else (False,):  # a streamed completion refuses logprobs
                for what, out in _OUTPUTS:
                    reply = _reply(chat)
                    name = (f"output_events({what}, {'chat' if chat else 'text'} completion, "
                            f"logprobs={logprobs})")
                    got = fn(out, reply, _Tokens(), logprobs)
                    if not isinstance(got, (list, tuple)) or not all(isinstance(e, str) for e in got):
                        fail(f"{name} returned {got!r}, expected a list of strings (SSE events)",
                             "return a list: each event is reply.chunk([...]), a string")
                    for e in got:
                        if not (e.startswith("data: ") and e.endswith("\n\n")):
                            fail(f"{name}: the event {e!r} is not one SSE event `data: {{json}}` followed by a "
                                 "blank line", "build each event with reply.chunk([...]): it writes the `data: ` "
                                 "line and the blank line that ends the event")
                    try:
                        parsed = [json.loads(d) for d in parse_sse("".join(got))]
                    except ValueError as exc:
                        fail(f"{name}: an event's data is not JSON ({exc}): {got!r}")
                    expected = _events_ref(out, reply, logprobs)
                    if parsed == expected:
                        continue
                    choices = lambda events: [e.get("choices") if isinstance(e, dict) else e for e in events]
                    if choices(parsed) == choices(expected):
                        fail(f"{name}: the right choices, but the chunks are {parsed}, expected {expected}",
                             "build each event with reply.chunk([choice]): it adds the answer's id, object "
                             "(chat.completion.chunk), created and model")
                    message = (f"{name}: sent {len(parsed)} event(s), their choices {choices(parsed)}; expected "
                               f"{len(expected)}: {choices(expected)}")
                    for hint, kw in _SSE_MISTAKES:
                        if parsed == _events_ref(out, reply, logprobs, **kw):
                            fail(message, hint)
                    fail(message)
    return run_check("output_events", body)


_SSE_MISTAKES = [
    ("an output without text sends no chunk (its character is still incomplete, or the request ended "
     "without a token), unless logprobs were asked for and it has a token", {"skip_empty": False}),
    ("the request's last output (out.finished) is followed by a finishing chunk: empty text and "
     "out.finish_reason", {"finish": False}),
    ("in a chat stream the finishing chunk's delta is empty, {}: set last['delta'] = {}", {"empty_delta": False}),
    ("the text chunk has finish_reason None; the finish travels in a chunk of its own, after it",
     {"finish_on_text": True}),
    ("with logprobs asked for, a token's chunk carries [token_logprobs(tokenizer, out)] (and is sent even "
     "without text)", {"with_logprobs": False}),
]


def explore_text_share(text_share) -> bool:
    """Exploration (notebook 18): the answer's text bytes over all the bytes its stream sent.

    A measurement: each chunk repeats the answer's id, object, time and model around a few bytes of
    text, so the share is small but not zero."""
    def body():
        if not is_number(text_share):
            fail(f"text_share is {text_share!r}, expected a number (text bytes / stream bytes)")
        if text_share > 1:
            fail(f"text_share = {text_share:.3g}, more than 1", "divide the text's bytes by all the events' bytes, "
                 "not the reverse")
        if not 0.005 < text_share < 0.2:
            fail(f"text_share = {text_share:.3g}; a chunk of some 200 bytes carries a few bytes of text, so "
                 "expected between 0.005 and 0.2", "count bytes (len of .encode()) of the answer's text and of "
                 "every event the stream sent, [DONE] included")
    return run_explore("text_share", body)


EXPLORE = {"speedup_16": explore_speedup_16, "text_share": explore_text_share}
"""Exploration name -> its check: measurements on this machine, so the checks accept a plausible range."""
