"""Qwen3.5 through the front door: `minillm.load` on a folder and on a hub id (offline, a fake hub),
checked against transformers' stored logits and greedy tokens; the options built for the plain
decoder are refused by name, and so is the engine (it pages KV caches only, for now)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file

import minillm
from minillm.runtime.engine import Engine
from minillm.runtime.generate import collect
from minillm.runtime.llm import load as load_decoder_only
from minillm.text.tokenizer import QWEN_CHAT_TEMPLATE, Tokenizer
from support import DATA, FakeHub, HYBRID_REL, assert_logits_close

TINY = DATA / "qwen3_5-tiny"
REFERENCE = load_file(TINY / "reference.safetensors")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny Qwen3.5 checkpoint as a hub folder: its files, Qwen's tokenizer.json and template."""
    folder = tmp_path_factory.mktemp("qwen3_5")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(TINY / name, folder / name)
    Tokenizer.from_qwen_tiktoken().backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN_CHAT_TEMPLATE,
                                                              "eos_token": "<|im_end|>"}))
    return folder


def load_quietly(source, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped vision tower: tests/weights/test_hybrid.py checks the message
        return minillm.load(source, dtype="float32", device="cpu", **kwargs)


def assert_reference(llm):
    """The stored logits of the 140-token prompt, and 32 greedy tokens through LLM's own loop."""
    ids = REFERENCE["input_ids_3"]
    with torch.no_grad():
        assert_logits_close(llm.model(ids[None])[0], REFERENCE["logits_3"], rel=HYBRID_REL)
    for i in (1, 3):
        ids = REFERENCE[f"input_ids_{i}"].tolist()
        done = collect(llm._steps(ids, None, max_new_tokens=32, eos_token_ids=()))
        assert done.token_ids == REFERENCE[f"greedy_{i}"].tolist(), f"prompt {i}"


def test_load_a_folder(folder):
    llm = load_quietly(folder)
    assert type(llm.model).__name__ == "HybridCausalLM"
    assert_reference(llm)


def test_load_a_hub_id_offline(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with FakeHub("Qwen/Qwen3.5-0.8B", folder) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        llm = load_quietly("Qwen/Qwen3.5-0.8B")
    assert_reference(llm)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: the cache serves
    assert_reference(load_quietly("Qwen/Qwen3.5-0.8B"))


@pytest.mark.parametrize("option", [dict(quantize="int8"), dict(quantize="int4"), dict(fast=True),
                                    dict(lora=str(DATA)), dict(tensor_parallel=1)])
def test_decoder_options_are_refused_by_name(folder, option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"{name}: not built for Qwen3.5"):
        load_quietly(folder, **option)


def test_speculative_and_the_engine_are_refused(folder):
    llm = load_quietly(folder)
    with pytest.raises(ValueError, match="Qwen3.5's states do not roll back"):
        llm.generate("hi", speculative="ngram", max_new_tokens=4)
    with pytest.raises(ValueError, match="linear-attention layers"):
        Engine(llm.model, llm.tokenizer, num_blocks=8)


def test_notebook_10s_load_names_the_model_type(folder):
    """The decoder-only loader of notebook 10 refuses Qwen3.5 by its model_type; minillm.load takes it."""
    with pytest.raises(ValueError, match="model_type 'qwen3_5' is not supported"):
        load_decoder_only(folder, dtype="float32", device="cpu")
