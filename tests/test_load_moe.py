"""The MoE models of notebook 23 through the front door: `minillm.load` on a folder picks the MoE loader
from config.json, the LLM gets the decoder's cache and engine (Qwen3-MoE) or the hybrid's (Qwen3.5-MoE),
the engine's batches give each request's greedy tokens alone, the OpenAI server and the command line
answer with transformers' stored greedy tokens, and the weight options not built for them are
refused by name."""

from __future__ import annotations

import warnings
from argparse import Namespace

import httpx
import pytest
import torch
from safetensors.torch import load_file

import minillm
from minillm.__main__ import _print_stream
from minillm.runtime.generate import collect
from minillm.runtime.sampling import SamplingParams
from minillm.serve.server import create_app
from support import DATA, HYBRID_REL, TINY_REL, assert_logits_close, qwen_hub_folder, serving

MODELS = {"qwen3_moe-tiny": ("MoeCausalLM", "Engine", TINY_REL),
          "qwen3_5_moe-tiny": ("HybridMoeCausalLM", "HybridEngine", HYBRID_REL)}


@pytest.fixture(scope="module", params=list(MODELS))
def folder(request, tmp_path_factory):
    """A tiny MoE checkpoint as a hub folder: its files, Qwen's tokenizer.json and chat template."""
    return qwen_hub_folder(DATA / request.param, tmp_path_factory.mktemp("moe") / request.param,
                           ("config.json", "model.safetensors", "reference.safetensors"))


def load_quietly(source, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Qwen3.5-MoE's skipped vision tower: tests/weights/test_moe_checkpoints.py checks it
        return minillm.load(source, dtype="float32", device="cpu", **kwargs)


def test_load_picks_the_moe_model_cache_and_engine(folder):
    llm, (model_class, engine_class, rel) = load_quietly(folder), MODELS[folder.name]
    assert (type(llm.model).__name__, llm.engine_class.__name__) == (model_class, engine_class)
    ref = load_file(folder / "reference.safetensors")
    with torch.no_grad():
        assert_logits_close(llm.model(ref["input_ids_2"][None])[0], ref["logits_2"], rel=rel)
    for i in range(3):
        done = collect(llm._steps(ref[f"input_ids_{i}"].tolist(), None, max_new_tokens=32, eos_token_ids=()))
        assert done.token_ids == ref[f"greedy_{i}"].tolist(), f"prompt {i}"


@pytest.mark.parametrize("option", [dict(quantize="int8"), dict(quantize="int4"), dict(fast=True),
                                    dict(lora=str(DATA)), dict(tensor_parallel=1)])
def test_weight_options_not_built_are_refused_by_name(folder, option):
    """The Qwen3.5-MoE (a hybrid) takes none of the weight options; the Qwen3-MoE takes quantize and fast
    (tests/speed/test_moe_quant.py), int4 only where its experts' width fits the groups."""
    name = next(iter(option))
    if folder.name.startswith("qwen3_5"):
        refusal = f"{name}: not built for Qwen3.5's hybrid layers yet"
    elif name in ("lora", "tensor_parallel"):
        refusal = f"{name}: not built for mixture-of-experts layers yet"
    elif option.get("quantize") == "int4":
        refusal = r"model\.layers\.0\.mlp\.experts\.down_proj: input features K=16 is not a multiple of group_size 32"
    else:
        llm, ref = load_quietly(folder, **option), load_file(folder / "reference.safetensors")
        with torch.no_grad():
            logits, expected = llm.model(ref["input_ids_2"][None])[0], ref["logits_2"]
        if name == "fast":  # the float fast path: transformers' logits and greedy tokens
            assert_logits_close(logits, expected, rel=TINY_REL)
            done = collect(llm._steps(ref["input_ids_1"].tolist(), None, max_new_tokens=32, eos_token_ids=()))
            assert done.token_ids == ref["greedy_1"].tolist()
        else:  # int8 experts: within int8's error on these large random weights (measured: 0.083 of the
            # logits' spread, 75 of 80 top-1 tokens equal)
            assert float((logits - expected).pow(2).mean().sqrt() / expected.std()) < 0.2
            assert float((logits.argmax(-1) == expected.argmax(-1)).float().mean()) >= 0.9
        return
    with pytest.raises(ValueError, match=refusal):
        load_quietly(folder, **option)


def test_the_engine_batches_give_each_request_alone(folder):
    """Four prompts through the model's engine at once (packed prefill, then decode rows routed
    together): each request's greedy tokens equal transformers' for that prompt alone."""
    llm, ref = load_quietly(folder), load_file(folder / "reference.safetensors")
    prompts = [ref[f"input_ids_{i}"].tolist() for i in range(3)] + [ref["input_ids_1"].tolist()]
    engine = llm.engine_class(llm.model, llm.tokenizer, num_blocks=64, block_size=16)
    outs = engine.generate(prompts, max_new_tokens=32, eos_token_ids=())
    assert [o["token_ids"] for o in outs] == [ref[f"greedy_{i}"].tolist() for i in (0, 1, 2, 1)]


def test_the_server_answers_with_the_greedy_tokens(folder):
    llm, ref = load_quietly(folder), load_file(folder / "reference.safetensors")
    ids = ref["input_ids_2"].tolist()
    app = create_app(llm, model_name="moe-tiny", num_blocks=64)
    assert type(app.state.bridge.engine).__name__ == MODELS[folder.name][1]
    with serving(app) as (_, url), httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "moe-tiny", "prompt": ids, "max_tokens": 32, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == llm.tokenizer.decode(ref["greedy_2"].tolist())


def test_the_command_line_streams_it(folder):
    llm, ref = load_quietly(folder), load_file(folder / "reference.safetensors")
    args = Namespace(max_new_tokens=32, stop=[], num_draft=None, stats=False, speculative=None,
                     speculative_max_batch=None, reasoning_budget=None)
    text, _ = _print_stream(llm, ref["input_ids_2"].tolist(), args, SamplingParams(temperature=0), None)
    assert text == llm.tokenizer.decode(ref["greedy_2"].tolist())


def test_speculative_decoding_by_prompt_lookup_and_int4_refused(folder):
    """Greedy speculation with the n-gram drafter gives the stored greedy tokens; the int4 drafter is
    refused by name: for the hybrid, and for these experts, too narrow for int4's groups."""
    llm, ref = load_quietly(folder), load_file(folder / "reference.safetensors")
    ids = ref["input_ids_2"].tolist()
    done = collect(llm._steps(ids, None, speculative="ngram", max_new_tokens=32, eos_token_ids=()))
    assert done.token_ids == ref["greedy_2"].tolist()
    refusal = "a Qwen3.5 drafter" if folder.name.startswith("qwen3_5") else "K=16 is not a multiple of group_size 32"
    with pytest.raises(ValueError, match=refusal):
        collect(llm._steps(ids, None, speculative="int4", max_new_tokens=4, eos_token_ids=()))
