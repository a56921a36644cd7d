"""The MoE models of notebook 23 through the front door: `minillm.load` on a folder picks the MoE loader
from config.json, the LLM gets the decoder's cache and engine (Qwen3-MoE) or the hybrid's (Qwen3.5-MoE),
the engine's batches give each request's greedy tokens alone, the OpenAI server and the command line
answer with transformers' stored greedy tokens, and the weight options not built for experts are
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
def test_weight_options_are_refused_by_name(folder, option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"{name}: not built for mixture-of-experts layers yet"):
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
                     speculative_max_batch=None)
    text, _ = _print_stream(llm, ref["input_ids_2"].tolist(), args, SamplingParams(temperature=0), None)
    assert text == llm.tokenizer.decode(ref["greedy_2"].tolist())


def test_speculative_decoding_by_prompt_lookup_and_int4_refused(folder):
    """Greedy speculation with the n-gram drafter gives the stored greedy tokens; the int4 drafter (the
    fast path, not built for experts) is refused by name."""
    llm, ref = load_quietly(folder), load_file(folder / "reference.safetensors")
    ids = ref["input_ids_2"].tolist()
    done = collect(llm._steps(ids, None, speculative="ngram", max_new_tokens=32, eos_token_ids=()))
    assert done.token_ids == ref["greedy_2"].tolist()
    refusal = "a Qwen3.5 drafter" if folder.name.startswith("qwen3_5") else "the 'int4' drafter is the fast path, not built for mixture"
    with pytest.raises(ValueError, match=refusal):
        collect(llm._steps(ids, None, speculative="int4", max_new_tokens=4, eos_token_ids=()))
