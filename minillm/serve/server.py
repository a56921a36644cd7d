# Generated from notebooks/18_server.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""An OpenAI-compatible HTTP server over the continuous-batching engine.

Built in notebooks/18_server.ipynb. One background thread owns the Engine (notebook 17) and steps it while any
request is unfinished; each request gets an asyncio.Queue of its Outputs, handed over with loop.call_soon_threadsafe,
so concurrent requests share forward passes; a client that hangs up aborts its request, freeing its KV blocks.
Around it: openai_protocol.py (requests, answers, error JSON), fields.py (the request fields, the small endpoints),
plumbing.py (the in-flight limit, the error handlers), tool_stream.py, and ops.py (keys, limits, metrics, the
access log, timeouts, a graceful shutdown). References: the OpenAI API reference and its OpenAPI spec; vLLM's
OpenAI-compatible server (the queue-per-request bridge over one engine loop; /tokenize).
"""

from __future__ import annotations

import asyncio
import queue
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from minillm.runtime.llm import LLM
from minillm.runtime.engine import Engine, Output
from minillm.runtime.sequence import WAITING, Sequence, adapter_names
from minillm.serve.fields import (CHAT_FIELDS, TEXT_FIELDS, add_routes, check_fields, legacy_answer, parse_completion,
                                  read_prompt)
from minillm.serve.openai_protocol import (APIError, ParsedRequest, Reply, answer_text, best_choices, output_events,
                                           read_json, sse, token_logprobs)
from minillm.runtime.sampling import SamplingParams
from minillm.serve.ops import (APIKeys, Gate, GracefulServer, KeyLimits, Metrics, RequestRecord, configure_access_log,
                               schema_pages, validate_seconds)
from minillm.serve.plumbing import InFlight, add_error_handlers, as_api_error
from minillm.serve.tool_stream import tool_events
from minillm.text.chat_template import validate_template_kwargs
from minillm.text.tool_calls import call_style, tools_template


def apply_commands(engine: Engine, commands: queue.SimpleQueue) -> None:
    """Run the posted commands (from the engine thread, between steps): ("add", Sequence) submits a
    request made by Engine.make_request, ("abort", id) stops one."""
    while not commands.empty():
        kind, arg = commands.get()
        if kind == "add":
            engine.submit(arg)
        else:
            engine.abort(arg)


def step_or_fail(engine: Engine) -> list[Output]:
    """One engine step; if it raises, every request gets a final Output with finish_reason "error" and
    is aborted, so the engine stays usable."""
    try:
        return engine.step()
    except Exception as exc:
        rids = list(engine.sequences)
        outputs = [Output(rid, None, "", True, "error", f"engine error: {exc}") for rid in rids]
        for rid in rids:
            engine.abort(rid)
        return outputs


def deliver(outputs: list[Output], queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]]) -> None:
    """Hand each Output to its request's asyncio.Queue on that queue's event loop (from the engine thread,
    by call_soon_threadsafe). A finished request leaves `queues`; an aborted one's Outputs are dropped."""
    for out in outputs:
        target = queues.pop(out.request_id, None) if out.finished else queues.get(out.request_id)
        if target is not None:
            loop, outputs_queue = target
            loop.call_soon_threadsafe(outputs_queue.put_nowait, out)


class PrefillStarts:
    """The requests whose prefill start someone awaits (the queue-time metric): `note`, on the engine
    thread after each step, calls on_start(t) of each request that left the waiting queue, t the step's start."""

    def __init__(self):
        self.watched: dict[int, tuple[Sequence, Callable[[float], None]]] = {}
        self.lock = threading.Lock()  # add and note run on two threads

    def add(self, seq: Sequence, on_start: Callable[[float], None] | None) -> None:
        if on_start is not None:
            with self.lock:
                self.watched[seq.id] = (seq, on_start)

    def note(self, began: float) -> None:
        with self.lock:
            started = [rid for rid, (seq, _) in self.watched.items() if seq.status != WAITING]
            calls = [self.watched.pop(rid) for rid in started]
        for seq, on_start in calls:
            if seq.num_computed:  # its prefill ran (not a request aborted while it waited)
                on_start(began)


class EngineThread:
    """The thread that owns an Engine: it sleeps until woken, applies the posted commands, and steps
    while any request is unfinished, delivering each step's Outputs. EngineBridge adds the request API."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # ("add", Sequence) or ("abort", id), thread-safe
        self.wake = threading.Event()
        self.queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # set by add, popped by the thread
        self.steps = 0  # forward rounds taken, for the curious
        self.starts = PrefillStarts()  # the requests whose prefill start is awaited (their queue time)
        self.running = False
        self.thread: threading.Thread | None = None
        self.here = False  # True: stepped by the thread that calls step_here, not a thread of its own

    def start(self) -> None:
        self.running = True
        if not self.here:  # serve's main thread steps it (step_here)
            self.thread = threading.Thread(target=self._loop, name="minillm-engine", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        self.running = False
        self.wake.set()
        if self.thread is not None:
            self.thread.join()

    def _apply_commands(self) -> None:
        apply_commands(self.engine, self.commands)

    def _loop(self) -> None:
        while self.running:
            self.wake.wait()
            self.step_until_idle()

    def step_until_idle(self) -> None:
        """Apply the commands and step while any request is unfinished, delivering each step's Outputs."""
        self.wake.clear()  # before reading the commands: a command posted after this sets it again
        self._apply_commands()
        while self.running and self.engine.has_unfinished():
            began = time.monotonic()
            outputs = step_or_fail(self.engine)
            self.steps += 1
            self.starts.note(began)
            deliver(outputs, self.queues)
            self._apply_commands()  # between steps: new requests join, hung-up ones leave


def step_here(bridge: EngineThread, serving: threading.Thread) -> None:
    """`serve`'s way: step the engine on the calling thread (the main one) while `serving` (uvicorn's thread)
    lives; `bridge.here`, set before uvicorn starts, keeps `start` from starting a thread of its own."""
    while serving.is_alive():
        if bridge.wake.wait(timeout=0.25) and bridge.running:  # the timeout: notice uvicorn's end
            bridge.step_until_idle()


class EngineBridge(EngineThread):
    """One Engine stepped by one thread; each request receives its Outputs on an asyncio.Queue. `add`,
    `abort` and `end` only post commands, so the event loop never waits for the engine."""

    request_timeout: float | None = None  # seconds from add to the end of a request; None: no limit
    closed = False  # set by end_all: the server is shutting down, add refuses (503)

    def add(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int, stop: list[str],
            n: int = 1, on_start=None, **options) -> tuple[list[int], asyncio.Queue]:  # options: make_request's
        """Queue a request of n choices (from the event loop): their ids, their Outputs' queue; on_start: PrefillStarts."""
        if self.closed:
            raise APIError(503, "the server is shutting down", None, "shutting_down")
        seq = self.engine.make_request(prompt_ids, params, max_new_tokens, stop, n=n, **options)  # bad: ValueError
        rids = [seq.id] + [fork.id for fork in seq.forks]
        outputs, loop = asyncio.Queue(), asyncio.get_running_loop()
        self.queues.update((rid, (loop, outputs)) for rid in rids)
        self.starts.add(seq, on_start)
        self.commands.put(("add", seq))
        self.wake.set()
        if self.request_timeout is not None:  # a request still running then ends as if max_tokens were reached
            loop.call_later(self.request_timeout, self.end, rids, "length")
        return rids, outputs

    def abort(self, rids: list[int]) -> None:
        """The client left: stop these requests at the next step boundary and free their blocks."""
        for rid in rids:
            self.queues.pop(rid, None)
            self.commands.put(("abort", rid))
        self.wake.set()

    def end(self, rids: list[int], reason: str) -> None:
        """End these requests now (from the event loop): each unfinished one gets a last Output with
        `reason` and is aborted at the next step boundary."""
        for rid in rids:
            target = self.queues.pop(rid, None)  # None: finished, its last Output is on its way
            if target is not None:
                target[0].call_soon_threadsafe(target[1].put_nowait, Output(rid, None, "", True, reason))
                self.commands.put(("abort", rid))
        self.wake.set()

    def end_all(self, reason: str) -> None:
        """Shutdown: refuse new requests from now on, and end every request in flight with `reason`."""
        self.closed = True
        self.end(list(self.queues), reason)


async def _next_output(queue: asyncio.Queue) -> Output:
    out = await queue.get()
    if out.finish_reason == "error":
        raise APIError(500, out.error or "the engine failed this request", None, "engine_error")
    return out


async def collect_answer(bridge: EngineBridge, tokenizer, ids: list[int], req: ParsedRequest, reply: Reply,
                         request: Request, record: RequestRecord) -> dict:
    """The whole answer as one JSON object (the n best of best_of choices); a client that hangs up is
    noticed within half a second, by asking, and its request aborted."""
    rids, outputs = bridge.add(ids, req.params, req.max_new_tokens, req.stop, req.best_of, record.started,
                               **req.options)
    index, views = {rid: i for i, rid in enumerate(rids)}, [reply.at(i) for i in range(len(rids))]
    texts, lps, finish, scores = [[] for _ in rids], [[] for _ in rids], [None] * len(rids), None  # scores: echo's
    asked = time.monotonic()
    try:
        while None in finish:
            try:
                out = await asyncio.wait_for(_next_output(outputs), timeout=0.5)
                i, scores = index[out.request_id], out.prompt_logprobs or scores  # the prompt's, on its first
                record.output(i, out)
                texts[i].append(answer_text(views[i], out, tokenizer))  # a cut character dropped
                if out.token_id is not None:
                    lps[i].append(token_logprobs(tokenizer, out))
                finish[i] = out.finish_reason if out.finished else None
            except asyncio.TimeoutError:
                pass
            if time.monotonic() - asked > 0.5 and None in finish:
                asked = time.monotonic()
                if await request.is_disconnected():
                    raise APIError(499, "the client closed the connection", None, "client_closed")
    finally:  # cancelled or hung up before the end: abort frees the blocks of every unfinished choice
        if None in finish:
            bridge.abort([rid for rid, reason in zip(rids, finish) if reason is None])
    best = best_choices(lps, req.n)
    choices = [reply.at(k).choice("".join(texts[i]), finish[i], lps[i] if req.logprobs else None)
               for k, i in enumerate(best)]
    answer = legacy_answer(reply.whole(choices, sum(map(len, lps))), req, scores, ids, tokenizer)  # /v1/completions'
    record.finish.update((i, c["finish_reason"]) for i, c in zip(best, answer["choices"]))  # as sent: tool_calls
    return answer


async def stream_answer(bridge: EngineBridge, tokenizer, ids: list[int], req: ParsedRequest, reply: Reply,
                        record: RequestRecord):
    """SSE events: for each choice a chunk per piece of text and its finish; optionally usage; [DONE].
    The request starts with the stream; `record.end` ends it, whichever way the stream ends."""
    pending, status, n = set(), 499, 0  # 499 (client closed) unless the stream reaches its end
    try:
        rids, queue = bridge.add(ids, req.params, req.max_new_tokens, req.stop, req.n, record.started, **req.options)
        events = tool_events if req.tools else output_events  # with tools: text until a call can begin
        pending, replies = set(rids), {rid: reply.at(i) for i, rid in enumerate(rids)}
        for one in replies.values() if reply.chat else ():
            yield one.opening()
        while pending:
            out = await _next_output(queue)
            reply = replies[out.request_id]  # this choice's view: its chunks carry its index
            record.output(reply.index, out)
            n += out.token_id is not None
            for event in events(out, reply, tokenizer, req.logprobs):
                yield event
            if out.finished:
                pending.discard(out.request_id)
                record.finish[reply.index] = reply.finish or out.finish_reason  # as sent: tool_calls
        if req.include_usage:
            yield reply.chunk([], usage=reply.usage(n))
        yield sse("[DONE]")
        status = 200
    except APIError as exc:  # the engine failed it mid-stream, or the server closed: an error event, the end
        status = exc.status
        yield sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code}})
        yield sse("[DONE]")
    finally:  # the client hung up (cancelled or closed at a yield): abort frees the blocks
        record.end(status)
        if pending:
            bridge.abort(list(pending))


def completion_handler(llm: LLM, bridge: EngineBridge, gate: Gate, context: int, model_name: str,
                       max_body_bytes: int, lenient: bool = False, template_defaults: dict | None = None,
                       reasoning_budget: int | None = None):
    """The body of both completion endpoints: admit, read, check, then answer whole or as a stream."""
    template_defaults = validate_template_kwargs(template_defaults, "default chat_template_kwargs")  # at start-up
    bridge.engine.constraints.for_format(None, False, reasoning_budget)  # checks the budget, at start-up too
    style = call_style(tools_template(llm.tokenizer))  # Hermes JSON or Qwen3.5's XML calls (notebook 14)

    async def complete(request: Request, chat: bool):
        record = gate.admit(request)  # 503, 401, 429: counted from here, a burst cannot pass together
        streaming = False
        try:
            body = await read_json(request, max_body_bytes)
            check_fields(body, CHAT_FIELDS if chat else TEXT_FIELDS, lenient)  # a field it does not do: 400
            ids = await asyncio.to_thread(read_prompt, llm, body, chat, template_defaults)  # a template: up to 2 s
            req = parse_completion(body, ids, context, llm.model.config.vocab_size, model_name, chat,
                                bridge.engine.constraints, adapter_names(llm.model), style)  # notebooks 14 and 17
            thinking = llm.thinking(ids) if chat else None  # None: no reasoning to split, nor to wait for
            req.options.update(thinking=thinking, reasoning_budget=reasoning_budget)  # a grammar after </think>
            reply = Reply(chat, req.model, len(ids), req.tools, req.one_call, thinking)
            record.begin(reply.head["id"], len(ids))
            if not req.stream:
                answer = await collect_answer(bridge, llm.tokenizer, ids, req, reply, request, record)
                record.status = 200
                return answer
            events = stream_answer(bridge, llm.tokenizer, ids, req, reply, record)
            weakref.finalize(events, record.end)  # a stream never started (the client left first) ends too
            streaming = True
            return StreamingResponse(events, media_type="text/event-stream")
        except Exception as exc:
            error = as_api_error(exc)
            record.status = error.status
            raise error from None
        finally:
            if not streaming:  # a stream ends its record when it ends
                record.end()

    return complete


def model_list(model_name: str, context: int, adapters: list[str] = ()) -> dict:
    """The body of GET /v1/models: the served model, its LoRA adapters (notebook 20), the context length."""
    entry = {"object": "model", "created": 0, "owned_by": "minillm", "max_model_len": context}
    return {"object": "list", "data": [{"id": model_name, **entry}] +
            [{"id": f"{model_name}:{name}", "parent": model_name, **entry} for name in adapters]}


def health_report(bridge: EngineBridge, gate: Gate) -> dict:
    """The body of GET /health: the scheduler's queues, the free KV blocks, the requests in flight."""
    sched = bridge.engine.scheduler
    return {"status": "draining" if gate.draining else "ok", "running": len(sched.running),
            "waiting": len(sched.waiting), "free_blocks": bridge.engine.manager.num_free_blocks,
            "in_flight": gate.in_flight.count}


PREFILL_CHUNK = 512  # prompt tokens per engine step (notebook 17's chunked prefill)


def create_app(llm: LLM, model_name: str = "minillm", num_blocks: int = 256, block_size: int = 16,
               max_num_seqs: int = 64, max_in_flight: int = 128, max_body_bytes: int = 1 << 20,
               api_keys: Iterable[str] = (), max_concurrent_per_key: int | None = None,
               tokens_per_minute: int | None = None, request_timeout: float | None = None,
               shutdown_grace: float = 20.0, prefill_chunk: int | None = PREFILL_CHUNK, engine_class=None,
               lenient: bool = False, chat_template_kwargs: dict | None = None, reasoning_budget: int | None = None):
    """A FastAPI app answering the OpenAI API with `llm` through one engine (the flags of serve, docs/server.md)."""
    engine = engine_class or getattr(llm, "engine_class", Engine)  # nb 21's LeadEngine, or the llm's own (A6)
    bridge = EngineBridge(engine(llm.model, llm.tokenizer, num_blocks, block_size, max_num_seqs, prefill_chunk=prefill_chunk))
    bridge.request_timeout = validate_seconds("request_timeout", request_timeout, none_ok=True)
    grace = validate_seconds("shutdown_grace", shutdown_grace)
    context = min(llm.model.config.max_position_embeddings, num_blocks * block_size)
    in_flight = InFlight(max_in_flight)
    metrics = Metrics(bridge.engine, in_flight)
    gate = Gate(APIKeys(api_keys), KeyLimits(max_concurrent_per_key, tokens_per_minute), in_flight, metrics)

    async def lifespan(app):
        bridge.start()
        yield
        bridge.stop()

    app = FastAPI(title="minillm", lifespan=lifespan, **schema_pages(gate.keys))  # with keys: no /docs
    app.state.bridge, app.state.context, app.state.gate = bridge, context, gate
    app.state.drain = lambda: drain(bridge, gate, grace)
    add_error_handlers(app)
    complete = completion_handler(llm, bridge, gate, context, model_name, max_body_bytes, lenient, chat_template_kwargs,
                                  reasoning_budget)
    add_routes(app, llm, gate, context, max_body_bytes, lambda: model_list(model_name, context, adapter_names(llm.model)),
               lenient, chat_template_kwargs)  # GET /v1/models, /v1/models/{id}; POST /tokenize, /detokenize

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.get("/health")
    async def health():  # open without a key: for load balancers
        return health_report(bridge, gate)

    @app.get("/metrics")
    async def prometheus():  # open without a key: for Prometheus (bind 127.0.0.1, or firewall it)
        return metrics.response()

    return app


async def drain(bridge: EngineBridge, gate: Gate, grace: float) -> None:
    """Graceful shutdown: new requests get 503; those in flight have `grace` seconds; then each one
    still running ends with finish_reason "length" (the spec has no "shutdown")."""
    gate.draining = True
    deadline = time.monotonic() + grace
    while gate.in_flight.count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    bridge.end_all("length")


GIL_SWITCH_S = 0.0005  # how soon a thread waiting for the GIL asks for it (CPython's default: 0.005)


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, access_log: str | None = "-", **app_kwargs) -> None:
    """Run the server (on 127.0.0.1 by default) until SIGTERM or Ctrl-C, then drain it and return.
    access_log: "-" (stderr), a file, or None."""
    configure_access_log(access_log)
    app = create_app(llm, **app_kwargs)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=10)  # after the drain: for a client that never reads
    server, bridge = GracefulServer(config, app.state.drain), app.state.bridge
    http = threading.Thread(target=server.run, name="minillm-http")  # uvicorn; the engine steps on this thread
    bridge.here = True
    handlers = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}  # (uvicorn's
    switch = sys.getswitchinterval()  # own handlers need the main thread)
    sys.setswitchinterval(GIL_SWITCH_S)  # the engine gets the GIL back from the HTTP thread's Python sooner
    try:
        http.start()
        step_here(bridge, http)
    finally:
        sys.setswitchinterval(switch)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if not server.started:  # uvicorn logged why (a port in use): its sys.exit(1) ended only its own thread
        raise SystemExit(1)


class BackgroundServer:
    """The app served by uvicorn in a daemon thread (notebooks, tests): port 0 asks the operating system
    for a free port, `url` is the one it got; `stop` shuts down as a signal would."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0):
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10)
        self.server = GracefulServer(config, app.state.drain)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server at {self.url} did not start within {timeout} s")
            time.sleep(0.02)

    def stop(self, timeout: float = 120.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)
