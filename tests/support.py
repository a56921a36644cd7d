"""The helpers tests share, in one module: `from support import DATA, assert_logits_close`.

- the paths (ROOT, DATA), the tiny fixtures' names (TINY, and HYBRID for Qwen3.5), greedy_by_teacher_forcing and
  KnowsTheAnswers (a drafter that makes speculation reject, for the rollback tests);
- the suite's one rule for comparing float32 logits (TINY_REL, SMOLLM2_REL, HYBRID_REL, assert_logits_close,
  top2_margin), explained below;
- FakeHub, a stand-in for the Hugging Face Hub on 127.0.0.1;
- serving, slow_steps and wait_until, for tests that drive a live server;
- qwen_hub_folder: a tiny checkpoint with Qwen's tokenizer beside it, as a hub folder;
- llama_cpp_convert: a checkpoint folder through llama.cpp's own GGUF converter; with_rope_scaling (a tiny
  checkpoint with a long-context rope_scaling line) and gguf_with_metadata (gguf-py's own metadata editor).

pytest's hooks and fixtures are in conftest.py beside this file.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"  # reference logits and tokens from transformers (tools/make_reference_data.py)
TINY = ("tiny-qwen2-tied", "tiny-qwen2-untied", "tiny-qwen3", "tiny-llama")  # random 4-layer checkpoints
HYBRID = ("qwen3_5-tiny",)  # random 4-layer Qwen3.5 (3 DeltaNet + 1 attention layer), hub layout with a vision tower


@torch.no_grad()
def greedy_by_teacher_forcing(model, prompt: torch.Tensor, tokens: torch.Tensor) -> list[int]:
    """The greedy choice at each of len(tokens) steps, from one forward over prompt + tokens.

    Attention is causal, so the logits at position p see only tokens 0..p: exactly the logits a
    step-by-step greedy run computes at that step, if the tokens before were the same."""
    logits = model(torch.cat([prompt, tokens])[None])[0]  # (T + n, V)
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist()


class KnowsTheAnswers:
    """A drafter (start and propose) for the tiny models' 320 ids: the next two tokens of the known text
    that `seen` begins, then wrong ones. A round of more than two drafts keeps some and rejects the rest,
    so a model with states must roll them back to the kept ones."""

    def __init__(self, texts: list[list[int]]):
        self.texts = texts

    def start(self, max_len: int) -> None:
        pass

    def propose(self, seen, k, params, generator, prompt_len):
        text = next((t for t in self.texts if t[: len(seen)] == seen), seen) + [3] * (k + 3)  # past a known answer: guesses
        right = text[len(seen) : len(seen) + 2]
        return (right + [(text[len(seen) + len(right)] + 1) % 320] * k)[:k], None


# ---------------------------------------------------------------- comparing logits
# The suite's one rule for comparing float32 logits, and the margins that make greedy tokens safe.
#
# Two correct machines do not compute the same float32 logits. MKL, oneDNN and torch's own
# kernels sum in a different order on an AVX-512 CPU than on an AVX2 one, so transformers itself,
# run twice on the same checkpoint, differs from its stored output by up to 1.4e-5 on the tiny
# fixtures (logits std about 4) and by 8e-5 on SmolLM2 (30 layers, std about 3.6). An absolute
# 1e-5 is below what two correct machines agree on; an absolute tolerance also means something
# different for logits of another scale. So a logits comparison allows
#
#     tolerance = rel x std(reference)
#
# with `rel` one of the two levels of the design's verification ladder:
#
#     TINY_REL    = 3e-5    the 4-layer fixtures in data/, and any of our own float32 paths compared
#                           with another (cache, paged, batched, fast, compiled): 1.2e-4 to 1.3e-4
#     SMOLLM2_REL = 2.5e-4  the 30-layer SmolLM2 against transformers on the same GGUF: about 9e-4
#
# Why these numbers (measured on an AVX-512 CPU with its own kernels and with
# ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2):
# - from below, the machines: the largest difference between correct runs is 3.3e-6 x std on
#   the tiny fixtures and 2.3e-5 x std on SmolLM2, 9x and 11x under the tolerance;
# - from above, the bugs: the subtlest planted bug, RMSNorm's eps at 1e-5 instead of tiny-qwen3's
#   1e-6, moves the logits by 1.5e-4 x std, 5x over the tolerance (tests/model/test_model.py); RoPE or the
#   causal mask off by one moves them by 1.8 x std or more.
#
# Greedy tokens. If both of the two largest logits are within the tolerance of the reference, the
# argmax cannot change while their gap (the top-2 margin) exceeds twice the tolerance. Tests that
# compare greedy tokens with stored ones rely on that; test_reference_data.py checks the margin of
# every stored greedy step, so a reference regenerated with a near-tie fails there, by name.
#
# Quantized and bf16 paths are not bit-reproducible across CPUs: the packed int8/int4 kernels
# return bf16, whose step near a logit of 20 is 0.125, and their greedy choices often tie exactly.
# Never compare their exact text or tokens with a stored value or a fixed string: compare them
# with their own reference path in the same run, or by KL and perplexity.

TINY_REL = 3e-5
SMOLLM2_REL = 2.5e-4

# The hybrid fixture (qwen3_5-tiny, Qwen3.5) needs its own level. Its Gated DeltaNet layers compute
# the chunked delta rule (a 64 x 64 triangular solve per chunk, then a chain of chunk states) in
# float32, which is noisier than attention: each DeltaNet layer's output is off its float64 value by
# about 4e-6 relative, against ~1e-7 for an attention layer. Measured on the stored prompts,
# transformers' own float32 logits are up to 1.6 x TINY_REL away from a float64 run of the same
# weights (the 140-token prompt), and two correct float32 paths of ours (one prefill against 50 + 90)
# up to 2 x TINY_REL apart. HYBRID_REL = 1e-4 x std leaves 2x over the worst of those; the subtlest
# planted bug of tests/model/test_qwen3_5.py (a chunk boundary off by one) still moves the logits by
# more than 3 x HYBRID_REL, and the stored greedy margins (smallest 0.0038) exceed twice its tolerance.
HYBRID_REL = 1e-4


class ByteTokenizer:
    """The little generate() needs of a tokenizer: no end token, and bytes for any id."""

    eos_token_ids = ()
    special_ids = frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id % 256])


def logits_tolerance(reference: torch.Tensor, rel: float = TINY_REL) -> float:
    """The absolute tolerance for logits compared with `reference`: rel x its standard deviation."""
    return rel * float(reference.detach().float().std())


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = TINY_REL, msg: str = "") -> None:
    """torch.testing.assert_close at the suite's tolerance (shapes, dtypes and NaNs checked too)."""
    atol = logits_tolerance(expected, rel)
    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=0)
    except AssertionError as exc:
        raise AssertionError(f"{msg + ': ' if msg else ''}logits beyond the tolerance "
                             f"{rel:g} x std {atol / rel:.3f} = {atol:.2e}\n{exc}") from None


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """Gap between the largest and the second largest logit, per row: (..., V) -> (...)."""
    top = logits.detach().float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


# ---------------------------------------------------------------- the fake hub
# A tiny stand-in for the Hugging Face Hub on 127.0.0.1, for offline tests of the hub path.
#
# It serves one folder as a model repository, speaking the part of the hub's protocol that
# `huggingface_hub.snapshot_download` uses (huggingface_hub 2.x):
#
#     GET  /api/models/{repo}/revision/{rev}               repo info: commit sha and file list
#     GET  /api/models/{repo}/tree/{sha}?recursive=true    file list with sizes and LFS sha256
#     HEAD /{repo}/resolve/{sha}/{file}                    X-Repo-Commit, ETag (LFS: X-Linked-Etag = sha256)
#     GET  /{repo}/resolve/{sha}/{file}                    the bytes
#
# Point `HF_ENDPOINT` at `FakeHub.url`, the same variable a user sets for a mirror.
# `corrupt=True` serves weight files with one flipped bit while advertising the true sha256,
# which is what a damaged mirror or a broken transfer looks like to the client.

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


class FakeHub:
    def __init__(self, repo_id: str, folder: Path, corrupt: bool = False):
        self.repo_id, self.folder, self.corrupt = repo_id, Path(folder), corrupt
        self.requests: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                hub.requests.append(f"{self.command} {self.path}")
                code, body, headers = hub.respond(self.command, self.path.split("?")[0])
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.rglob("*") if p.is_file())

    def entry(self, path: Path) -> dict:
        data = path.read_bytes()
        entry = {"type": "file", "path": path.relative_to(self.folder).as_posix(), "size": len(data),
                 "oid": hashlib.sha1(data).hexdigest()}
        if path.suffix in LFS_SUFFIXES:
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def respond(self, method: str, path: str) -> tuple[int, bytes, dict]:
        as_json = {"Content-Type": "application/json"}
        api = f"/api/models/{self.repo_id}/"
        if path.startswith(api + "revision/"):
            info = {"id": self.repo_id, "sha": COMMIT,
                    "siblings": [{"rfilename": e["path"]} for e in map(self.entry, self.files())]}
            return 200, json.dumps(info).encode(), as_json
        if path.startswith(api + "tree/"):
            return 200, json.dumps([self.entry(p) for p in self.files()]).encode(), as_json
        prefix = f"/{self.repo_id}/resolve/"
        if path.startswith(prefix):
            name = path[len(prefix):].split("/", 1)[1]
            file = self.folder / name
            if not file.is_file() or ".." in name:
                return 404, b"Entry not found", {"X-Error-Code": "EntryNotFound"}
            entry, data = self.entry(file), file.read_bytes()
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{entry["oid"]}"'}
            if "lfs" in entry:
                headers |= {"X-Linked-Etag": f'"{entry["lfs"]["oid"]}"', "X-Linked-Size": str(len(data))}
                if self.corrupt:
                    data = data[:-1] + bytes([data[-1] ^ 1])
            return 200, data, headers
        return 404, b"Repository not found", {"X-Error-Code": "RepoNotFound"}


# ---------------------------------------------------------------- a live server

@contextmanager
def serving(app):
    """(app, url): `app` served on a free port of 127.0.0.1 in a background thread, stopped on exit."""
    from minillm.serve.server import BackgroundServer  # the server's imports, only for the tests that serve

    background = BackgroundServer(app)
    try:
        yield app, background.url
    finally:
        background.stop()


def slow_steps(app, monkeypatch, seconds: float) -> None:
    """Make each engine step of `app` sleep first: a request then lasts as long as a test needs,
    whatever the CPU (the event loop must never wait for a step)."""
    engine = app.state.bridge.engine
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow)


def wait_until(condition, timeout: float = 10.0) -> bool:
    """Poll `condition` every 50 ms; False if it is still false after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


WORDS = ["true", "false", "null", "\": ", ", "]  # the tiny tokenizer's merged tokens, built one byte at a time


def tokenizer_gguf(path: Path, templates: dict[str, str] = {}) -> Path:  # noqa: B006 (read only)
    """A GGUF file holding only a small byte-level BPE: the 256 byte tokens, merges that build each of
    WORDS (so tokens span several bytes), an end token <|end|> and the given chat templates."""
    import gguf

    from minillm.text.tokenizer import bytes_to_unicode, spell

    tokens, merges = list(bytes_to_unicode().values()), []
    for word in WORDS:
        spelled = spell(word.encode())
        for k in range(2, len(spelled) + 1):
            if spelled[:k] not in tokens:
                merges.append(f"{spelled[:k - 1]} {spelled[k - 1]}")
                tokens.append(spelled[:k])
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([*tokens, "<|end|>"])
    writer.add_token_types([1] * len(tokens) + [3])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens))
    for name, template in templates.items():
        writer.add_string("tokenizer.chat_template" + ("" if name == "default" else f".{name}"), template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path



QWEN35_TEMPLATE = (DATA / "llama-cpp-vocab" / "templates" / "Qwen3.5-4B.jinja").read_text()  # a template that thinks


def with_chat_template(model_and_tokenizer, template: str):
    """minillm.load's LLM over (model, tokenizer) whose tokenizer renders `template` (a copy: the shared one is
    left alone)."""
    import copy

    from minillm.api import LLM

    model, tok = model_and_tokenizer
    tok = copy.copy(tok)
    tok.chat_templates, tok.chat_template = {"default": template}, template
    return LLM(model, tok)


def convert_tiny_moe(work: Path, name: str, pre: str, *args: str) -> Path:
    """data/<name> (config and safetensors, a 191-token Qwen tokenizer beside them) through llama.cpp's
    converter, as float32 GGUF work/<name>.gguf."""
    import shutil

    folder = work / name
    folder.mkdir()
    for file in ("config.json", "model.safetensors"):
        shutil.copy(DATA / name / file, folder / file)
    small_qwen_tokenizer(folder, 191)
    return llama_cpp_convert(folder, work / f"{name}.gguf", pre, *args)


def qwen_hub_folder(source: Path, folder: Path, files=("config.json", "model.safetensors")) -> Path:
    """A tiny checkpoint's `files` copied into `folder` as a hub folder would hold them, with Qwen's
    tokenizer.json and chat template beside them (the tiny folders in data/ have no tokenizer)."""
    import shutil

    from minillm.text.tokenizer import QWEN_CHAT_TEMPLATE, Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    for name in files:
        shutil.copy(source / name, folder / name)
    Tokenizer.from_qwen_tiktoken().backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN_CHAT_TEMPLATE,
                                                              "eos_token": "<|im_end|>"}))
    return folder

# ---------------------------------------------------------------- llama.cpp's converter
# convert_hf_to_gguf.py of the llama-cpp-python 0.3.36 sdist, unpacked into .venv/llama-cpp/ by
# tools/fetch_llama_cpp_vocab.py (which `make test` runs), its gguf-py first on the path. It runs as
# its own __main__ after two changes. The pre-tokenizer's name: the converter recognises a
# pre-tokenizer by hashing the token ids of a test string, and no real tokenizer has a tiny
# fixture's vocabulary, so the caller names it (what the real model's tokenizer hashes to). And
# dense Qwen's set_vocab tries SentencePiece first, importing the `sentencepiece` package (not
# installed here) before it finds no tokenizer.model: the missing file is raised first, as the
# converter itself raises it after the import, so it falls back to the tokenizer.json BPE as usual.
LLAMA_CPP = ROOT / ".venv" / "llama-cpp" / "llama.cpp"
_DRIVER = """
import runpy, sys
root, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [root + "/gguf-py", root]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
spm = TextModel._create_vocab_sentencepiece
def no_spm_file_first(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return spm(self)
TextModel._create_vocab_sentencepiece = no_spm_file_first
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def small_qwen_tokenizer(folder: Path, n: int, merged: int = 32) -> None:
    """tokenizer.json of n + 1 tokens (the converter asserts every id is below the model's vocab_size, so
    Qwen's full tokenizer is refused): Qwen's first n - `merged` tokens (bytes), then the first `merged`
    of Qwen's merges that join two kept tokens, and <|endoftext|> as id n. A GGUF tokenizer needs merges."""
    from minillm.text.tokenizer import Tokenizer

    tok = json.loads(Tokenizer.from_qwen_tiktoken().backend.to_str())
    vocab = {t: i for t, i in tok["model"]["vocab"].items() if i < n - merged}
    merges = []
    for a, b in tok["model"]["merges"]:
        if len(vocab) == n:
            break
        if a in vocab and b in vocab and a + b not in vocab:
            merges.append([a, b])
            vocab[a + b] = len(vocab)
    tok["model"]["vocab"], tok["model"]["merges"] = vocab, merges
    tok["added_tokens"] = [dict(tok["added_tokens"][0], id=n)]  # <|endoftext|>
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def llama_cpp_convert(folder: Path, out: Path, pre: str, *args: str) -> Path:
    """`folder` (config, safetensors, a tokenizer) converted by llama.cpp's converter to float32 GGUF `out`."""
    import pytest

    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp's converter is not in {LLAMA_CPP}: `make test` fetches it from the pinned sdist, "
                    "or run .venv/bin/python tools/fetch_llama_cpp_vocab.py", pytrace=False)
    env = dict(os.environ, PYTHONPATH=str(LLAMA_CPP / "gguf-py"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", _DRIVER, str(LLAMA_CPP), pre, *args, "--outtype", "f32",
                          "--outfile", str(out), str(folder)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and out.is_file(), f"the converter failed:\n{run.stderr[-3000:]}"
    return out


def with_rope_scaling(source: Path, folder: Path, rope_scaling: dict) -> Path:
    """`folder`: checkpoint `source` (config.json and model.safetensors) with the rope_scaling line a long-context
    model card tells users to add, such as Qwen3's YaRN, written into its config."""
    import shutil

    folder.mkdir(parents=True)
    shutil.copy(source / "model.safetensors", folder / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": rope_scaling}))
    return folder


def gguf_with_metadata(path: Path, out: Path, new: dict | None = None, remove: tuple[str, ...] = ()) -> Path:
    """A copy of GGUF `path` at `out` with metadata keys set ({key: (GGUFValueType, value)}) or removed, made by
    gguf-py's own gguf_new_metadata (the tool llama.cpp ships for it): every other key and tensor as they were."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out, arch=reader.fields["general.architecture"].contents(), endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {k: MetadataDetails(t, v) for k, (t, v) in (new or {}).items()}, remove)
    return out
