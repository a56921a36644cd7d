"""pytest's hooks and shared fixtures: the real model loaded once per worker, the header that ties a
run to the machine it ran on, a compile cache per kernel set, and the order files are handed out.

The helpers tests import (paths, the logits tolerance, the fake hub, live-server helpers) are in
tests/support.py: `from support import DATA, assert_logits_close`."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import pytest
import torch

from minillm.bench.peers import compile_cache_per_kernels
from minillm.weights.embedded import embedded_gguf_path
from minillm.text.tokenizer import Tokenizer
from minillm.weights.loading import from_gguf


def cpu_summary() -> str:
    """CPU model and its AVX flags, from /proc/cpuinfo where there is one."""
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    avx = sorted({f for f in flags.group(1).split() if f.startswith(("avx", "amx"))}) if flags else []
    return f"{model.group(1).strip() if model else platform.processor() or platform.machine()}; {' '.join(avx) or 'no AVX'}"


def pytest_configure(config) -> None:
    """One torch.compile cache per CPU kernel set, for this process, the CLI subprocesses and the
    notebook kernels alike (compile_cache_per_kernels says why)."""
    compile_cache_per_kernels()


# The files that take longest (measured with --durations on 2 cores), run first: `make test` hands
# whole files to two xdist workers in collection order, so starting the longest early lets both
# workers finish together instead of one waiting on a long notebook started last.
LONGEST_FIRST = ("notebooks/20_lora.ipynb", "notebooks/11_roofline.ipynb", "tests/parallel/test_tensor_parallel.py", "notebooks/21_tensor_parallel.ipynb",
                 "notebooks/19_speculative.ipynb", "tests/text/test_constrained.py", "notebooks/17_engine.ipynb",
                 "notebooks/13_fast_path.ipynb", "notebooks/14_structured_outputs.ipynb")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): the embedded SmolLM2-135M-Instruct dequantized to float32, loaded once
    per run. Shared, so read-only: a test that changes weights works on a copy."""
    path = embedded_gguf_path()
    return from_gguf(path), Tokenizer.from_gguf(path)


def pytest_report_header(config) -> list[str]:
    kernels = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
               if k in os.environ}
    return [f"cpu: {cpu_summary()}",
            f"torch {torch.__version__}: kernels {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads{', ' + str(kernels) if kernels else ''}"]


def pytest_terminal_summary(terminalreporter) -> None:
    """Besides --durations (single tests and notebook cells): each notebook's total time."""
    per_notebook: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            path = getattr(report, "nodeid", "").split("::")[0]
            if path.endswith(".ipynb"):
                per_notebook[path] = per_notebook.get(path, 0.0) + getattr(report, "duration", 0.0)
    if per_notebook:
        terminalreporter.write_sep("=", f"notebooks, slowest first ({sum(per_notebook.values()):.0f} s in all)")
        for path, seconds in sorted(per_notebook.items(), key=lambda kv: -kv[1])[:15]:
            terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
