"""tools/gpu_check.py, the device check script, run here on the CPU: every check passes and the
JSON report has its fields; a planted bad reference makes a check fail and the exit status 1."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from support import DATA, ROOT

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

CHECK_FIELDS = {"name", "passed", "max_error", "tolerance", "detail", "seconds"}


def test_every_check_passes_on_the_cpu(tmp_path):
    out = tmp_path / "gpu-check.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"device", "device_type", "torch", "checks", "passed", "wall_s", "tolerances"} <= set(report)
    assert report["device_type"] == "cpu" and report["torch"] == torch.__version__ and report["passed"]
    names = [c["name"] for c in report["checks"]]
    for model in (*gpu_check.TINY, "smollm2"):
        for kind in ("float32/logits", "bfloat16/logits", "float32/greedy", "float32/fast-greedy",
                     "float32/engine-vs-one-at-a-time"):
            assert f"{model}/{kind}" in names
    for check in report["checks"]:
        assert set(check) == CHECK_FIELDS and check["passed"], check
        assert 0 <= check["max_error"] <= check["tolerance"]


@pytest.fixture
def planted(tmp_path):
    """A copy of data/tiny-qwen3 whose stored logits (one entry) and greedy tokens (one) are wrong."""
    data = tmp_path / "data"
    shutil.copytree(DATA / "tiny-qwen3", data / "tiny-qwen3")
    ref = load_file(DATA / "tiny-qwen3" / "reference.safetensors")
    ref["logits_1"] = ref["logits_1"].clone()
    ref["logits_1"][4, 7] += 1e-3  # ten times the float32 tolerance, far inside the bf16 one
    ref["greedy_2"] = ref["greedy_2"].clone()
    ref["greedy_2"][-1] = (ref["greedy_2"][-1] + 1) % 320
    save_file(ref, data / "tiny-qwen3" / "reference.safetensors")
    return data


def test_a_planted_bad_reference_fails_and_sets_the_exit_status(planted, tmp_path):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--data", str(planted), "--only", "tiny-qwen3"]) == 1
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    failed = {name for name, c in checks.items() if not c["passed"]}
    assert failed == {"tiny-qwen3/float32/logits", "tiny-qwen3/float32/greedy", "tiny-qwen3/float32/fast-greedy"}
    assert checks["tiny-qwen3/float32/logits"]["max_error"] == pytest.approx(1e-3, rel=0.05)
    assert checks["tiny-qwen3/float32/greedy"]["max_error"] == 1  # one run of three differs
    assert not json.loads(out.read_text())["passed"]


def test_a_zero_tolerance_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "BF16_REL", 0.0)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--only", "tiny-llama"]) == 1
    failed = [c["name"] for c in json.loads(out.read_text())["checks"] if not c["passed"]]
    assert failed == ["tiny-llama/bfloat16/logits"]


def test_cuda_requested_without_one_exits_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check.main(["--device", "cuda", "--out", str(tmp_path / "r.json")]) == 2
