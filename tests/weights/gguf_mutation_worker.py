"""The child process of test_gguf_header.py's fuzz test: mutated GGUF files loaded under a memory cap.

Reads a JSON job on stdin: {"good": a GGUF file, "dir": a scratch folder, "headroom_mib": N,
"mutations": [[label, byte offset, struct format, value], ...]}. It loads the good file once (the
reference logits, and every import and lazy allocation done), then caps its address space at what
it uses now plus `headroom_mib` (RLIMIT_AS), so a loader that allocates without bound fails with
MemoryError here instead of swapping the machine. Then, for each mutation, it writes the mutated
file, times `from_gguf` on it and sorts the outcome:

- refused: a WeightsError (or an OSError) whose message names the file;
- loaded:  a model whose logits equal the good file's (a mutation that changes nothing that matters);
- foreign: anything else (another exception, an unnamed error, different logits), with its label.

It prints one JSON line: the counts, the slowest mutation and its time, and the peak memory.
"""

from __future__ import annotations

import json
import resource
import struct
import sys
import time
from pathlib import Path

import torch

from minillm.weights.gguf_file import WeightsError
from minillm.weights.loading import from_gguf

IDS = torch.tensor([[1, 5, 9, 200, 3, 17]])


def vm_size_bytes() -> int:
    """This process's address space now (Linux's VmSize): what RLIMIT_AS counts."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def outcome(path: Path, reference: torch.Tensor) -> str:
    """'refused', 'loaded' or a description of a foreign outcome."""
    try:
        model = from_gguf(path)
    except (WeightsError, OSError) as exc:
        return "refused" if path.name in str(exc) else f"an error without the file's name: {exc}"
    except Exception as exc:  # any other exception is the finding
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    with torch.no_grad():
        logits = model(IDS)
    return "loaded" if torch.equal(logits, reference) else "loaded a different model"


def main() -> None:
    job = json.loads(sys.stdin.read())
    good_path = Path(job["good"])
    good = good_path.read_bytes()
    with torch.no_grad():
        reference = from_gguf(good_path)(IDS)
    cap = vm_size_bytes() + job["headroom_mib"] * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    bad = Path(job["dir"]) / "mutated.gguf"
    counts = {"tried": 0, "refused": 0, "loaded": 0}
    foreign, slowest = [], (0.0, None)
    for label, offset, fmt, value in job["mutations"]:
        data = bytearray(good)
        struct.pack_into("<" + fmt, data, offset, value)
        bad.write_bytes(data)
        start = time.perf_counter()
        result = outcome(bad, reference)
        elapsed = time.perf_counter() - start
        counts["tried"] += 1
        if result in counts:
            counts[result] += 1
        else:
            foreign.append(f"{label} = {value}: {result}")
        slowest = max(slowest, (elapsed, f"{label} = {value}"), key=lambda pair: pair[0])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({**counts, "foreign": foreign, "max_seconds": round(slowest[0], 4), "slowest": slowest[1],
                      "cap_mib": cap >> 20, "peak_rss_growth_mib": round((peak - rss_before) / 1024, 1)}))


if __name__ == "__main__":
    main()
