"""`python -m minillm`: the summary of the embedded GGUF agrees with what gguf reads from
the file, and bad --model paths get a one-line error and exit status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from minillm.embedded import embedded_gguf_path

ROOT = Path(__file__).resolve().parent.parent


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

    result = run_cli()
    assert result.returncode == 0, result.stderr
    rows = summary_rows(result.stdout)
    assert rows["architecture"] == "llama"
    assert rows["layers"] == str(layers)
    assert rows["vocab_size"] == str(vocab)
    assert rows["parameters"].split()[0] == f"{parameters:,}"


def test_missing_model_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    result = run_cli("--model", str(missing))
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
    result = run_cli("--model", str(junk))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "minillm: error:" in result.stderr and "junk.gguf" in result.stderr
    assert "Traceback" not in result.stderr
