"""minillm.model.devices: the one home of device and dtype choice, the clock and the memory gauge."""

import time

import pytest
import torch

from minillm.model.devices import (
    default_dtype,
    parse_device,
    parse_dtype,
    peak_memory_mib,
    pick_device,
    reset_peak_memory,
    synchronized_time,
)


def test_pick_device():
    device = pick_device()
    expected = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    assert device.type == expected
    assert pick_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="prefer must be one of"):
        pick_device("tpu")


def test_default_dtype(monkeypatch):
    assert default_dtype("cpu") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert default_dtype("cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert default_dtype("cuda:0") == torch.float16


def test_device_and_dtype_choices_are_listed():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("auto") is None
    assert parse_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="unknown dtype 'half8'; choose one of: auto, float32"):
        parse_dtype("half8")
    with pytest.raises(ValueError, match="unknown device 'tpu'; choose one of"):
        parse_device("tpu")


def test_clock_and_peak_memory_follow_the_process():
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)  # nothing to reset for a process; must not fail
    block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
    # the kernel's own figure for the peak resident set (Linux): VmHWM in /proc/self/status, in kB
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    assert peak_memory_mib(cpu) == pytest.approx(int(status["VmHWM"].split()[0]) / 1024, rel=0.05)
    assert peak_memory_mib(cpu) > 256
    del block
    start = synchronized_time(cpu)
    time.sleep(0.01)
    assert 0.009 < synchronized_time(cpu) - start < 1.0
