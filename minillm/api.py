# Generated from notebooks/24_qwen_end_to_end.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The front door: `minillm.load(...)` -> `LLM`, with every option the course builds.

Built in notebooks/24_qwen_end_to_end.ipynb on notebook 10's LLM and load (minillm/runtime/llm.py): the
weight options of notebooks 12 (quantize), 13 (fast, compile), 20 (lora) and 21 (tensor_parallel), the answer
options of notebooks 14 (response_format, tools) and 19 (speculative), each checked before any file is read.
Qwen3.5 (notebook 22) loads by its own loader, with its hybrid cache; the decoder's options are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from minillm.cache.dense import make_cache
from minillm.cache.hybrid import make_hybrid_cache
from minillm.model.decoder import CausalLM, read_config_json
from minillm.model.devices import parse_device, parse_dtype
from minillm.model.moe import MoeCausalLM
from minillm.model.qwen3_5 import HybridCausalLM
from minillm.parallel.tensor_parallel import load_rank_shard
from minillm.runtime import llm as basic
from minillm.runtime.engine import Engine
from minillm.runtime.generate import Completion, Step, collect
from minillm.runtime.hybrid_engine import HybridEngine
from minillm.runtime.llm import load_tokenizer
from minillm.runtime.sampling import SamplingParams
from minillm.runtime.speculative import ModelDrafter, NgramDrafter, int4_drafter, stream as speculative_stream
from minillm.speed.fast import FastCausalLM, compile_now
from minillm.speed.moe import FastMoeCausalLM, quantize_moe_model
from minillm.speed.quant import GROUP_SIZES, MODES, load_gguf_quantized, quantize_model
from minillm.text.constrained import Constraints
from minillm.text.chat_template import validate_template_kwargs
from minillm.text.tool_calls import call_format, call_style, encode_with_tools, parse_tool_calls, tools_template, validate_tools
from minillm.utils.validate import is_int
from minillm.weights.embedded import embedded_gguf_path
from minillm.weights.gguf_file import check_gguf_header
from minillm.weights.hub import REPO_ID, download
from minillm.weights.hybrid import is_hybrid_folder, load_hybrid_folder
from minillm.weights.hybrid_gguf import is_hybrid_gguf, load_hybrid_gguf
from minillm.weights.loading import gguf_architecture, load_model
from minillm.weights.moe import is_moe_folder, load_moe_folder
from minillm.weights.moe_gguf import is_moe_gguf, load_moe_gguf
from minillm.weights.lora import merge_adapter, read_adapter


class LLM(basic.LLM):
    """Notebook 10's LLM with the answer options: response_format and tools (notebook 14), speculative (19)."""

    def __init__(self, model: CausalLM, tokenizer):
        super().__init__(model, tokenizer)
        self.constraints = Constraints(tokenizer, model.config.vocab_size)  # compiles response formats on use
        hybrid = isinstance(model, HybridCausalLM)  # Qwen3.5 (nb 22): a state per sequence beside the KV cache
        self.cache_factory = make_hybrid_cache if hybrid else make_cache
        self.engine_class = HybridEngine if hybrid else Engine  # what a server batches it with (nb 17, A6)

    def _steps(self, ids, params, speculative=None, response_format=None, thinking=None, reasoning_budget=None,
               **kwargs) -> Iterator[Step]:
        """A thinking template's format waits for </think>; reasoning_budget ends the reasoning (nb 14's gate)."""
        constraint = self.constraints.for_format(response_format, thinking, reasoning_budget, ids)  # None: free text
        if speculative is None:
            return super()._steps(ids, params, constraint=constraint, cache_factory=self.cache_factory, **kwargs)
        if constraint is not None:
            raise ValueError("speculative decoding does not take a response_format; pass one or the other")
        return speculative_stream(self.model, self.tokenizer, ids, self.drafter(speculative),
                                  params=params or SamplingParams(temperature=0), cache_factory=self.cache_factory, **kwargs)

    def chat(self, messages: Sequence[dict], params: SamplingParams | None = None, template_name: str | None = None,
             tools: list[dict] | None = None, tool_choice=None, **kwargs) -> Completion:
        """Notebook 10's chat; with tools or tool_choice, chat_with_tools (below)."""
        if tools is None and tool_choice is None:
            return super().chat(messages, params, template_name, **kwargs)
        return chat_with_tools(self, messages, params, tools, tool_choice, template_name, **kwargs)

    def drafter(self, speculative):
        """make_drafter (below) for this model."""
        return make_drafter(self.model, speculative)


def make_drafter(model, speculative):
    """The drafter for speculative decoding (minillm/runtime/speculative.py): "ngram" (prompt lookup),
    "int4" (this model's own int4 fast path, built on each call), another LLM with the same
    tokenizer, or a drafter object as it is. The answer is the model's own either way."""
    hybrid = isinstance(getattr(speculative, "model", model if speculative == "int4" else None), HybridCausalLM)
    if hybrid:  # the int4 fast path and a draft model's own cache are built for the decoder only
        raise ValueError("speculative: a Qwen3.5 drafter (int4, or a Qwen3.5 draft model) is not built yet; "
                         "use 'ngram' or a decoder-only draft model")
    if speculative == "ngram":
        return NgramDrafter()
    if speculative == "int4":  # a Qwen3-MoE's own int4 fast path is notebook 23's
        return ModelDrafter(FastMoeCausalLM(model, quantize="int4")) if isinstance(model, MoeCausalLM) else int4_drafter(model)
    return ModelDrafter(speculative.model) if isinstance(speculative, basic.LLM) else speculative


def chat_with_tools(llm: LLM, messages: Sequence[dict], params, tools, tool_choice, template_name=None,
                    chat_template_kwargs=None, **kwargs) -> Completion:
    """LLM.chat offering tools: a required call (tool_choice "required" or a named function) is
    forced by a grammar; the calls are returned in tool_calls, the other text as the text."""
    tools, choice = validate_tools(tools, tool_choice)
    forced = call_format(tools, choice, call_style(tools_template(llm.tokenizer, template_name)))
    if forced is not None and kwargs.get("response_format") is not None:
        raise ValueError("response_format cannot be combined with a required tool_choice")
    ids = encode_with_tools(llm.tokenizer, list(messages), tools if choice != "none" else [], template_name,
                            **validate_template_kwargs(chat_template_kwargs))
    steps = llm._steps(ids, params, **{**kwargs, "response_format": forced or kwargs.get("response_format")},
                       thinking=llm.thinking(ids, template_name))  # a thinking model's grammar waits for </think>
    completion = llm.split(collect(steps), ids, template_name)  # the reasoning apart first: a call made while thinking is the answer's
    if choice != "none":
        text, completion.tool_calls = parse_tool_calls(completion.text, tools)
        completion.text = text or ""
    return completion


def load(model: str | Path | None = None, dtype: torch.dtype | str | None = None,
         device: str | torch.device | None = None, quantize: str | None = None, group_size: int = 32,
         fast: bool = False, compile: bool = False, lora: str | Path | None = None,
         tensor_parallel: int | None = None) -> LLM:
    """An LLM from a hub id, a model folder or a .gguf file; default: the embedded SmolLM2-135M-Instruct.

    quantize (notebook 12): "int8" (per channel) or "int4" (groups of `group_size` inputs) quantizes
    the loaded linears; "gguf" keeps a .gguf file's Q4_0/Q4_1/Q8_0 blocks (its other types in float32; CPU).
    fast (notebook 13): the fast path, FastCausalLM (23: FastMoeCausalLM), quantized as asked; compile: torch.compile it.
    lora (notebook 20): a PEFT LoRA adapter's folder, merged into the float weights before the options.
    tensor_parallel (notebook 21): N, in each of the N processes torchrun starts: this rank's shard."""
    _validate_options(quantize, group_size, fast, compile, lora, tensor_parallel)  # before any work (Plumbing, below)
    source = embedded_gguf_path() if model is None else model
    if Path(source).suffix != ".gguf" and not Path(source).exists() and REPO_ID.fullmatch(str(source)):
        source = download(source)  # a hub id: fetched (or found in the cache) once, a folder from here on
    path = Path(source)
    gguf_file = path.suffix == ".gguf"  # Qwen3.5 (notebook 22, A5): a folder's config or a file's header says
    hybrid = is_hybrid_gguf(path) if gguf_file else is_hybrid_folder(path)
    moe = is_moe_gguf(path) if gguf_file else is_moe_folder(path)  # Qwen3-MoE, Qwen3.5-MoE (notebook 23, A7)
    if hybrid or moe:  # their own loaders: a Qwen3-MoE takes quantize and fast (notebook 23), the hybrids neither
        _validate_own_loader_options(path, hybrid, quantize, fast, lora, tensor_parallel)
    adapter = None if lora is None else read_adapter(lora)  # a bad adapter fails before the weights load
    dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    if gguf_file and not hybrid and not moe:  # the header alone: a model minillm lacks is refused
        gguf_architecture(path)  # before its tokenizer decodes a vocabulary (Gemma 3: 262,144 tokens)
    if quantize == "gguf":
        _validate_gguf_source(source, device, dtype)
    tokenizer = load_tokenizer(source) if gguf_file or path.is_dir() else None  # fails before the weights
    if tensor_parallel is not None:  # notebook 21: join the ranks, read this rank's slices
        net = load_rank_shard(source, tensor_parallel, dtype, device)
    elif quantize == "gguf":
        net = load_gguf_quantized(path)  # notebook 12: the file's own Q4_0/Q4_1/Q8_0 blocks, never floats
    elif hybrid or moe:  # their own loaders: notebooks 22 and 23 for a folder, appendices A5 and A7 for a .gguf
        own_loader = ((load_moe_gguf, load_moe_folder) if moe else (load_hybrid_gguf, load_hybrid_folder))[not gguf_file]
        net = own_loader(path, dtype=dtype, device=None if device is None else parse_device(device))
        net = _weight_options(net, quantize, group_size, fast, compile)  # notebook 23's quantized experts
    else:
        net = load_model(source, dtype=dtype, device=None if device is None else parse_device(device))
        net = net if adapter is None else merge_adapter(net, adapter)  # W + B A, then quantize or fast
        net = _weight_options(net, quantize, group_size, fast, compile)  # notebooks 12 and 13
    return LLM(net, tokenizer)  # None only for a source no loader above accepts: they raised first


QUANTIZE = (*MODES, "gguf")  # notebook 12's modes, and keeping a .gguf file's own blocks


def _validate_options(quantize: str | None, group_size: int, fast: bool, compile: bool, lora=None,
                   tensor_parallel: int | None = None) -> None:
    """load's options, checked together before anything is read: ValueError naming the conflict."""
    if quantize not in (None, *QUANTIZE):
        raise ValueError(f"unknown quantize {quantize!r}; choose one of: {', '.join(QUANTIZE)} (or None)")
    if quantize == "int4" and group_size not in GROUP_SIZES:  # each layer's K is checked when quantized
        raise ValueError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size!r}")
    if quantize != "int4" and group_size != 32:
        raise ValueError(f"group_size {group_size} applies to quantize='int4' only, got quantize={quantize!r}")
    if compile and not fast:
        raise ValueError("compile=True compiles the fast path: pass fast=True too")
    if fast and quantize == "gguf":
        raise ValueError("fast=True rebuilds the layers from float weights and cannot keep GGUF blocks; "
                         "use quantize='int4' (the same 4-bit grid as Q4_0/Q4_1 at group_size 32)")
    if tensor_parallel is not None and (not is_int(tensor_parallel)
                                        or tensor_parallel < 1):
        raise ValueError(f"tensor_parallel must be an int >= 1 (the number of ranks), got {tensor_parallel!r}")
    if tensor_parallel is not None and (quantize or fast or lora is not None):
        raise ValueError("tensor_parallel splits the float model's own linears: drop quantize, fast and lora")
    if lora is not None and quantize == "gguf":
        raise ValueError("lora= merges an adapter into float weights; quantize='gguf' keeps the file's 4-bit blocks")


HYBRID_MOE = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen35moe")  # Qwen3.5-MoE's model_type and GGUF architecture


def _validate_own_loader_options(path: Path, hybrid: bool, quantize: str | None, fast: bool, lora,
                                 tensor_parallel: int | None) -> None:
    """The models with loaders of their own run in one process, without an adapter: a Qwen3-MoE takes quantize
    ('int8', 'int4') and fast (notebook 23); Qwen3.5 and Qwen3.5-MoE (22, 23) run in float weights."""
    kind = check_gguf_header(path).get("general.architecture") if path.suffix == ".gguf" else \
        read_config_json(path)[0].get("model_type")
    float_only = hybrid or kind in HYBRID_MOE
    asked = [name for name, on in (("quantize", quantize == "gguf" or (quantize and float_only)), ("fast", fast and float_only),
                                   ("lora", lora is not None), ("tensor_parallel", tensor_parallel is not None)) if on]
    if asked:
        layers = "Qwen3.5's hybrid" if float_only else "mixture-of-experts"
        built = "" if float_only else " (quantize='int8' or 'int4' and fast=True are built)"
        raise ValueError(f"{', '.join(asked)}: not built for {layers} layers yet; load it without them{built}")


def _validate_gguf_source(source: str | Path, device: str | torch.device | None, dtype: torch.dtype | None) -> None:
    """quantize='gguf' needs a .gguf file, the CPU and float32."""
    if Path(source).suffix != ".gguf" or device not in (None, "auto", "cpu") or dtype not in (None, torch.float32):
        raise ValueError(f"quantize='gguf' keeps a .gguf file's blocks and runs on cpu in float32; "
                         f"got model {source}, device {device}, dtype {dtype}")


def _weight_options(net: CausalLM, quantize: str | None, group_size: int, fast: bool, compile: bool):
    """Float weights as loaded -> the fast path (notebook 13), or quantized linears (notebook 12), or as they are."""
    moe = isinstance(net, MoeCausalLM)  # notebook 23's quantized experts and fast path
    if fast:
        net = (FastMoeCausalLM if moe else FastCausalLM)(net, quantize=quantize, group_size=group_size)
        if compile:  # its graphs now, each announced on stderr, not inside the first answer
            compile_now(net.compile())
    elif quantize is not None:
        net = (quantize_moe_model if moe else quantize_model)(net, quantize, group_size)
    return net
