"""Tensor parallelism (notebook 21) with gloo on the CPU: ranks are processes started as torchrun
starts them; every result is compared with the single-process model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from support import DATA, TINY
from safetensors.torch import load_file
from tp_worker import engine_prompts  # the prompts the ranks run

from minillm.__main__ import main
from minillm.weights.embedded import embedded_gguf_path
from minillm.runtime.generate import generate
from minillm.weights.gguf_file import read_gguf
from minillm.model.decoder import ModelConfig, from_folder
from minillm.parallel.tensor_parallel import Split, validate_split, shard
from minillm.text.tokenizer import Tokenizer
from minillm.weights.loading import gguf_config

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "tp_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(task: str, world: int, out: Path, timeout: float = 240, **env) -> None:
    """Start `world` ranks of tests/parallel/tp_worker.py with the variables torchrun sets; wait for rank 0."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1", **env}
    logs = [out.with_name(f"rank{r}.log") for r in range(world)]  # files, not pipes: a full pipe would block a rank
    ranks = [subprocess.Popen([sys.executable, str(WORKER), task, str(out)], cwd=ROOT, stderr=log.open("w"),
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r, log in enumerate(logs)]
    try:
        ranks[0].wait(timeout=timeout)
    finally:
        for p in ranks[1:]:  # done with rank 0 or soon after it; a rank told to hang is ended here
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
    assert ranks[0].returncode == 0, logs[0].read_text()[-3000:]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(embedded_gguf_path())


def within_scale(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> bool:
    """Every logit within rel x the largest |logit|: fp32 summed in another order, nothing more."""
    return bool((got - want).abs().max() <= rel * want.abs().max())


@pytest.mark.parametrize("world", [2, 4])
def test_every_fixture_split_over_ranks_equals_one_process(world, tok, tmp_path):
    launch("fixtures", world, tmp_path / "out.pt")
    runs = torch.load(tmp_path / "out.pt")
    for name in TINY:
        model, got, ref = from_folder(DATA / name), runs[name], load_file(DATA / name / "reference.safetensors")
        with torch.no_grad():
            for i in range(3):
                want = model(ref[f"input_ids_{i}"][None])[0]
                assert within_scale(got["logits"][i], want), (name, i, float((got["logits"][i] - want).abs().max()))
        assert got["greedy"] == generate(model, tok, ref["input_ids_0"].tolist(), max_new_tokens=32, eos_token_ids=()).token_ids
        prompts, limits = engine_prompts()
        alone = [generate(model, tok, p, max_new_tokens=m, eos_token_ids=()).token_ids for p, m in zip(prompts, limits)]
        assert got["engine"] == alone, name
        assert got["preemptions"] > 0, "the engine was meant to run short of blocks"
        assert got["local_heads"] == (4 // world, 1), "each rank holds its share of heads (KV heads: one)"


def test_smollm2_split_over_three_ranks_equals_one_process(smollm2, tmp_path):
    model, tok = smollm2
    launch("smollm2", 3, tmp_path / "out.pt")
    got, ref = torch.load(tmp_path / "out.pt"), load_file(DATA / "smollm2" / "reference.safetensors")
    for i in range(3):
        ids = ref[f"prompt_ids_{i}"].tolist()
        with torch.no_grad():
            want = model(torch.tensor([ids]), logits_to_keep=1)[0, -1]
        assert within_scale(got[f"last_logits_{i}"], want)
        assert got[f"greedy_{i}"] == generate(model, tok, ids, max_new_tokens=32, eos_token_ids=()).token_ids


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_lost_rank_ends_the_others_with_a_clear_error(how, tmp_path):
    start = time.monotonic()
    launch(how, 2, tmp_path / "out.pt", timeout=120, TP_TIMEOUT="5")
    got = torch.load(tmp_path / "out.pt")
    assert got["error"] is not None and "another rank died or did not answer in time" in got["error"], got
    assert got["seconds"] < 30 and time.monotonic() - start < 90, got


@pytest.mark.parametrize("world", [2, 4])
def test_moe_split_by_experts_equals_one_process(world, tmp_path):
    """Expert parallelism (notebook 23): each rank holds E / world experts of every layer; the stored
    transformers logits, the 32 greedy tokens and an engine run of the three prompts are the single
    process's."""
    from support import HYBRID_REL, TINY_REL, assert_logits_close

    launch("experts", world, tmp_path / "out.pt")
    result = torch.load(tmp_path / "out.pt")
    for name, rel in (("qwen3_moe-tiny", TINY_REL), ("qwen3_5_moe-tiny", HYBRID_REL)):
        ref, got = load_file(DATA / name / "reference.safetensors"), result[name]
        assert got["held"] == [(8 // world, 32, 64)] * 2  # (E / world, 2I, h) in each of the 2 layers
        for i in range(3):
            assert_logits_close(got["logits"][i], ref[f"logits_{i}"], rel=rel, msg=f"{name} prompt {i}")
            assert got["greedy"][i] == ref[f"greedy_{i}"].tolist(), (name, i)
        assert got["engine"] == [ref[f"greedy_{i}"].tolist() for i in range(3)], name


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_the_ranks_expert_shares_add_up_to_the_layer(world):
    """In one process: every rank's local_experts on the same tokens, summed, is the whole layer; a planted
    bug (a rank runs every pair, not only its experts' ones) is caught by the same comparison."""
    from minillm.model.moe import experts_grouped, route
    from minillm.parallel.expert_parallel import expert_share, local_experts

    g = torch.Generator().manual_seed(world)
    E, h, I, k = 8, 16, 12, 3
    x, gate_up, down, router = (torch.randn(*s, generator=g) for s in ((10, h), (E, 2 * I, h), (E, h, I), (E, h)))
    weights, experts = route(x, router, k)
    whole = experts_grouped(x, gate_up, down, weights, experts)
    shares = [expert_share(E, r, world) for r in range(world)]
    summed = sum(local_experts(x, gate_up[s], down[s], weights, experts, s.start) for s in shares)
    torch.testing.assert_close(summed, whole, rtol=0, atol=1e-5)
    if world > 1:
        planted = sum(local_experts(x, gate_up, down, weights, experts, 0) for _ in shares)  # every pair on every rank
        assert (planted - whole).abs().max() > 0.1


def test_expert_shares_that_do_not_divide_are_named():
    from minillm.parallel.expert_parallel import expert_share

    assert [list(expert_share(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="num_experts divisible by 3, got 8"):
        expert_share(8, 0, 3)


def test_sizes_that_do_not_divide_are_named():
    config = gguf_config(read_gguf(embedded_gguf_path()))  # SmolLM2-135M: 9 heads, 3 KV heads, MLP 1536
    local = Split(config, 2, 3).local_config()
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (3, 1, 512)
    for world, named in ((2, "num_attention_heads 9, num_key_value_heads 3"), (4, "num_attention_heads 9"),
                         (9, "intermediate_size 1536"), (6, "num_attention_heads 9")):
        with pytest.raises(ValueError, match=f"tensor_parallel {world} does not divide {named}"):
            validate_split(config, world)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel must be an int >= 1"):
            validate_split(config, bad)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        Split(config, 3, 3)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", TINY)
def test_the_ranks_slices_put_together_are_the_checkpoint(name, world):
    """Column-parallel rows and row-parallel columns concatenate back to each tensor; replicated KV heads
    (4 ranks, 2 heads) are each held by the ranks whose query heads read them."""
    config, tensors = ModelConfig.from_json(DATA / name), load_file(DATA / name / "model.safetensors")
    splits = [Split(config, r, world) for r in range(world)]
    D, group = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    for key, w in tensors.items():
        parts = [shard(s, key, w) for s in splits]
        if "k_proj" in key or "v_proj" in key:
            for s, part in zip(splits, parts):  # rank r's query heads [r Hl, (r+1) Hl) read KV head q // group
                kv = {q // group for q in range(s.heads.start, s.heads.stop)}
                assert torch.equal(part, torch.cat([w[h * D:(h + 1) * D] for h in sorted(kv)]))
        else:
            dim = 1 if key.endswith(("o_proj.weight", "down_proj.weight")) else 0
            whole = parts[0] if all(p is w for p in parts) else torch.cat(parts, dim)
            assert torch.equal(whole[: w.shape[0]], w), key


def torchrun(world: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m", "minillm", *args]


def test_cli_chat_under_torchrun_answers_as_one_process(smollm2):
    """`torchrun ... -m minillm chat --tensor-parallel 3`: rank 0 reads the lines and prints the answers,
    the same as the one-process model's greedy answers; the other ranks print nothing."""
    model, tok = smollm2
    questions = ["What is the capital of France?", "And of Italy?"]
    flags = ["--temperature", "0", "--max-new-tokens", "24"]
    done = subprocess.run(torchrun(3, "chat", "--tensor-parallel", "3", *flags), input="\n".join(questions) + "\n",
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    history, answers = [], []
    for q in questions:
        history.append({"role": "user", "content": q})
        ids = tok.apply_chat_template(history, add_generation_prompt=True)
        answers.append(generate(model, tok, ids, max_new_tokens=24).text)
        history.append({"role": "assistant", "content": answers[-1]})
    assert done.stdout.count("assistant> ") == 2 and done.stdout.count("minillm chat with") == 1  # rank 0 only
    for answer in answers:
        assert f"assistant> {answer}\n" in done.stdout


def test_server_under_torchrun_answers_as_offline_generation(smollm2, tmp_path):
    """A TP 3 server: three concurrent requests of n = 2, beside a bad one, equal offline greedy generation."""
    model, tok = smollm2
    port = free_port()
    server = subprocess.Popen(torchrun(3, "serve", "--tensor-parallel", "3", "--port", str(port), "--access-log", "off"),
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(log := tmp_path / "server.log").open("w"),
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        questions = ["What is the capital of France?", "Name a colour.", "Count to five."]

        def ask(q):
            body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": q}],
                    "temperature": 0, "max_tokens": 20, "n": 2}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()

        with ThreadPoolExecutor(4) as pool:
            bad = pool.submit(httpx.post, f"{url}/v1/chat/completions", json={"model": "smollm2-135m-instruct",
                              "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, timeout=60)
            replies = list(pool.map(ask, questions))
        assert bad.result().status_code == 400  # refused on rank 0: the followers never see it
        for q, reply in zip(questions, replies):
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            want = generate(model, tok, ids, max_new_tokens=20).text
            assert [c["message"]["content"] for c in reply["choices"]] == [want, want], reply
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel", "0"], "tensor_parallel must be an int >= 1"),
    (["--tensor-parallel", "2", "--quantize", "int4"], "drop quantize, fast and lora"),
    (["--tensor-parallel", "2", "--speculative", "ngram"], "not with --tensor-parallel"),
    (["--tensor-parallel", "2"], "launch with `torchrun --nproc-per-node 2 -m minillm"),  # WORLD_SIZE not set
])
def test_bad_tensor_parallel_flags_are_named(flags, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["generate", "hi", *flags]) == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_lora_adapters_with_tensor_parallel(capsys):
    assert main(["serve", "--lora", "a=x", "--tensor-parallel", "2"]) == 2
    assert "not with --tensor-parallel" in capsys.readouterr().err
