# Generated from notebooks/18_server.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Tool calls streamed as OpenAI streams them: text as it comes until a call can begin, then each call's
name, then its arguments in fragments.

Built in notebooks/18_server.ipynb (its section "Streaming tool calls"). Text goes out at once, less what
could begin <tool_call> (and trailing whitespace); inside a block an incremental JSON lexer rewrites each
complete token of the arguments as json.dumps writes it, so the fragments join to the whole answer's.
References: OpenAI's chat completion chunk (delta.tool_calls); vLLM's Hermes tool parser.
"""

from __future__ import annotations

import json
import re
import uuid

from minillm.runtime.engine import Output
from minillm.text.reasoning import held_back  # notebook 10: the hold-back of a marker's start
from minillm.text.tool_calls import XMLCallReader  # notebook 14: Qwen3.5's calls, read piece by piece
from minillm.serve.openai_protocol import Reply, answer_text, reasoning_events, token_logprobs

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
PUNCTUATION = {"{": "{", "}": "}", "[": "[", "]": "]", ":": ": ", ",": ", "}  # as json.dumps separates
SCALAR = re.compile(r"[-+.0-9A-Za-z]+")  # a number, true, false, null (json.loads checks it)


def json_token(text: str, pos: int) -> tuple[str, int] | None:
    """The next JSON token of `text` from `pos` and the position after it; None while it may be
    incomplete (an open string, a number or word at the end); ValueError if it cannot be JSON."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    if pos == len(text):
        return None
    if text[pos] in PUNCTUATION:
        return text[pos], pos + 1
    if text[pos] == '"':
        i = pos + 1
        while i < len(text):
            if text[i] == '"':
                return text[pos:i + 1], i + 1
            i += 2 if text[i] == "\\" else 1
        return None
    word = SCALAR.match(text, pos)
    if word is None:
        raise ValueError(f"not JSON at {text[pos:pos + 10]!r}")
    return (word.group(), word.end()) if word.end() < len(text) else None


def normalized(token: str) -> str:
    """A token as json.dumps writes it: the fragments join to json.dumps(arguments), the whole answer's."""
    return PUNCTUATION[token] if token in PUNCTUATION else json.dumps(json.loads(token))


class CallReader:
    """The JSON object of one <tool_call> block, a token at a time: its name, and its arguments' tokens."""

    def __init__(self):
        self.stack: list[str] = []  # the containers open: "{" or "["
        self.key = self.field = self.name = None  # the call object's last key; the field being read; the name
        self.arguments: list[str] = []  # normalized tokens of the arguments' value
        self.has_arguments = self.done = False

    next_piece = staticmethod(lambda text: json_token(text, 0))  # (token, end) or None, as XMLCallReader's

    def take(self, token: str) -> None:
        """One token; ValueError when the block is not a call's JSON object."""
        if not self.stack:
            if token != "{":
                raise ValueError("a tool call is a JSON object")
            self.stack.append(token)
        elif len(self.stack) == 1 and self.field is None:  # between the fields of the call object
            if token == "}":
                self.stack.pop()
                self.done = True
                self.arguments += [] if self.has_arguments else ["{}"]  # none: {} (parse_tool_calls' default)
            elif token == ":":
                self.field = self.key
            elif token.startswith('"'):
                self.key = json.loads(token)
            elif token != ",":
                raise ValueError(f"unexpected {token!r} in a tool call")
        else:  # a token of the value of self.field
            if token in ("{", "["):
                self.stack.append(token)
            elif token in ("]", "}") and self.stack.pop() != {"]": "[", "}": "{"}[token]:
                raise ValueError(f"unbalanced {token!r}")
            if self.field == "name":
                self.name = json.loads(token) if token.startswith('"') else None
                if self.name is None:
                    raise ValueError("a tool call's name is a string")
            elif self.field == "arguments":
                self.has_arguments = True
                self.arguments.append(normalized(token))
            if len(self.stack) == 1:
                self.field = None  # the value ended


class ToolCallStream:
    """One choice's streamed answer, with tools offered: `feed` each new piece of text, `end` at the
    finish; each returns (content to send, tool-call deltas to send)."""

    def __init__(self, one_call: bool = False, tools: list[dict] = ()):
        self.pending = ""  # text not yet sent: in text mode, what could begin a call; in a block, unread text
        self.space = ""  # trailing whitespace of the content sent so far: sent when more content follows
        self.raw = ""  # the block's text read so far (sent as content if it turns out not to be a call)
        self.reader: CallReader | None = None  # the open block's reader; None in text mode
        self.calls, self.complete, self.one_call = 0, 0, one_call  # calls begun, calls closed
        self.tools = list(tools)  # the offered: their schemas read Qwen3.5's XML values
        self.id, self.sent = None, 0  # the open call's id once its name was sent; argument tokens sent

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, deltas = [], []
        while self.pending and (read_text(self, content) if self.reader is None else read_block(self, content, deltas)):
            pass  # each step returns True when the mode changed and the rest of the text is to be read again
        flush_call(self, deltas)
        return "".join(content), deltas

    def end(self, finish: str) -> tuple[str, list[dict], str]:
        """The rest at the finish, and the finish_reason sent: "tool_calls" if a call's block closed."""
        content, deltas = [], []
        if self.reader is not None and self.id is None:  # a block that never named a function: it is text
            self.pending, self.reader = self.raw + self.pending, None
        if self.reader is None:
            send_content(self, content, self.pending)
        flush_call(self, deltas)
        if not self.calls:
            content.append(self.space)  # no calls: the answer's text as it is, trailing whitespace too
        return "".join(content), deltas, "tool_calls" if self.complete else finish


def send_content(s: ToolCallStream, content: list[str], text: str) -> None:
    """Send text as content, holding its trailing whitespace until more content comes."""
    kept = text.rstrip()
    if kept:
        content += [s.space, kept]
        s.space = ""
    s.space += text[len(kept):]


def read_text(s: ToolCallStream, content: list[str]) -> bool:
    """Text mode: send what cannot begin a call; True when a block opens."""
    at = s.pending.find(OPEN_TAG)
    upto = at if at >= 0 else len(s.pending) - held_back(s.pending, OPEN_TAG)
    send_content(s, content, s.pending[:upto])
    s.pending = s.pending[upto:]
    if at < 0:
        return False
    body = s.pending[len(OPEN_TAG):]
    if not body.strip():  # the block's first character says which reader: "<" Qwen3.5's XML, else JSON
        return False
    s.pending, s.raw = body, OPEN_TAG
    s.reader = XMLCallReader(s.tools) if body.lstrip().startswith("<") else CallReader()
    return True


def read_block(s: ToolCallStream, content: list[str], deltas: list[dict]) -> bool:
    """In a block: read its tokens, sending the call's first delta once its name is known; then wait for
    </tool_call>. True when the block closed, or turned out to be text (text mode again)."""
    try:
        while not s.reader.done:
            found = s.reader.next_piece(s.pending)
            if found is None:
                return False
            token, end = found
            s.raw, s.pending = s.raw + s.pending[:end], s.pending[end:]
            s.reader.take(token)
            if s.reader.name is not None and s.id is None:
                flush_call(s, deltas)
    except ValueError:  # not a call after all
        if s.id is None:  # nothing of it was sent: its text is content, and text mode goes on after the tag
            send_content(s, content, OPEN_TAG)
            s.pending, s.reader = s.raw[len(OPEN_TAG):] + s.pending, None
            return True
        s.reader.done = True  # the call was sent: it keeps what it had; its block's rest is dropped
    at = s.pending.find(CLOSE_TAG)
    if at < 0:
        s.pending = s.pending[len(s.pending) - held_back(s.pending, CLOSE_TAG):]
        return False
    flush_call(s, deltas)
    s.complete += s.id is not None and shown(s)
    s.pending, s.reader, s.id, s.sent = s.pending[at + len(CLOSE_TAG):], None, None, 0
    return True


def shown(s: ToolCallStream) -> bool:
    """Whether the open call is sent: every call, or with parallel_tool_calls false the first only."""
    return not s.one_call or s.calls == 1


def flush_call(s: ToolCallStream, deltas: list[dict]) -> None:
    """The open call's delta: the first names it (index, id, type, function.name); later ones carry the
    argument tokens read since, as one fragment."""
    if s.reader is None or s.reader.name is None:
        return
    if s.id is None:
        s.id, s.calls = "call_" + uuid.uuid4().hex[:24], s.calls + 1
        if shown(s):
            deltas.append({"index": s.calls - 1, "id": s.id, "type": "function",
                           "function": {"name": s.reader.name, "arguments": ""}})
    args = "".join(s.reader.arguments[s.sent:])
    s.sent = len(s.reader.arguments)
    if args and shown(s):
        if deltas and deltas[-1].get("id") == s.id:
            deltas[-1]["function"]["arguments"] += args
        else:
            deltas.append({"index": s.calls - 1, "function": {"arguments": args}})


def tool_events(out: Output, reply: Reply, tokenizer, logprobs: bool) -> list[str]:
    """output_events for an answer that offered tools: the content and tool-call deltas this Output
    released, then on the last one the finish ("tool_calls" after a call)."""
    if reply.calls is None:
        reply.calls = ToolCallStream(reply.one_call, reply.tools)
    events, text = reasoning_events(reply, answer_text(reply, out, tokenizer), out.finished)
    content, calls = reply.calls.feed(text)
    if out.finished:
        more, last, reply.finish = reply.calls.end(out.finish_reason)
        content, calls = content + more, calls + last
    lp = [token_logprobs(tokenizer, out)] if logprobs and out.token_id is not None else None
    if content or calls or lp:
        choice = reply.choice(content, None, lp, delta=True)
        choice["delta"] = {"content": content or None, "tool_calls": calls} if calls else {"content": content}
        events.append(reply.chunk([choice]))
    if out.finished:
        events.append(reply.chunk([{"index": reply.index, "delta": {}, "logprobs": None, "finish_reason": reply.finish}]))
    return events
