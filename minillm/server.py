# Generated from notebooks/14_server.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""An OpenAI-compatible HTTP server over the continuous-batching engine.

Built in notebooks/14_server.ipynb. One background thread owns the Engine (notebook 12) and steps
it while any request is unfinished; each request gets an asyncio.Queue of its Outputs, handed over
with loop.call_soon_threadsafe, so concurrent requests share forward passes. A client that hangs
up mid-stream aborts its request, which frees its KV blocks.

Endpoints: POST /v1/chat/completions, POST /v1/completions (stream: server-sent events ending in
`data: [DONE]`), GET /v1/models, GET /health. Errors: {"error": {"message", "type", "param", "code"}}.

References: the OpenAI API reference (chat completions, completions, streaming, error codes);
vLLM's entrypoints/openai/api_server.py (the queue-per-request bridge over one engine loop).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.api import LLM
from minillm.engine import Engine, Output
from minillm.generate import check_prompt
from minillm.sampling import SamplingParams

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error"}


class APIError(Exception):
    """An error answered as OpenAI error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


class AsyncEngine:
    """One Engine stepped by one thread; each request receives its Outputs on an asyncio.Queue."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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

    def add(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
            stop: list[str]) -> tuple[int, asyncio.Queue]:
        """Queue a request (call from the event loop); returns its id and the queue its Outputs arrive on."""
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            rid = self.engine.add_request(prompt_ids, params, max_new_tokens, stop)
            self.queues[rid] = (asyncio.get_running_loop(), queue)
        self.wake.set()  # after the lock: the loop cannot miss it
        return rid, queue

    def abort(self, rid: int) -> None:
        """The client left: stop the request now and free its blocks."""
        with self.lock:
            self.queues.pop(rid, None)
            self.engine.abort(rid)

    def _loop(self) -> None:
        while self.running:
            self.wake.wait()
            with self.lock:
                if not self.engine.has_unfinished():
                    self.wake.clear()  # under the lock: an add() after this sets it again
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a bug or a device error: fail every request, keep serving
                    outputs = [Output(rid, None, "", True, "error", f"engine error: {exc}") for rid in self.queues]
                    for rid in self.queues:
                        self.engine.abort(rid)
                self.steps += 1
                posts = [(self.queues.get(out.request_id), out) for out in outputs]
                for out in outputs:
                    if out.finished:
                        self.queues.pop(out.request_id, None)
            for target, out in posts:
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, out)


SAMPLING_FIELDS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (counted while reading), 400 if not JSON."""
    body, size = bytearray(), 0
    async for chunk in request.stream():  # read to the end (the client can then read our answer), keep <= limit
        size += len(chunk)
        if size <= limit:
            body += chunk
    if size > limit:
        raise APIError(413, f"the request body has {size} bytes; the limit is {limit}")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    return data


def chat_prompt(llm: LLM, messages) -> list[int]:
    """Token ids of chat messages through the model's chat template; 400 naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        clean.append({"role": m["role"], "content": content})
    try:
        return llm.encode_chat(clean)
    except Exception as exc:  # the template may reject a conversation (e.g. roles out of order)
        raise APIError(400, f"the chat template failed on these messages: {exc}", "messages") from None


def parse_request(body: dict, prompt_ids: list[int], context: int, vocab_size: int, model_name: str) -> dict:
    """Check the request against the context and SamplingParams; the engine's arguments and the options."""
    if body.get("model", model_name) != model_name:
        raise APIError(404, f"the model {body.get('model')!r} does not exist; this server has {model_name!r}",
                       "model", "model_not_found")
    if body.get("n", 1) not in (1, None):
        raise APIError(400, f"n must be 1 (one choice per request), got {body.get('n')!r}", "n")
    try:  # the prompt rule of every entry point (generate.check_prompt); max_tokens is checked below
        check_prompt(prompt_ids, 1, context, vocab_size)
    except ValueError as exc:
        code = "context_length_exceeded" if len(prompt_ids) >= context else None
        raise APIError(400, str(exc), "messages", code) from None
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(param)
    if max_tokens is None:
        max_tokens = context - len(prompt_ids)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise APIError(400, f"{param} must be an integer >= 1, got {max_tokens!r}", param)
    if len(prompt_ids) + max_tokens > context:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens and {param} is {max_tokens}: "
                       f"{len(prompt_ids) + max_tokens} tokens, but the context holds {context}",
                       param, "context_length_exceeded")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop must be a string or a list of strings", "stop")
    want_logprobs = bool(body.get("logprobs"))
    top = body.get("top_logprobs") or 0
    if not isinstance(top, int) or not 0 <= top <= 20:
        raise APIError(400, f"top_logprobs must be an integer in [0, 20], got {top!r}", "top_logprobs")
    knobs = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    try:
        params = SamplingParams(**knobs, logprobs=top if want_logprobs else None)
    except (ValueError, TypeError) as exc:
        field = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), field if field in SAMPLING_FIELDS else None) from None
    options = body.get("stream_options") or {}
    return {"params": params, "max_new_tokens": max_tokens, "stop": stop, "stream": bool(body.get("stream")),
            "include_usage": bool(isinstance(options, dict) and options.get("include_usage")),
            "logprobs": want_logprobs}


def _token_logprobs(tok, out: Output) -> dict:
    def entry(tid: int, logprob: float) -> dict:
        raw = tok.token_bytes(tid)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    top = [entry(t, lp) for t, lp in (out.top_logprobs or [])]
    return {**entry(out.token_id, out.logprob), "top_logprobs": top}


def _sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


class Reply:
    """The OpenAI objects of one answer: a chat or a text completion, whole or as chunks."""

    def __init__(self, chat: bool, model_name: str, prompt_tokens: int):
        self.chat, self.prompt_tokens = chat, prompt_tokens
        self.head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                     "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": model_name}
        self.chunk_object = self.head["object"] + (".chunk" if chat else "")

    def usage(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def choice(self, text: str, finish, logprobs=None, delta: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        message = {"content": text} if delta else {"role": "assistant", "content": text}
        lp = {"content": logprobs} if logprobs is not None else None
        return {"index": 0, "delta" if delta else "message": message, "logprobs": lp, "finish_reason": finish}

    def whole(self, text: str, finish: str, logprobs, n: int) -> dict:
        return {**self.head, "choices": [self.choice(text, finish, logprobs)], "usage": self.usage(n)}

    def chunk(self, choices: list, **extra) -> str:
        return _sse({**self.head, "object": self.chunk_object, "choices": choices, **extra})


class InFlight:
    """Requests between engine.add and their end; past `limit`, a new one is refused (429)."""

    def __init__(self, limit: int):
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {limit!r}")
        self.limit, self.count = limit, 0

    def check(self) -> None:
        if self.count >= self.limit:
            raise APIError(429, f"{self.limit} requests are in flight; retry later", None, "too_many_requests")


async def _next_output(queue: asyncio.Queue) -> Output:
    out = await queue.get()
    if out.finish_reason == "error":
        raise APIError(500, out.error or "the engine failed this request", None, "engine_error")
    return out


async def collect_answer(engine: AsyncEngine, tokenizer, ids: list[int], req: dict, reply: Reply,
                         in_flight: InFlight) -> dict:
    """The whole answer as one JSON object; a cancelled request (the client left) is aborted."""
    in_flight.count += 1
    rid, queue = engine.add(ids, req["params"], req["max_new_tokens"], req["stop"])
    texts, lps, out = [], [], None
    try:
        while out is None or not out.finished:
            out = await _next_output(queue)
            texts.append(out.text)
            if out.token_id is not None:
                lps.append(_token_logprobs(tokenizer, out))
    finally:  # cancelled before the end: abort frees its blocks
        in_flight.count -= 1
        if out is None or not out.finished:
            engine.abort(rid)
    return reply.whole("".join(texts), out.finish_reason, lps if req["logprobs"] else None, len(lps))


async def stream_answer(engine: AsyncEngine, tokenizer, ids: list[int], req: dict, reply: Reply,
                        in_flight: InFlight):
    """SSE events: a chunk per piece of text, the finish, optionally usage, then [DONE].

    The request starts with the stream: a client gone before it never reaches the engine."""
    in_flight.count += 1
    rid, queue = engine.add(ids, req["params"], req["max_new_tokens"], req["stop"])
    out = None
    try:
        if reply.chat:
            yield reply.chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
        n = 0
        while out is None or not out.finished:
            out = await _next_output(queue)
            n += out.token_id is not None
            lp = [_token_logprobs(tokenizer, out)] if req["logprobs"] and out.token_id is not None else None
            if out.text or lp:
                yield reply.chunk([reply.choice(out.text, None, lp, delta=True)])
            if out.finished:
                last = reply.choice("", out.finish_reason, None, delta=True)
                if reply.chat:
                    last["delta"] = {}
                yield reply.chunk([last])
        if req["include_usage"]:
            yield reply.chunk([], usage=reply.usage(n))
        yield _sse("[DONE]")
    except APIError as exc:  # the engine failed it mid-stream: an error event, then the end
        out = None
        yield _sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code}})
        yield _sse("[DONE]")
    finally:  # the client hung up (cancelled or closed at a yield): abort frees its blocks
        in_flight.count -= 1
        if out is None or not out.finished:
            engine.abort(rid)


def read_prompt(llm: LLM, body: dict, chat: bool) -> list[int]:
    """The prompt ids: the chat template over `messages`, or the text of `prompt`."""
    if chat:
        return chat_prompt(llm, body.get("messages"))
    prompt = body.get("prompt")
    prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "prompt must be a non-empty string", "prompt")
    return llm.tokenizer.encode(prompt)


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

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):  # unknown paths, wrong methods
        return APIError(exc.status_code, str(exc.detail)).response()

    async def complete(request: Request, chat: bool):
        in_flight.check()
        body = await read_json(request, max_body_bytes)
        ids = read_prompt(llm, body, chat)
        req = parse_request(body, ids, context, llm.model.config.vocab_size, model_name)
        reply = Reply(chat, model_name, len(ids))
        if req["stream"]:
            return StreamingResponse(stream_answer(engine, llm.tokenizer, ids, req, reply, in_flight),
                                     media_type="text/event-stream")
        return await collect_answer(engine, llm.tokenizer, ids, req, reply, in_flight)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "minillm", "max_model_len": context}]}

    @app.get("/health")
    async def health():
        sched = engine.engine.scheduler
        return {"status": "ok", "running": len(sched.running), "waiting": len(sched.waiting),
                "free_blocks": engine.engine.manager.num_free_blocks, "in_flight": in_flight.count}

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
