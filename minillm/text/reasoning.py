# Generated from notebooks/10_generate.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Thinking models' answers split into reasoning and content, whole or as the text streams in.

Built in notebooks/10_generate.ipynb (its section "Thinking: the reasoning apart"). Qwen3 and later
write their reasoning between <think> and </think>; a template may open the <think> in the prompt (then
only </think> is generated) or close an empty one (enable_thinking=false). One rule covers every case:
the answer is reasoning from an open <think> (the prompt's, or one the answer starts with) until
</think>, or until a <tool_call> (a call made while thinking is the answer's); the rest is content.
References: vLLM's Qwen3 reasoning parser (message.reasoning, formerly reasoning_content), llama.cpp's
--reasoning-format.
"""

from __future__ import annotations

THINK, END_THINK, TOOL_CALL = "<think>", "</think>", "<tool_call>"


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`: they wait for more text."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a <think> open: the answer then starts inside the reasoning."""
    return prompt_text.rfind(THINK) > prompt_text.rfind(END_THINK)


def closes_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends in a closed <think></think> (enable_thinking=false): no reasoning is due."""
    return prompt_text.rstrip().endswith(END_THINK)


def template_thinks(template: str | None) -> bool:
    """Whether a chat template knows reasoning blocks (it writes or strips </think>)."""
    return template is not None and END_THINK in template


class ReasoningStream:
    """One answer's text as it streams: feed(text) and end() return (reasoning, content) to send now.
    States: "start" (the answer may still open with <think>), "thinking", "content"."""

    def __init__(self, thinking: bool = False):
        self.state = "thinking" if thinking else "start"
        self.pending = ""  # text held back: a marker's possible beginning, or whitespace
        self.thought = self.reasoned = self.answered = False  # reasoning seen; reasoning sent; content sent

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        if self.state == "start":
            stripped = self.pending.lstrip()
            if stripped.startswith(THINK):  # the answer opens its own reasoning
                self.state, self.pending = "thinking", stripped[len(THINK):]
            elif not THINK.startswith(stripped):  # it cannot any more: all of it is content
                self.state = "content"
        reasoning = self._reasoning(final=False) if self.state == "thinking" else ""
        return reasoning, self._content() if self.state == "content" else ""

    def end(self) -> tuple[str, str]:
        """The rest at the finish: reasoning never closed stays reasoning."""
        if self.state == "thinking":
            return self._reasoning(final=True), ""
        self.state = "content"
        return "", self._content()

    def _reasoning(self, final: bool) -> str:
        self.thought = True
        ends = [i for i in (self.pending.find(END_THINK), self.pending.find(TOOL_CALL)) if i >= 0]
        held = 0 if final or ends else max(held_back(self.pending, END_THINK), held_back(self.pending, TOOL_CALL))
        cut = min(ends) if ends else len(self.pending) - held
        piece = self.pending[:cut].rstrip()  # trailing whitespace waits for more reasoning
        if ends:  # the reasoning ends: </think> is dropped, a <tool_call> stays in the content
            self.state, self.pending = "content", self.pending[cut:].removeprefix(END_THINK)
        else:
            self.pending = "" if final else self.pending[len(piece):]
        piece = piece if self.reasoned else piece.lstrip()
        self.reasoned = self.reasoned or bool(piece)
        return piece

    def _content(self) -> str:
        piece = self.pending.lstrip() if self.thought and not self.answered else self.pending
        self.pending, self.answered = "", self.answered or bool(piece)
        return piece


def split_reasoning(text: str, thinking: bool = False) -> tuple[str | None, str]:
    """(reasoning, or None if there was none; content) of a whole answer: the stream's pieces, joined."""
    stream = ReasoningStream(thinking)
    (r1, c1), (r2, c2) = stream.feed(text), stream.end()
    return (r1 + r2) or None, c1 + c2
