"""The hub path end to end, offline: a fake hub on 127.0.0.1 reached through HF_ENDPOINT."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from support import FakeHub
from support import DATA
from minillm.weights.hub import download
from minillm.weights.loading import WeightsError, load_model
from support import assert_logits_close

REPO_ID = "minillm-tests/tiny-qwen3"


@pytest.fixture
def repo(tmp_path):
    """A hub repository: the tiny Qwen3 checkpoint plus files a model load must not fetch."""
    folder = tmp_path / "repo"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(DATA / "tiny-qwen3" / name, folder / name)
    (folder / "README.md").write_text("# tiny\n")
    (folder / "pytorch_model.bin").write_bytes(b"a pickle duplicate of the weights")
    return folder


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return home


def reference_logits_match(model):
    ref = load_file(DATA / "tiny-qwen3" / "reference.safetensors")
    with torch.no_grad():
        logits = model(ref["input_ids_2"][None])[0]
    assert_logits_close(logits, ref["logits_2"])


def test_download_then_load_from_cache_with_the_server_gone(repo, hf_home, monkeypatch):
    with FakeHub(REPO_ID, repo) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        model = load_model(REPO_ID, device="cpu")
    reference_logits_match(model)
    fetched = [r for r in hub.requests if r.startswith("GET /" + REPO_ID)]
    assert any(r.endswith("/model.safetensors") for r in fetched)
    assert not any(r.endswith(("pytorch_model.bin", "README.md")) for r in fetched), fetched
    assert (hf_home / "hub" / "models--minillm-tests--tiny-qwen3").is_dir()

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    reference_logits_match(load_model(REPO_ID, device="cpu"))


def test_corrupted_download_is_rejected_by_its_checksum(repo, hf_home, monkeypatch):
    with FakeHub(REPO_ID, repo, corrupt=True) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(WeightsError, match="model.safetensors: sha256 .* differs from the hub's"):
            download(REPO_ID)
    # the corrupt file was deleted, so a good server heals the cache on the next load
    with FakeHub(REPO_ID, repo) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        reference_logits_match(load_model(REPO_ID, device="cpu"))


def test_unknown_repo_and_unreachable_server_say_what_to_do(repo, hf_home, monkeypatch):
    with FakeHub(REPO_ID, repo) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(WeightsError, match=f"minillm-tests/other: not in the local cache and not downloadable from {hub.url}"):
            download("minillm-tests/other")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(WeightsError, match="set HF_ENDPOINT to a reachable mirror"):
        download(REPO_ID)


def test_load_model_rejects_what_it_cannot_resolve(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a .gguf file, a model folder or a hub id"):
        load_model(str(tmp_path / "missing-folder"))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_model(tmp_path / "missing.gguf")
