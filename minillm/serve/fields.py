# Generated from notebooks/18_server.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Every request field of OpenAI's spec and what minillm's server does with it; the small endpoints.

Built in notebooks/18_server.ipynb (its Plumbing section). A field the server does not do is refused with a
400 naming it, never silently ignored; an unknown field gets OpenAI's "Unrecognized request argument" 400
(with `lenient`, a log line). Also: GET /v1/models/{id}, vLLM's POST /tokenize, /detokenize and GET
/tokenizer_info, and /v1/completions' own fields (logprobs as a count, echo, max_tokens 0 with echo).
Spec: github.com/openai/openai-openapi (the schemas are in data/openai-openapi/).
"""

from __future__ import annotations

import logging
import itertools
from collections.abc import Callable
from dataclasses import replace

from fastapi import FastAPI, Request

from minillm.runtime.llm import LLM
from minillm.runtime.sampling import validate_logit_bias
from minillm.serve.openai_protocol import (APIError, ParsedRequest, _flag, _text, chat_prompt, offered_tools,
                                           parse_request, read_json)
from minillm.serve.ops import Gate
from minillm.text.chat_template import validate_template_kwargs
from minillm.utils.validate import is_int, shown

LOG = logging.getLogger("minillm.serve")

SUPPORTED = "supported"
NO_EFFECT = "accepted, no effect: there is nothing for a local server to do with it"
SHARED = {  # the fields of both endpoints that the server reads (notebook 18's table gives their ranges)
    "model": SUPPORTED, "max_tokens": SUPPORTED, "temperature": SUPPORTED, "top_p": SUPPORTED, "n": SUPPORTED,
    "seed": SUPPORTED, "stop": SUPPORTED, "stream": SUPPORTED, "stream_options": SUPPORTED,
    "presence_penalty": SUPPORTED, "frequency_penalty": SUPPORTED, "user": NO_EFFECT,
    "logit_bias": "supported: {\"token id\": bias in [-100, 100]}; a bad key, bias or id is a 400",
    "ignore_eos": "supported (an extension, as vLLM's): the end-of-turn token does not end the answer",
    "max_completion_tokens": SUPPORTED, "response_format": SUPPORTED,
}
CHAT_FIELDS = {**SHARED, "messages": "supported: text content only; image, audio and file parts are refused",
               "logprobs": SUPPORTED, "top_logprobs": "supported, with logprobs: true (400 without it, as OpenAI)",
               "tools": SUPPORTED, "tool_choice": SUPPORTED,
               "parallel_tool_calls": "supported: false keeps at most one tool call in the answer",
               "best_of": "refused on chat (/v1/completions only)",
               "safety_identifier": NO_EFFECT, "metadata": NO_EFFECT, "prompt_cache_key": NO_EFFECT,
               "prompt_cache_retention": NO_EFFECT,
               "store": "false or null only: no answer is stored", "service_tier": "auto or default only: one tier",
               "modalities": '["text"] only: no audio output', "audio": "refused: no audio output",
               "functions": "refused: deprecated, send tools", "function_call": "refused: deprecated, send tool_choice",
               "prediction": "refused: no predicted outputs",
               "reasoning_effort": "supported: the chat template's reasoning_effort variable (Qwen3.8 reads it; others ignore it)",
               "chat_template_kwargs": "supported (an extension, as vLLM's): the template's variables, over the server's defaults",
               "verbosity": "refused: no verbosity control", "web_search_options": "refused: no web search",
               "moderation": "refused: no moderation", "prompt_cache_options": "refused: the prefix cache has no options"}
TEXT_FIELDS = {**SHARED, "prompt": "supported: a string, or a list of token ids (one prompt)",
               "best_of": SUPPORTED, "echo": "supported, not streamed; max_tokens 0 with it scores the prompt only",
               "suffix": "refused unless empty",
               "logprobs": "supported: alternatives per token, 0 to 5 (OpenAI's legacy object); not streamed",
               "tools": "refused on /v1/completions", "tool_choice": "refused on /v1/completions"}
TOKENIZE_FIELDS = {"model": SUPPORTED, "prompt": SUPPORTED, "messages": SUPPORTED, "tools": SUPPORTED,
                   "chat_template_kwargs": "supported: as on /v1/chat/completions, over the server's defaults",
                   "add_special_tokens": SUPPORTED, "add_generation_prompt": "true only (the default)",
                   "continue_final_message": "false only (the default)", "return_token_strs": SUPPORTED}
DETOKENIZE_FIELDS = {"model": SUPPORTED, "tokens": SUPPORTED}

REFUSED_WHEN: dict[str, Callable] = {  # field: which values are refused (null never is)
    "suffix": lambda v: v != "",
    "store": lambda v: v is not False, "service_tier": lambda v: v not in ("auto", "default"),
    "modalities": lambda v: v != ["text"],
    **{name: lambda v: True for name in ("audio", "functions", "function_call", "prediction", "verbosity",
                                         "web_search_options", "moderation", "prompt_cache_options")}}


def check_fields(body: dict, table: dict[str, str], lenient: bool = False) -> None:
    """400 naming the first field of `body` that `table` does not know (OpenAI's answer; with `lenient`,
    logged and left alone), or whose value asks for what the server does not do (REFUSED_WHEN)."""
    for name, value in body.items():
        if name not in table:
            if not lenient:
                raise APIError(400, f"Unrecognized request argument supplied: {shown(name)}", name,
                               "unknown_parameter")
            LOG.warning("ignored a request field the server does not know: %s", shown(name))
        elif value is not None and name in REFUSED_WHEN and REFUSED_WHEN[name](value):
            raise APIError(400, f"{name} = {shown(value)} is not supported by this server ({table[name]})", name,
                           "unsupported_parameter")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's values


def read_prompt(llm: LLM, body: dict, chat: bool, template_defaults: dict | None = None) -> list[int]:
    """The prompt ids: the chat template over `messages` (its variables: the server's defaults, then the
    request's chat_template_kwargs), or the text (or token ids) of `prompt`."""
    if chat:
        tools, choice = offered_tools(body, chat)
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise APIError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {shown(effort)}",
                           "reasoning_effort")
        try:
            variables = {**(template_defaults or {}), **({"reasoning_effort": effort} if effort is not None else {}),
                         **validate_template_kwargs(body.get("chat_template_kwargs"))}
        except ValueError as exc:
            raise APIError(400, str(exc), "chat_template_kwargs") from None
        return chat_prompt(llm, body.get("messages"), tools if choice != "none" else [], variables)
    prompt = body.get("prompt")
    prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)) else prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return prompt  # token ids, as OpenAI's API allows: parse_request checks them against the vocabulary
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "prompt must be a non-empty string or a list of token ids", "prompt")
    return llm.tokenizer.encode(_text(prompt, "prompt", "prompt"))


def model_entry(models: dict, model_id) -> dict:
    """The body of GET /v1/models/{id}: that entry of the model list, or 404 naming the id."""
    if not isinstance(model_id, str):
        raise APIError(400, f"model must be a string, an id that GET /v1/models lists, got {shown(model_id)}", "model")
    for entry in models["data"]:
        if entry["id"] == model_id:
            return entry
    served = ", ".join(repr(m["id"]) for m in models["data"])
    raise APIError(404, f"the model {shown(model_id)} does not exist; this server has {served}", "model",
                   "model_not_found")


def _bool(body: dict, name: str, default: bool) -> bool:
    return _flag({name: default if body.get(name) is None else body[name]}, name)


def tokenize(llm: LLM, body: dict, context: int, models: dict, template_defaults: dict | None = None) -> dict:
    """vLLM's POST /tokenize: the ids of a `prompt`, or of chat `messages` as /v1/chat/completions
    builds its prompt (read_prompt: tools, chat_template_kwargs); with return_token_strs, each token's text."""
    if body.get("model") is not None:
        model_entry(models, body["model"])
    chat = body.get("messages") is not None
    if chat == (body.get("prompt") is not None):
        raise APIError(400, "send either prompt (a string) or messages (a chat), not both and not neither", "prompt")
    if chat:
        for name, allowed in (("add_generation_prompt", True), ("continue_final_message", False),
                              ("add_special_tokens", False)):
            if _bool(body, name, allowed) != allowed:
                raise APIError(400, f"{name}: {str(not allowed).lower()} is not supported with messages", name)
        ids = read_prompt(llm, body, True, template_defaults)
    else:
        special = _bool(body, "add_special_tokens", True)
        ids = llm.tokenizer.encode(_text(body["prompt"], "prompt", "prompt"), add_special_tokens=special)
    strs = [llm.tokenizer.token_bytes(i).decode("utf-8", errors="replace") for i in ids]
    return {"count": len(ids), "max_model_len": context, "tokens": ids,
            "token_strs": strs if _bool(body, "return_token_strs", False) else None}


def detokenize(llm: LLM, body: dict, models: dict) -> dict:
    """vLLM's POST /detokenize: the text of token ids, as the tokenizer decodes them."""
    if body.get("model") is not None:
        model_entry(models, body["model"])
    ids, vocab = body.get("tokens"), llm.model.config.vocab_size
    if not isinstance(ids, list) or not all(is_int(i) and 0 <= i < vocab for i in ids):
        raise APIError(400, f"tokens must be a list of token ids in [0, {vocab}), got {shown(ids)}", "tokens")
    return {"prompt": llm.tokenizer.decode(ids)}


def tokenizer_info(llm: LLM, context: int) -> dict:
    """vLLM's GET /tokenizer_info: the tokenizer's special tokens, chat template and context (what
    lm-eval's `remote` tokenizer reads, with /tokenize and /detokenize)."""
    tok = llm.tokenizer
    return {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "pad_token": None, "chat_template": tok.chat_template, "model_max_length": context}


def add_routes(app: FastAPI, llm: LLM, gate: Gate, context: int, max_body_bytes: int, models: Callable[[], dict],
               lenient: bool = False, template_defaults: dict | None = None) -> None:
    """GET /v1/models, /v1/models/{id} and /tokenizer_info, POST /tokenize and /detokenize (a key is
    needed; no per-key limit counts them); template_defaults: the server's chat_template_kwargs."""

    async def answer(request: Request, work: Callable[[dict], dict], table: dict | None = None) -> dict:
        record = gate.admit(request, limited=False)
        try:
            body = await read_json(request, max_body_bytes) if table is not None else {}
            check_fields(body, table or {}, lenient)
            result = work(body)
        except APIError as exc:
            record.end(exc.status)
            raise
        record.end(200)
        return result

    @app.get("/v1/models")
    async def model_list(request: Request):
        return await answer(request, lambda _: models())

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str, request: Request):
        return await answer(request, lambda _: model_entry(models(), model_id))

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await answer(request, lambda body: tokenize(llm, body, context, models(), template_defaults),
                            TOKENIZE_FIELDS)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await answer(request, lambda body: detokenize(llm, body, models()), DETOKENIZE_FIELDS)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route(request: Request):
        return await answer(request, lambda _: tokenizer_info(llm, context))


def bias_ids(bias):
    """logit_bias as JSON sends it, {"504": -100}: its keys as token ids (SamplingParams checks the rest)."""
    if not isinstance(bias, dict):
        return bias  # null, or a value SamplingParams names as wrong
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError:
        raise APIError(400, f"logit_bias keys must be token ids written as strings (\"504\"), got {shown(list(bias))}",
                       "logit_bias") from None


def parse_completion(body: dict, ids: list[int], context: int, vocab_size: int, model_name: str, chat: bool = True,
                     constraints=None, adapters: list[str] = (), style: str = "json") -> ParsedRequest:
    """parse_request, with logit_bias's keys as ids checked against the vocabulary, and /v1/completions' own
    `logprobs` (alternatives per token, 0 to 5), `echo` and max_tokens 0 with echo (neither streamed)."""
    body, echo, top, silent = {**body, "logit_bias": bias_ids(body.get("logit_bias"))}, False, None, False
    if not chat:
        echo, top = _flag(body, "echo"), body.pop("logprobs", None)
        if top is not None and not (is_int(top) and 0 <= top <= 5):
            raise APIError(400, f"logprobs must be an integer in [0, 5] on /v1/completions, got {shown(top)}",
                           "logprobs")
        if _flag(body, "stream") and (echo or top is not None):
            field = "echo" if echo else "logprobs"
            raise APIError(400, f"{field} is not streamed on /v1/completions: ask for the whole answer", field)
        param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        silent = echo and is_int(body.get(param)) and body[param] == 0
        body[param] = 1 if silent else body.get(param)
    req = parse_request(body, ids, context, vocab_size, model_name, chat, constraints, adapters, style)
    try:
        validate_logit_bias(req.params, vocab_size)
    except ValueError as exc:
        raise APIError(400, str(exc), "logit_bias") from None
    if chat or (top is None and not echo):
        return req
    return replace(req, params=replace(req.params, logprobs=top), logprobs=top is not None, echo=echo, silent=silent,
                   options={**req.options, "prompt_logprobs": top if echo and top is not None else None})


def _token(tokenizer, tid: int) -> str:
    return tokenizer.token_bytes(tid).decode("utf-8", errors="replace")


def prompt_entries(tokenizer, scores) -> list[dict]:
    """The prompt's tokens and scores (PromptLogprobs) in token_logprobs' shape; the first has none: null."""
    tops = scores.top_logprobs or [None] * len(scores.token_ids)
    return [{"token": _token(tokenizer, t), "logprob": lp,
             "top_logprobs": None if top is None else [{"token": _token(tokenizer, i), "logprob": v} for i, v in top]}
            for t, lp, top in zip(scores.token_ids, scores.logprobs, tops)]


def legacy_logprobs(entries: list[dict]) -> dict:
    """token_logprobs' entries in /v1/completions' legacy shape: tokens, logprobs, {token: logprob}
    alternatives, text offsets."""
    starts = list(itertools.accumulate((len(e["token"]) for e in entries[:-1]), initial=0)) if entries else []
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries], "text_offset": starts}


def legacy_answer(answer: dict, req: ParsedRequest, scores, ids: list[int], tokenizer) -> dict:
    """A /v1/completions answer in OpenAI's legacy shape (a chat one passes as it is): with echo, the
    prompt's text and scores (from choice 0's prefill) lead each choice's; max_tokens 0 drops the token."""
    if answer["object"] != "text_completion":
        return answer
    head = tokenizer.decode(ids) if req.echo else ""
    lead = prompt_entries(tokenizer, scores) if req.echo and scores is not None else []
    for choice in answer["choices"]:
        text, entries = ("", []) if req.silent else (choice["text"], choice["logprobs"] or [])
        choice["text"], choice["finish_reason"] = head + text, "length" if req.silent else choice["finish_reason"]
        choice["logprobs"] = legacy_logprobs(lead + entries) if req.logprobs else None
    if req.silent:
        answer["usage"] = {**answer["usage"], "completion_tokens": 0, "total_tokens": answer["usage"]["prompt_tokens"]}
    return answer
