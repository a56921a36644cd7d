# Generated from notebooks/14_server.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""An OpenAI-compatible HTTP server over the continuous-batching engine.

Built in notebooks/14_server.ipynb. One background thread owns the Engine (notebook 12) and steps
it while any request is unfinished; each request gets an asyncio.Queue of its Outputs, handed over
with loop.call_soon_threadsafe, so concurrent requests share forward passes. A client that hangs
up mid-stream aborts its request, which frees its KV blocks.

Endpoints: POST /v1/chat/completions, POST /v1/completions (stream: server-sent events ending in
`data: [DONE]`), GET /v1/models, GET /health. Errors: {"error": {"message", "type", "param", "code"}}.

References: the OpenAI API reference (chat completions, completions, streaming, error codes);
vLLM's OpenAI-compatible API server (the queue-per-request bridge over one engine loop).
The protocol (request checks, response shapes, error JSON) is minillm/openai_protocol.py.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.api import LLM
from minillm.engine import Engine, Output
from minillm.openai_protocol import (APIError, Reply, output_events, parse_request, read_json, read_prompt, sse,
                                      token_logprobs)
from minillm.sampling import SamplingParams


def apply_commands(engine: Engine, commands: queue.SimpleQueue) -> None:
    """Run every posted command on the engine (call it from the engine thread only, between steps):
    ("add", Sequence) submits a request made by Engine.make_request, ("abort", id) stops one."""
    while not commands.empty():
        kind, arg = commands.get()
        if kind == "add":
            engine.submit(arg)
        else:
            engine.abort(arg)


def step_or_fail(engine: Engine) -> list[Output]:
    """One engine step. If it raises (a bug, a device error), every request gets a final Output with
    finish_reason "error" and is aborted, so the engine stays usable for the requests that follow."""
    try:
        return engine.step()
    except Exception as exc:
        rids = list(engine.sequences)
        outputs = [Output(rid, None, "", True, "error", f"engine error: {exc}") for rid in rids]
        for rid in rids:
            engine.abort(rid)
        return outputs


def deliver(outputs: list[Output], queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]]) -> None:
    """Hand each Output to its request's asyncio.Queue, on that queue's own event loop (called from the
    engine thread: call_soon_threadsafe is the thread-safe way in). A finished request leaves `queues`;
    an Output of a request no longer in it (aborted) is dropped."""
    for out in outputs:
        target = queues.pop(out.request_id, None) if out.finished else queues.get(out.request_id)
        if target is not None:
            loop, outputs_queue = target
            loop.call_soon_threadsafe(outputs_queue.put_nowait, out)


class EngineThread:
    """The thread that owns an Engine: it sleeps until woken, applies the posted commands, and steps
    while any request is unfinished, delivering each step's Outputs. AsyncEngine adds the request API."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # ("add", Sequence) or ("abort", id), thread-safe
        self.wake = threading.Event()
        self.queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # set by add, popped by the thread
        self.steps = 0  # forward rounds taken, for the curious
        self.running = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.running = True
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
            self.wake.clear()  # before reading the commands: a command posted after this sets it again
            self._apply_commands()
            while self.running and self.engine.has_unfinished():
                outputs = step_or_fail(self.engine)
                self.steps += 1
                deliver(outputs, self.queues)
                self._apply_commands()  # between steps: new requests join, hung-up ones leave


class AsyncEngine(EngineThread):
    """One Engine stepped by one thread; each request receives its Outputs on an asyncio.Queue.

    The event loop never waits for the engine: `add` checks the request (Engine.make_request
    touches no engine state) and posts it, `abort` posts the id, and the engine thread applies
    both between steps. A step can take seconds (a long prefill); /health and every other
    request stay responsive meanwhile."""

    def add(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
            stop: list[str]) -> tuple[int, asyncio.Queue]:
        """Queue a request (call from the event loop); returns its id and the queue its Outputs arrive on.
        A bad request raises ValueError here, before anything is queued."""
        seq = self.engine.make_request(prompt_ids, params, max_new_tokens, stop)
        outputs: asyncio.Queue = asyncio.Queue()
        self.queues[seq.id] = (asyncio.get_running_loop(), outputs)
        self.commands.put(("add", seq))
        self.wake.set()
        return seq.id, outputs

    def abort(self, rid: int) -> None:
        """The client left: stop the request at the next step boundary and free its blocks."""
        self.queues.pop(rid, None)
        self.commands.put(("abort", rid))
        self.wake.set()


async def _next_output(queue: asyncio.Queue) -> Output:
    out = await queue.get()
    if out.finish_reason == "error":
        raise APIError(500, out.error or "the engine failed this request", None, "engine_error")
    return out


async def collect_answer(engine: AsyncEngine, tokenizer, ids: list[int], req: dict, reply: Reply,
                         request: Request) -> dict:
    """The whole answer as one JSON object. A client that hangs up is noticed within half a second
    (nothing is written to it until the end, so only asking tells) and its request is aborted."""
    rid, outputs = engine.add(ids, req["params"], req["max_new_tokens"], req["stop"])
    texts, lps, out = [], [], None
    asked = time.monotonic()
    try:
        while out is None or not out.finished:
            try:
                out = await asyncio.wait_for(_next_output(outputs), timeout=0.5)
                texts.append(out.text)
                if out.token_id is not None:
                    lps.append(token_logprobs(tokenizer, out))
            except asyncio.TimeoutError:
                pass
            if time.monotonic() - asked > 0.5 and (out is None or not out.finished):
                asked = time.monotonic()
                if await request.is_disconnected():
                    raise APIError(499, "the client closed the connection", None, "client_closed")
    finally:  # cancelled or hung up before the end: abort frees its blocks
        if out is None or not out.finished:
            engine.abort(rid)
    return reply.whole("".join(texts), out.finish_reason, lps if req["logprobs"] else None, len(lps))


async def stream_answer(engine: AsyncEngine, tokenizer, ids: list[int], req: dict, reply: Reply,
                        release: Callable[[], None]):
    """SSE events: a chunk per piece of text, the finish, optionally usage, then [DONE].

    The request starts with the stream: a client gone before it never reaches the engine.
    `release` ends the request's in-flight count, whichever way the stream ends."""
    try:
        rid, queue = engine.add(ids, req["params"], req["max_new_tokens"], req["stop"])
    except BaseException:
        release()
        raise
    out = None
    try:
        if reply.chat:
            yield reply.chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
        n = 0
        while out is None or not out.finished:
            out = await _next_output(queue)
            n += out.token_id is not None
            for event in output_events(out, reply, tokenizer, req["logprobs"]):
                yield event
        if req["include_usage"]:
            yield reply.chunk([], usage=reply.usage(n))
        yield sse("[DONE]")
    except APIError as exc:  # the engine failed it mid-stream: an error event, then the end
        out = None
        yield sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code}})
        yield sse("[DONE]")
    finally:  # the client hung up (cancelled or closed at a yield): abort frees its blocks
        release()
        if out is None or not out.finished:
            engine.abort(rid)


class InFlight:
    """Requests from their arrival to their end; past `limit`, a new one is refused (429).

    `enter` counts a request before its body is read (so a burst cannot pass the check together)
    and returns its `release`, which is safe to call more than once: every path out calls it."""

    def __init__(self, limit: int):
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {limit!r}")
        self.limit, self.count = limit, 0
        self.lock = threading.RLock()  # a release may come from a finalizer: another thread, or a GC inside enter()

    def enter(self) -> Callable[[], None]:
        with self.lock:
            if self.count >= self.limit:
                raise APIError(429, f"{self.limit} requests are in flight; retry later", None, "too_many_requests")
            self.count += 1
        released = []

        def release() -> None:
            with self.lock:
                if not released:
                    released.append(True)
                    self.count -= 1
        return release


async def on_api_error(request, exc: APIError):
    return exc.response()


async def on_http_error(request, exc):  # unknown paths, wrong methods
    return APIError(exc.status_code, str(exc.detail)).response()


async def on_unexpected_error(request, exc):  # a bug outside the completions: still OpenAI's JSON
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error").response()


def add_error_handlers(app: FastAPI) -> None:
    """Every failure answers with OpenAI's error JSON: our APIErrors, the framework's 404 and 405, and bugs."""
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)


def completion_handler(llm: LLM, engine: AsyncEngine, in_flight: InFlight, context: int, model_name: str,
                       max_body_bytes: int):
    """The body of both completion endpoints: admit, read, check, then answer whole or as a stream."""

    async def complete(request: Request, chat: bool):
        release = in_flight.enter()  # counted from here: a burst cannot pass the check together
        streaming = False
        try:
            body = await read_json(request, max_body_bytes)
            ids = await asyncio.to_thread(read_prompt, llm, body, chat)  # a template may take its 2 s: not on the loop
            req = parse_request(body, ids, context, llm.model.config.vocab_size, model_name, chat)
            reply = Reply(chat, model_name, len(ids))
            if not req["stream"]:
                return await collect_answer(engine, llm.tokenizer, ids, req, reply, request)
            events = stream_answer(engine, llm.tokenizer, ids, req, reply, release)
            weakref.finalize(events, release)  # a stream never started (the client left first) releases too
            streaming = True
            return StreamingResponse(events, media_type="text/event-stream")
        except APIError:
            raise
        except ValueError as exc:  # the engine's own check of the request (e.g. an id outside the model)
            raise APIError(400, str(exc)) from None
        except Exception as exc:  # a bug: answered here, the connection stays up (on_unexpected_error would close it)
            raise APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error") from None
        finally:
            if not streaming:  # a stream releases when it ends
                release()

    return complete


def model_list(model_name: str, context: int) -> dict:
    """The body of GET /v1/models: the one model this server serves, and its context length."""
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                        "owned_by": "minillm", "max_model_len": context}]}


def health_report(engine: AsyncEngine, in_flight: InFlight) -> dict:
    """The body of GET /health: the scheduler's queues, the free KV blocks, the requests in flight."""
    sched = engine.engine.scheduler
    return {"status": "ok", "running": len(sched.running), "waiting": len(sched.waiting),
            "free_blocks": engine.engine.manager.num_free_blocks, "in_flight": in_flight.count}


def create_app(llm: LLM, model_name: str = "minillm", num_blocks: int = 256, block_size: int = 16,
               max_num_seqs: int = 64, max_in_flight: int = 128, max_body_bytes: int = 1 << 20) -> FastAPI:
    """A FastAPI app answering the OpenAI API with `llm` through one continuous-batching engine."""
    in_flight = InFlight(max_in_flight)
    engine = AsyncEngine(Engine(llm.model, llm.tokenizer, num_blocks, block_size, max_num_seqs))
    context = min(llm.model.config.max_position_embeddings, num_blocks * block_size)

    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.engine, app.state.context = engine, context
    add_error_handlers(app)
    complete = completion_handler(llm, engine, in_flight, context, model_name, max_body_bytes)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.get("/v1/models")
    async def models():
        return model_list(model_name, context)

    @app.get("/health")
    async def health():
        return health_report(engine, in_flight)

    return app


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, **app_kwargs) -> None:
    """Run the server until Ctrl-C (127.0.0.1 by default: reachable from this machine only)."""
    uvicorn.run(create_app(llm, **app_kwargs), host=host, port=port, log_level="info")


class BackgroundServer:
    """The app served by uvicorn in a daemon thread of this process (for notebooks, tests, load tests).

    port 0 asks the operating system for a free port; `url` is the address the server got.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0):
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server at {self.url} did not start within {timeout} s")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
