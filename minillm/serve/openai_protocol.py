# Generated from notebooks/18_server.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The OpenAI HTTP protocol of minillm's server: request checks, response shapes, error JSON.

Built in notebooks/18_server.ipynb. Every field of a request is checked here, by hand, so each
bad value gets OpenAI's error JSON naming its parameter (the table in notebook 18 lists the
fields and their ranges); the server (minillm/serve/server.py) runs what passes.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from minillm.runtime.llm import LLM
from minillm.text.constrained import validate_response_format
from minillm.runtime.engine import Output
from minillm.runtime.generate import validate_prompt
from minillm.runtime.sampling import SamplingParams
from minillm.text.reasoning import ReasoningStream, split_reasoning
from minillm.text.tool_calls import call_format, validate_tools, encode_with_tools, parse_tool_calls
from minillm.utils.validate import is_int, is_number, is_positive_int, json_problem, lone_surrogate, shown

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
               413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}
MAX_MESSAGE = 2000  # characters of an error message


class APIError(Exception):
    """An error answered as OpenAI error JSON with this HTTP status (and headers, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        if len(message) > MAX_MESSAGE:  # one that quotes a client's value never echoes 2 MB back
            message = f"{message[:MAX_MESSAGE]}... ({len(message):,} characters)"
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


def token_logprobs(tok, out: Output) -> dict:
    def entry(tid: int, logprob: float) -> dict:
        raw = tok.token_bytes(tid)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    top = [entry(t, lp) for t, lp in (out.top_logprobs or [])]
    return {**entry(out.token_id, out.logprob), "top_logprobs": top}


def sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


class Reply:
    """The OpenAI objects of one answer: a chat or a text completion, whole or as chunks."""

    def __init__(self, chat: bool, model_name: str, prompt_tokens: int, tools: list[dict] = (), one_call: bool = False,
                 thinking: bool | None = None):
        self.chat, self.prompt_tokens, self.index, self.tools, self.one_call = chat, prompt_tokens, 0, tools, one_call
        self.tail, self.calls, self.finish = b"", None, None  # last token bytes; tool_stream's state and finish
        self.thinking, self.reasoning = thinking, None  # LLM.thinking (None: no reasoning); its ReasoningStream
        self.head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                     "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": model_name}
        self.chunk_object = self.head["object"] + (".chunk" if chat else "")

    def usage(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def at(self, index: int) -> Reply:
        """The same answer seen from choice `index` (n > 1): its choices and chunks carry that index."""
        other = copy.copy(self)
        other.index = index
        return other

    def choice(self, text: str, finish, logprobs=None, delta: bool = False) -> dict:
        if not self.chat:
            return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}  # legacy_answer
        message = {"content": text} if delta else {"role": "assistant", "content": text, "refusal": None}
        if self.thinking is not None and not delta:  # a whole answer: its reasoning apart (notebook 10)
            reasoning, text = split_reasoning(text, self.thinking)
            message.update(content=text, reasoning=reasoning, reasoning_content=reasoning)  # vLLM's name, the old one
        if self.tools and finish is not None:  # the whole text: <tool_call> blocks become tool_calls
            finish = with_tool_calls(message, text, finish, delta, self.one_call, self.tools)
        lp = {"content": logprobs, "refusal": None} if logprobs is not None else None  # the spec requires refusal
        return {"index": self.index, "delta" if delta else "message": message, "logprobs": lp, "finish_reason": finish}

    def opening(self) -> str:
        """A chat stream's first chunk for this choice: the role, no text yet."""
        return self.chunk([{**self.choice("", None, delta=True), "delta": {"role": "assistant", "content": ""}}])

    def whole(self, choices: list[dict], n: int) -> dict:
        """The whole answer: its choices (from `at(i).choice`) and the usage of n generated tokens."""
        return {**self.head, "choices": choices, "usage": self.usage(n)}

    def chunk(self, choices: list, **extra) -> str:
        return sse({**self.head, "object": self.chunk_object, "choices": choices, **extra})


def best_choices(logprobs: list[list[dict]], n: int) -> list[int]:
    """best_of: the n generated choices of highest mean logprob per token (OpenAI's rule), best first;
    all of them in order when there are no more than n."""
    if len(logprobs) <= n:
        return list(range(len(logprobs)))
    mean = [sum(t["logprob"] for t in lp) / len(lp) if lp else float("-inf") for lp in logprobs]
    return sorted(range(len(logprobs)), key=lambda i: -mean[i])[:n]


def reasoning_events(reply: Reply, text: str, finished: bool) -> tuple[list[str], str]:
    """A stream's new text split (reply.thinking not None): the chunk of reasoning it released (sent as
    `reasoning` and `reasoning_content`), and the content left for the usual chunks."""
    if reply.thinking is None:
        return [], text
    reply.reasoning = reply.reasoning or ReasoningStream(reply.thinking)  # one per choice (Reply.at copies)
    reasoning, content = reply.reasoning.feed(text)
    if finished:
        more, rest = reply.reasoning.end()
        reasoning, content = reasoning + more, content + rest
    delta = {"reasoning": reasoning, "reasoning_content": reasoning}
    chunk = {"index": reply.index, "delta": delta, "logprobs": None, "finish_reason": None}
    return [reply.chunk([chunk])] if reasoning else [], content


def output_events(out: Output, reply: Reply, tokenizer, logprobs: bool) -> list[str]:
    """The SSE events one engine Output sends: a chunk with its text (and logprobs), then, on the
    request's last output, the finishing chunk. (An answer that offered tools: tool_stream.tool_events.)"""
    lp = [token_logprobs(tokenizer, out)] if logprobs and out.token_id is not None else None
    events, text = reasoning_events(reply, answer_text(reply, out, tokenizer), out.finished)
    if text or lp:
        events.append(reply.chunk([reply.choice(text, None, lp, delta=True)]))
    if out.finished:
        last = reply.choice("", out.finish_reason, None, delta=True)
        if reply.chat:
            last["delta"] = {}
        events.append(reply.chunk([last]))
    return events


SAMPLING_FIELDS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias")


MAX_DEPTH = 64  # levels of nesting in a body: far below Python's recursion limit, far above any real schema


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object: 415 unless sent as application/json, 413 past `limit` bytes (counted
    while reading), 400 if not JSON (parse_json)."""
    body, size = bytearray(), 0
    async for chunk in request.stream():  # read to the end (the client can then read our answer), keep <= limit
        size += len(chunk)
        if size <= limit:
            body += chunk
    kind = request.headers.get("content-type")
    media, _, charset = (kind or "").lower().partition(";")
    if media.strip() != "application/json" or charset.replace(" ", "").replace('"', "") not in ("", "charset=utf-8"):
        raise APIError(415, f"the body must be JSON sent with Content-Type: application/json, got Content-Type "
                       f"{shown(kind)}", None, "unsupported_media_type")
    if size > limit:
        raise APIError(413, f"the request body has {size} bytes; the limit is {limit}")
    return await asyncio.to_thread(parse_json, bytes(body))  # a big body's walk: not on the event loop


def parse_json(body: bytes) -> dict:
    """A body as a JSON object in which every string is valid Unicode and nothing is nested deeper than
    MAX_DEPTH; 400 otherwise, naming the path of the value at fault."""
    try:
        data = json.loads(body)
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more than 4,300 digits
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise APIError(400, "the body's JSON is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    problem = json_problem(data, MAX_DEPTH)
    if problem is not None:
        raise APIError(400, " ".join(problem), problem[0])
    return data


ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(value, what: str, param: str) -> str:
    """A string the tokenizer can encode: 400 for anything else, or a lone UTF-16 surrogate."""
    if not isinstance(value, str):
        raise APIError(400, f"{what} must be a string, got {type(value).__name__}", param)
    if lone_surrogate(value) is not None:
        raise APIError(400, f"{what} holds a lone surrogate (not valid Unicode text)", param)
    return value


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's tool_calls, as a client sends them back: [] for none; 400 naming the message."""
    if calls is None:
        return []
    try:
        ok = isinstance(calls, list) and all(isinstance(c["function"]["name"], str) and
                                             isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
    except (TypeError, KeyError, ValueError, RecursionError):  # arguments '[[[...' parse by recursion
        ok = False
    if not ok:
        raise APIError(400, f"messages[{i}].tool_calls must be a list of {{'id', 'type': 'function', 'function': "
                       "{'name', 'arguments': a JSON object as a string}}", "messages")
    return [{"id": c.get("id"), "type": "function", "function": dict(c["function"])} for c in calls]


def offered_tools(body: dict, chat: bool) -> tuple[list[dict], str | dict]:
    """The request's tools and tool_choice, checked (minillm/text/tool_calls.py); 400 naming the field."""
    sent = [field for field in ("tools", "tool_choice") if body.get(field) is not None]
    if sent and not chat:
        raise APIError(400, f"{sent[0]} is supported on /v1/chat/completions only", sent[0])
    try:
        return validate_tools(body.get("tools"), body.get("tool_choice"))
    except ValueError as exc:  # its message starts with the path of the value at fault: tools[2].function.name
        raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None


def with_tool_calls(message: dict, text: str, finish: str, delta: bool, one_call: bool = False,
                    tools: list[dict] = ()) -> str:
    """Split an answer's whole text into the message's content and tool_calls (a delta's carry their
    index; one_call, parallel_tool_calls false: the first only; tools: the offered, whose schemas read
    Qwen3.5's XML values); "tool_calls" is the finish when any."""
    message["content"], calls = parse_tool_calls(text, tools)
    calls = calls[:1] if one_call else calls
    if not calls:
        return finish
    message["tool_calls"] = [{**c, "index": k} for k, c in enumerate(calls)] if delta else calls
    return "tool_calls"


def chat_prompt(llm: LLM, messages, tools: list[dict] = (), template_kwargs: dict | None = None) -> list[int]:
    """Token ids of chat messages (and the tools offered) through the model's chat template, given its
    variables (checked); 400 naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}] must be an object with a role in {', '.join(ROLES)}", "messages")
        content = m.get("content")
        calls = _tool_calls(m.get("tool_calls"), i) if m["role"] == "assistant" else []
        content = "" if content is None and calls else content
        if isinstance(content, list):  # content parts: text only; an image, audio or file part is refused
            kinds = [p.get("type") if isinstance(p, dict) else p for p in content]
            if any(kind != "text" for kind in kinds):
                j = next(j for j, kind in enumerate(kinds) if kind != "text")
                raise APIError(400, f"messages[{i}].content[{j}] is a part of type {shown(kinds[j])}: this server "
                               "reads text parts only (no image, audio or file input)", "messages")
            content = "".join(_text(p.get("text"), f"messages[{i}].content[].text", "messages") for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        clean.append({"role": m["role"], "content": _text(content, f"messages[{i}].content", "messages"),
                      **({"tool_calls": calls} if calls else {})})
    try:
        return encode_with_tools(llm.tokenizer, clean, list(tools), **(template_kwargs or {}))
    except Exception as exc:  # the template may reject a conversation (e.g. roles out of order), or the tools
        field = "tools" if tools and _renders(llm, clean) else "messages"
        raise APIError(400, f"the chat template failed on these {field}: {exc}", field) from None


def _renders(llm: LLM, messages: list[dict]) -> bool:
    """Whether the chat template takes these messages without tools: which of the two it refused."""
    try:
        encode_with_tools(llm.tokenizer, messages, [])
    except Exception:
        return False
    return True


def _flag(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{param or name} must be true or false, got {shown(value)}", param or name)
    return value


MAX_CHOICES = 16  # n and best_of: at most this many choices in one request


def _choices(body: dict, chat: bool, stream: bool) -> tuple[int, int]:
    """(n, best_of): 1 <= n <= best_of <= MAX_CHOICES; best_of on /v1/completions only, not streamed."""
    n = body.get("n") if body.get("n") is not None else 1
    if not is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n must be an integer in [1, {MAX_CHOICES}], got {shown(n)}", "n")
    best_of = body.get("best_of")
    if best_of is None:
        return n, n
    if chat:
        raise APIError(400, "best_of is supported on /v1/completions only", "best_of")
    if not is_int(best_of) or not n <= best_of <= MAX_CHOICES:
        raise APIError(400, f"best_of must be an integer in [n, {MAX_CHOICES}] = [{n}, {MAX_CHOICES}], "
                       f"got {shown(best_of)}", "best_of")
    if stream and best_of > n:
        raise APIError(400, "best_of > n cannot be streamed: the best choices are known only at the end", "best_of")
    return n, best_of


def requested_model(body: dict, model_name: str, adapters: list[str]) -> tuple[str, str | None]:
    """(model id, LoRA adapter or None): the served model, or "<served model>:<adapter>" (notebook 20)."""
    model = model_name if body.get("model") is None else body["model"]
    if not isinstance(model, str):
        raise APIError(400, f"model must be a string, an id that GET /v1/models lists, got {shown(model)}", "model")
    adapter = model[len(model_name) + 1:] if model.startswith(model_name + ":") else None
    if model != model_name and adapter not in adapters:
        served = ", ".join(repr(m) for m in [model_name] + [f"{model_name}:{a}" for a in adapters])
        raise APIError(404, f"the model {shown(model)} does not exist; this server has {served}", "model",
                       "model_not_found")
    return model, adapter


@dataclass(frozen=True)
class ParsedRequest:
    """A request that passed every check: what the engine runs, and how the answer is shaped."""

    params: SamplingParams
    max_new_tokens: int
    stop: list[str]
    stream: bool
    n: int  # choices returned
    best_of: int  # choices sampled; the n with the highest mean log-probability are returned
    include_usage: bool  # a last streamed chunk carries the token counts
    logprobs: bool
    tools: list  # the tools offered, if they may be called (else []): the answer is parsed for calls
    model: str  # the name the answer reports (the base model's, or an adapter's)
    options: dict  # Engine.make_request's keywords: response_format, adapter, eos_token_ids
    one_call: bool = False  # parallel_tool_calls false: at most one tool call in the answer
    echo: bool = False  # /v1/completions: the prompt leads the answer (fields.parse_completion)
    silent: bool = False  # max_tokens 0 with echo: the one token generated is dropped


def parse_request(body: dict, prompt_ids: list[int], context: int, vocab_size: int, model_name: str,
                  chat: bool = True, constraints=None, adapters: list[str] = (), style: str = "json") -> ParsedRequest:
    """Check the request against the context, OpenAI's ranges and SamplingParams; the engine's
    arguments and the options (style: how the template's model writes a tool call, notebook 14's
    call_style). The table in notebook 18 lists every field and its range."""
    model, adapter = requested_model(body, model_name, list(adapters))
    stream = _flag(body, "stream")
    n, best_of = _choices(body, chat, stream)
    try:  # the prompt rule of every entry point (generate.validate_prompt); max_tokens is checked below
        validate_prompt(prompt_ids, 1, context, vocab_size)
    except ValueError as exc:
        code = "context_length_exceeded" if len(prompt_ids) >= context else None
        raise APIError(400, str(exc), "messages" if chat else "prompt", code) from None
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(param)
    if max_tokens is None:
        max_tokens = context - len(prompt_ids)
    if not is_positive_int(max_tokens):
        raise APIError(400, f"{param} must be an integer >= 1, got {shown(max_tokens)}", param)
    if len(prompt_ids) + max_tokens > context:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens and {param} is {max_tokens}: "
                       f"{len(prompt_ids) + max_tokens} tokens, but the context holds {context}",
                       param, "context_length_exceeded")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop must be a string or a list of strings", "stop")
    if not chat and body.get("logprobs") is not None:
        raise APIError(400, "logprobs is supported on /v1/chat/completions only", "logprobs")
    want_logprobs = _flag(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not want_logprobs:  # as OpenAI: the alternatives come only with the tokens' own
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    top = top or 0
    if not is_int(top) or not 0 <= top <= 20:
        raise APIError(400, f"top_logprobs must be an integer in [0, 20], got {shown(top)}", "top_logprobs")
    knobs = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    t = knobs.get("temperature", 1.0)
    if is_number(t) and not 0 <= t <= 2:  # the rest: SamplingParams
        raise APIError(400, f"temperature must be in [0, 2], got {shown(t)}", "temperature")
    try:
        params = SamplingParams(**knobs, logprobs=top if want_logprobs else None)
    except (ValueError, TypeError) as exc:
        field = re.split(r"[ \[]", str(exc), maxsplit=1)[0]  # "top_p must...", "logit_bias[5] must..."
        raise APIError(400, str(exc), field if field in SAMPLING_FIELDS else None) from None
    if params.seed is not None and params.seed + best_of > 2**64:  # choice i samples with seed + i
        raise APIError(400, f"seed + best_of - 1 must be below 2**64 (choice i samples with seed + i), got seed "
                       f"{params.seed} and {best_of} choices", "seed")
    fmt, (tools, choice) = named_schema(body.get("response_format")), offered_tools(body, chat)
    forced = call_format(tools, choice, style)  # a call is required: the grammar writes its frame
    if forced is not None:
        if fmt is not None:
            raise APIError(400, "response_format cannot be combined with a required tool_choice", "response_format")
        fmt = forced
    try:  # a bad format or schema is this request's 400 before any answer starts; compiled once, then kept
        validate_response_format(fmt) if constraints is None else constraints.for_format(fmt)
    except ValueError as exc:  # a forced call's format comes from tools, not from a response_format
        field = "response_format" if forced is None else "tools"
        message = str(exc) if str(exc).startswith(field) else f"{field}: {exc}"
        raise APIError(400, message, field) from None
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    usage = _flag(options, "include_usage", "stream_options.include_usage")
    one_call = body.get("parallel_tool_calls") is not None and not _flag(body, "parallel_tool_calls")
    return ParsedRequest(params, max_tokens, stop, stream, n, best_of, usage, want_logprobs,
                         tools=tools if choice != "none" else [], model=model,
                         options={"response_format": fmt, "adapter": adapter,
                                  **({"eos_token_ids": ()} if _flag(body, "ignore_eos") else {})}, one_call=one_call)


def named_schema(fmt):
    """response_format as OpenAI reads it: a json_schema needs its `name` (1 to 64 of a-z, A-Z, 0-9, _
    and -); its `schema` is optional, and none means any JSON object (the json_object format)."""
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict)):
        return fmt  # validate_response_format names what is wrong
    name = fmt["json_schema"].get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise APIError(400, "response_format.json_schema.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, "
                       f"got {shown(name)}", "response_format.json_schema.name")
    return fmt if fmt["json_schema"].get("schema") is not None else {"type": "json_object"}


def cut_char(tail: bytes) -> bool:
    """Whether bytes end inside a UTF-8 character: a lead byte whose continuation bytes have not all come."""
    for back in range(1, min(4, len(tail)) + 1):
        byte = tail[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: ASCII or a lead byte
            need = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
            return need > back
    return False


def answer_text(reply: Reply, out: Output, tokenizer) -> str:
    """out.text, less the U+FFFD the decoder's flush makes of a character the end of the answer cut in
    two: its bytes were held back while it streamed (as the decoder does), and are dropped."""
    if out.token_id is not None and out.token_id not in tokenizer.special_ids:
        reply.tail = (reply.tail + tokenizer.token_bytes(out.token_id))[-4:]
    cut = out.finished and out.text.endswith("\ufffd") and cut_char(reply.tail)
    return out.text[:-1] if cut else out.text
