"""Qwen3.5 through the front door: `minillm.load` on a folder and on a hub id (offline, a fake hub),
checked against transformers' stored logits and greedy tokens; the options built for the plain
decoder are refused by name; speculative decoding rolls its states back after a rejection; the
OpenAI server batches it with the hybrid engine of appendix A6."""

from __future__ import annotations

from argparse import Namespace
import warnings

import httpx
import pytest
import torch
from safetensors.torch import load_file

import minillm
from minillm.__main__ import _drafter, _engine_class, _print_stream
from minillm.runtime.engine import Engine
from minillm.model.qwen3_5 import LinearState
from minillm.runtime.generate import collect
from minillm.runtime.llm import load as load_decoder_only
from minillm.runtime.sampling import SamplingParams
from minillm.runtime.speculative import SpeculationStats
from minillm.serve.server import create_app
from support import DATA, FakeHub, HYBRID_REL, KnowsTheAnswers, assert_logits_close, qwen_hub_folder, serving

TINY = DATA / "qwen3_5-tiny"
REFERENCE = load_file(TINY / "reference.safetensors")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny Qwen3.5 checkpoint as a hub folder: its files, Qwen's tokenizer.json and template."""
    return qwen_hub_folder(TINY, tmp_path_factory.mktemp("qwen3_5"))


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


@pytest.mark.parametrize("drafter", ["ngram", "half-right"])
def test_speculative_decoding_rolls_the_states_back(folder, drafter):
    """Greedy speculation must give the stored greedy tokens exactly, drafts rejected or not."""
    llm = load_quietly(folder)
    ids, answer = REFERENCE["input_ids_3"].tolist(), REFERENCE["greedy_3"].tolist()
    stats = SpeculationStats()
    speculative = "ngram" if drafter == "ngram" else KnowsTheAnswers([ids + answer])
    done = collect(llm._steps(ids, None, speculative=speculative, max_new_tokens=32, eos_token_ids=(), stats=stats))
    assert done.token_ids == answer
    assert stats.drafted > stats.accepted > (0 if drafter == "half-right" else -1)  # some kept, some rejected


def test_without_the_rollback_the_states_run_ahead(folder, monkeypatch):
    """A planted bug: restore() does nothing, so after the first rejection the states hold the
    rejected drafts too, and the next forward is refused (it must continue the state exactly)."""
    llm = load_quietly(folder)
    ids, answer = REFERENCE["input_ids_3"].tolist(), REFERENCE["greedy_3"].tolist()
    monkeypatch.setattr(LinearState, "restore", lambda self, saved: None)
    with pytest.raises(ValueError, match="must continue it exactly"):
        collect(llm._steps(ids, None, speculative=KnowsTheAnswers([ids + answer]), max_new_tokens=32,
                           eos_token_ids=()))


def test_qwen35_drafters_and_the_plain_engine_are_refused(folder):
    llm = load_quietly(folder)
    with pytest.raises(ValueError, match="a Qwen3.5 drafter .* is not built yet"):
        llm.generate("hi", speculative="int4", max_new_tokens=4)
    with pytest.raises(ValueError, match="a Qwen3.5 drafter .* is not built yet"):
        llm.generate("hi", speculative=llm, max_new_tokens=4)
    with pytest.raises(ValueError, match="linear-attention layers .* its engine is .*HybridEngine"):
        Engine(llm.model, llm.tokenizer, num_blocks=8)


def test_the_server_batches_it_with_the_hybrid_engine(folder):
    """/v1/completions on token ids: the greedy answer of the stored prompt, twice (the second reuses
    the states saved at its last block boundary), equal to LLM's own loop."""
    llm = load_quietly(folder)
    ids = REFERENCE["input_ids_3"].tolist()
    offline = collect(llm._steps(ids, None, max_new_tokens=32, eos_token_ids=()))
    assert offline.token_ids == REFERENCE["greedy_3"].tolist()
    app = create_app(llm, model_name="qwen3.5-tiny", num_blocks=64)
    assert type(app.state.bridge.engine).__name__ == "HybridEngine"
    with serving(app) as (_, url), httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(2):
            r = http.post("/v1/completions", json={"model": "qwen3.5-tiny", "prompt": ids, "max_tokens": 32,
                                                   "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == offline.text
    assert app.state.bridge.engine.manager.hits == 128 // 16


def test_notebook_10s_load_names_the_model_type(folder):
    """The decoder-only loader of notebook 10 refuses Qwen3.5 by its model_type; minillm.load takes it."""
    with pytest.raises(ValueError, match="model_type 'qwen3_5' is not supported"):
        load_decoder_only(folder, dtype="float32", device="cpu")


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_the_command_line_streams_it(folder, speculative, capsys):
    """`python -m minillm generate` streams through the llm's own cache (and drafter): the stored greedy answer."""
    llm = load_quietly(folder)
    args = Namespace(max_new_tokens=32, stop=[], num_draft=None, stats=False, speculative=speculative,
                     speculative_max_batch=None, reasoning_budget=None)
    drafter = _drafter(llm, args) if speculative else None
    text, _ = _print_stream(llm, REFERENCE["input_ids_3"].tolist(), args, SamplingParams(temperature=0), drafter)
    assert text == llm.tokenizer.decode(REFERENCE["greedy_3"].tolist())
    if speculative:
        assert _engine_class(args, None, drafter, llm)["engine_class"].func.__name__ == "HybridSpeculativeEngine"
