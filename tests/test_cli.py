"""`python -m minillm`: `info` agrees with what gguf reads from the file; `generate` answers
offline with the embedded model; bad input gets a one-line error and exit status 2, never a
traceback."""

from __future__ import annotations

import json
import subprocess
import time
import sys

import gguf
import pytest

from support import ROOT
from minillm.weights.embedded import embedded_gguf_path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minillm", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def summary_rows(stdout: str) -> dict[str, str]:
    """The indented 'key  value' rows of the summary."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("  "):
            key, _, value = line.strip().partition(" ")
            rows[key] = value.strip()
    return rows


def test_summary_of_embedded_model_matches_gguf():
    reader = gguf.GGUFReader(embedded_gguf_path())
    layers = int(reader.fields["llama.block_count"].contents())
    vocab = int(reader.fields["llama.vocab_size"].contents())
    parameters = sum(int(t.n_elements) for t in reader.tensors)
    assert reader.fields["general.architecture"].contents() == "llama"

    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    rows = summary_rows(result.stdout)
    assert rows["architecture"] == "llama"
    assert rows["layers"] == str(layers)
    assert rows["vocab_size"] == str(vocab)
    assert rows["parameters"].split()[0] == f"{parameters:,}"


def test_missing_model_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    result = run_cli("info", "--model", str(missing))
    assert result.returncode == 2
    assert "minillm: error:" in result.stderr and str(missing) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "content",
    [
        b"this is not a gguf file\n" * 10,
        b"GGUF\x03\x00\x00\x00" + b"\xff" * 40,  # valid magic, corrupt header: gguf raises IndexError
    ],
    ids=["no-magic", "truncated-header"],
)
def test_junk_model_file(tmp_path, content):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(content)
    result = run_cli("info", "--model", str(junk))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "minillm: error:" in result.stderr and "junk.gguf" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_answers_with_paris_and_prints_metrics():
    result = run_cli("generate", "What is the capital of France?", "--temperature", "0",
                     "--max-new-tokens", "30", "--stats", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tok/s" in result.stderr and "first token" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "tpu"], "unknown device 'tpu'; choose one of: auto, cpu, cuda"),
        (["--dtype", "int3"], "unknown dtype 'int3'; choose one of: auto, float32"),
        (["--temperature", "-1"], "temperature"),
        (["--model", "no-such-org/no-such-model"], "HF_ENDPOINT"),
    ],
)
def test_generate_bad_input(args, message, tmp_path):
    env_args = ["generate", "hi", "--max-new-tokens", "2", *args]
    result = subprocess.run(
        [sys.executable, "-m", "minillm", *env_args], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_generate_with_speculation_gives_the_plain_answer():
    plain = run_cli("generate", "What is the capital of France?", "--temperature", "0", "--max-new-tokens", "24",
                    "--device", "cpu")
    fast = run_cli("generate", "What is the capital of France?", "--temperature", "0", "--max-new-tokens", "24",
                   "--device", "cpu", "--speculative", "ngram", "--num-draft", "3", "--stats")
    assert fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout and "Paris" in fast.stdout
    assert "[speculative: " in fast.stderr and "tokens per forward" in fast.stderr


def test_generate_with_a_json_schema_always_parses(tmp_path):
    schema = {"type": "object", "required": ["city", "country"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}}}
    path = tmp_path / "city.json"
    path.write_text(json.dumps(schema))
    for flag in (str(path), json.dumps(schema)):  # a file or the schema itself
        result = run_cli("generate", "Name a city.", "--temperature", "1", "--seed", "3", "--max-new-tokens", "60",
                         "--device", "cpu", "--json-schema", flag)
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout)
        assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values())
    bad = run_cli("generate", "hi", "--device", "cpu", "--json-schema", '{"type": "date"}')
    assert bad.returncode == 2 and "date" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("args, message", [
    (["--num-draft", "3"], "--num-draft applies to --speculative"),
    (["--json", "--speculative", "ngram"], "cannot be combined with --speculative"),
    (["--json-schema", "{not json"], "--json-schema takes a JSON schema or a .json file"),
    (["--speculative", "int4", "--num-draft", "0"], "--num-draft must be >= 1, got 0"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be >= 1, got -5"),
    (["--seed", str(2**70)], "seed must be an int in [-2**63, 2**64)"),
    (["--model", "data/tiny-llama"], "tokenizer not found"),  # weights there, no tokenizer: found before loading
    (["--chat-template-kwargs", '{"messages": []}'], "--chat-template-kwargs.messages is set from the request"),
    (["--chat-template-kwargs", "{enable_thinking"], "argument --chat-template-kwargs: not JSON"),
    (["--reasoning-budget", "-1"], "--reasoning-budget must be an integer >= 0 (tokens), got -1"),
], ids=["num-draft alone", "json and speculative", "json-schema not json", "num-draft 0", "max-new-tokens",
        "seed", "no tokenizer", "template kwargs reserved", "template kwargs not json", "reasoning budget"])
def test_bad_flags_fail_before_the_model_loads(args, message):
    t0 = time.monotonic()
    result = run_cli("generate", "hi", "--device", "cpu", *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - t0 < 15  # an interpreter start and imports, no weights


@pytest.mark.parametrize("args, message", [
    (["--speculative-max-batch", "2"], "--speculative-max-batch applies to --speculative"),
    (["--speculative", "ngram", "--speculative-max-batch", "0"], "--speculative-max-batch must be >= 1, got 0"),
    (["--reasoning-budget", "-3"], "--reasoning-budget must be an integer >= 0 (tokens), got -3"),
], ids=["max-batch alone", "max-batch 0", "reasoning budget"])
def test_serve_speculation_flags_fail_before_the_model_loads(args, message):
    result = run_cli("serve", "--device", "cpu", *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_prompt_longer_than_the_context_names_both_numbers():
    result = run_cli("generate", "word " * 9000, "--raw", "--device", "cpu")
    assert result.returncode == 2
    assert "the prompt has" in result.stderr and "the context holds 8192" in result.stderr


def test_chat_session_reset_and_exit():
    script = "What is the capital of France?\n/reset\n/exit\n"
    result = subprocess.run([sys.executable, "-m", "minillm", "chat", "--temperature", "0", "--max-new-tokens", "30",
                             "--device", "cpu"], cwd=ROOT, input=script, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "(conversation cleared)" in result.stdout


def test_ctrl_c_stops_the_answer_and_keeps_the_session():
    """SIGINT while an answer streams: the answer stops, the chat goes on, /exit quits with 0."""
    import os
    import signal
    import time

    # SIGINT at its default in the child: a run started in the background (`make test &`) inherits it
    # ignored, and Python then keeps ignoring it, so Ctrl-C would never reach the chat
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "chat", "--temperature", "0",
                             "--max-new-tokens", "2000", "--device", "cpu"], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:  # greedy, SmolLM2 writes this essay for 400 tokens and more: it cannot end before the Ctrl-C arrives
        proc.stdin.write("Write a very long essay about the history of Rome, with many chapters.\n")
        proc.stdin.flush()
        seen = ""
        deadline = time.monotonic() + 90
        while "assistant> " not in seen or len(seen.split("assistant> ", 1)[1]) < 20:
            char = proc.stdout.read(1)
            assert char and time.monotonic() < deadline, seen
            seen += char
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate("/exit\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "[interrupted]" in seen + out and "Traceback" not in err


@pytest.mark.parametrize("module", ["minillm.bench", "minillm.check"])
def test_the_tooling_packages_run_with_dash_m(module):
    """bench/ and check/ are packages now: `python -m` runs their __main__.py, which calls their main."""
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and f"usage: python -m {module}" in result.stdout, result.stderr
