# Generated from notebooks/01_tensors.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Devices and dtypes: which device to run on, which dtype by default, parsing a user's choice,
a clock for asynchronous devices, and peak memory. The one home of these rules for every layer.

Built in notebooks/01_tensors.ipynb ("Devices"). A CUDA GPU runs the work it is given
asynchronously: Python queues kernels and moves on, so a timer must first wait for the queue
(`synchronized_time`), and memory is reported by the device's allocator, not the process.
"""

from __future__ import annotations

import resource
import sys
import time

import torch


def _validate_preferred(prefer: str, available: dict[str, bool]) -> None:
    if prefer not in available:
        raise ValueError(f"pick_device: prefer must be one of {sorted(available)}, got {prefer!r}")
    if not available[prefer]:
        raise ValueError(f"pick_device: {prefer} was requested but is not available on this machine")


def pick_device(prefer: str | None = None) -> torch.device:
    """CUDA if available, then Apple's MPS, then the CPU; `prefer` ("cuda", "mps", "cpu") forces one."""
    available = {
        "cuda": torch.cuda.is_available(),
        "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
        "cpu": True,
    }
    if prefer is not None:
        _validate_preferred(prefer, available)
        return torch.device(prefer)
    return torch.device(next(name for name, ok in available.items() if ok))


def default_dtype(device: str | torch.device) -> torch.dtype:
    """float32 on CPU (and MPS); bfloat16 on CUDA, float16 where bfloat16 is not supported."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str | None) -> torch.dtype | None:
    """'float32' / 'float16' / 'bfloat16' (or fp32, fp16, bf16; 'auto' or None = the device's default)."""
    if name in (None, "auto"):
        return None
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of: auto, {', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


def parse_device(name: str | torch.device | None) -> torch.device:
    """'cpu', 'cuda', 'cuda:N', 'mps' (or 'auto' / None = CUDA, then MPS, then CPU), checked for availability."""
    if name in (None, "auto"):
        return pick_device()
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}; choose one of: auto, cpu, cuda, cuda:N, mps") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unknown device {name!r}; choose one of: auto, cpu, cuda, cuda:N, mps")
    pick_device(device.type)  # raises if that kind of device is not available here
    return device


def on_host(t: torch.Tensor) -> bool:
    """Whether reading t's values back is free: it is in CPU memory. Checks of values (ids in range,
    no NaN, a 0/1 mask) run only then: on a GPU each would stall the device once per token."""
    return t.device.type == "cpu"


def synchronized_time(device: torch.device) -> float:
    """time.perf_counter() once the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for peak_memory_mib on a CUDA device (the process's peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float:
    """MiB: the CUDA allocator's peak on a GPU, else the process's peak resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)
