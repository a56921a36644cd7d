# Generated from notebooks/10_generate.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""LLM: a model and its tokenizer, with chat, generate and stream in a line each; `load` builds one.

Built in notebooks/10_generate.ipynb on the generation loop. `load` reads the embedded SmolLM2, a
model folder, a .gguf file or a hub id with the loader of notebook 06 and the tokenizer of notebook
07. The package's front door, minillm/api.py (notebook 24), extends both with the options of the
later notebooks: quantize, fast, lora, tensor_parallel, response_format, tools, speculative.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from minillm.model.decoder import CausalLM
from minillm.model.devices import parse_device, parse_dtype
from minillm.runtime.generate import Completion, PromptLogprobs, Step, collect, prompt_logprobs, stream
from minillm.runtime.sampling import SamplingParams
from minillm.text.chat_template import validate_template_kwargs
from minillm.text.reasoning import opens_thinking, split_reasoning, template_thinks
from minillm.text.tokenizer import Tokenizer
from minillm.weights.embedded import embedded_gguf_path
from minillm.weights.hub import download
from minillm.weights.loading import gguf_architecture, load_model


class PromptScoring:
    """LLM's scoring half: the prompt's own logprobs (prompt_logprobs, above), for evaluations and echo."""

    def prompt_logprobs(self, prompt, top_logprobs: int | None = None) -> PromptLogprobs:
        """Each token's logprob given those before it, for text (str) or token ids: one prefill."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return prompt_logprobs(self.model, ids, top_logprobs)


class LLM(PromptScoring):
    """A model and its tokenizer, with chat, generate and stream in a line each."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def encode_chat(self, messages: Sequence[dict], **template_kwargs) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ValueError(f"{self.tokenizer.source} has no chat template; use generate(prompt) with plain text")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)

    def _ids(self, prompt_or_messages) -> list[int]:
        chat = not isinstance(prompt_or_messages, str)
        return self.encode_chat(prompt_or_messages) if chat else self.tokenizer.encode(prompt_or_messages)

    def _steps(self, ids, params, thinking=None, **kwargs) -> Iterator[Step]:
        """The loop of this notebook, greedy unless params say otherwise (thinking: for notebook 14's grammars)."""
        return stream(self.model, self.tokenizer, ids, params=params or SamplingParams(temperature=0), **kwargs)

    def generate(self, prompt: str, params: SamplingParams | None = None, **kwargs) -> Completion:
        """Continue plain text (no chat template)."""
        return collect(self._steps(self.tokenizer.encode(prompt), params, **kwargs))

    def chat(self, messages: Sequence[dict], params: SamplingParams | None = None, template_name: str | None = None,
             chat_template_kwargs: dict | None = None, **kwargs) -> Completion:
        """Answer [{"role", "content"}, ...] by the chat template, or the one named, given its variables
        ({"enable_thinking": False}); a template that thinks gets the reasoning apart (.reasoning)."""
        template_kwargs = validate_template_kwargs(chat_template_kwargs)
        ids = self.encode_chat(messages, template_name=template_name, **template_kwargs)
        steps = self._steps(ids, params, thinking=self.thinking(ids, template_name), **kwargs)
        return self.split(collect(steps), ids, template_name)

    def thinking(self, ids: Sequence[int], template_name: str | None = None) -> bool | None:
        """None if the chat template does not think, else whether the prompt `ids` left a <think> open."""
        template = self.tokenizer.chat_templates.get(template_name or "default")
        return opens_thinking(self.tokenizer.decode(ids[-16:])) if template_thinks(template) else None

    def split(self, completion: Completion, ids: Sequence[int], template_name: str | None = None) -> Completion:
        """A chat answer with its reasoning (if the template thinks) moved from .text to .reasoning."""
        thinking = self.thinking(ids, template_name)
        if thinking is not None:
            completion.reasoning, completion.text = split_reasoning(completion.text, thinking)
        return completion

    def stream(self, prompt_or_messages, params: SamplingParams | None = None, **kwargs) -> Iterator[str]:
        """Text pieces as they are generated, for a plain prompt (str) or chat messages (list)."""
        for step in self._steps(self._ids(prompt_or_messages), params, **kwargs):
            if step.text:
                yield step.text


def load(model: str | Path | None = None, dtype: torch.dtype | str | None = None,
         device: str | torch.device | None = None) -> LLM:
    """An LLM from a hub id, a model folder or a .gguf file; default: the embedded SmolLM2-135M-Instruct."""
    source = embedded_gguf_path() if model is None else model
    dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    path = Path(source)
    if path.suffix == ".gguf":  # the header alone: a model minillm lacks is refused before its
        gguf_architecture(path)  # tokenizer decodes a vocabulary (Gemma 3: 262,144 tokens)
    tokenizer = load_tokenizer(source) if path.suffix == ".gguf" or path.is_dir() else None  # fails before the weights
    net = load_model(source, dtype=dtype, device=None if device is None else parse_device(device))
    return LLM(net, tokenizer if tokenizer is not None else load_tokenizer(source))  # a hub id: cached by now


def load_tokenizer(source: str | Path) -> Tokenizer:
    """The tokenizer of a model source: a .gguf file's own, a folder's files, or a hub id's (from the cache)."""
    path = Path(source)
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    if path.is_dir():
        return Tokenizer.from_folder(path)
    return Tokenizer.from_folder(download(str(source)))  # a hub id: load_model has put it in the cache
