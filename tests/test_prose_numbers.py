"""Every measured number in a notebook's prose comes from the run it sits in (issue 44).

A number with a unit of time, speed, size or a ratio in a markdown cell (`37.7 ms`, `2.2x`, `85%`,
`1.4 GB`, `120 tok/s`) must appear among that notebook's committed outputs, or in a `docs/bench/`
file the same markdown cell names. A prose number matches an output number when the output, rounded
to the prose's decimals, equals it (`2.23` matches a printed `2.2317`; thousands commas ignored).

The few numbers that are properties of a format, a paper or a machine rather than of a run are
noted in the cell that states them, with the reason (`<!-- not from the run: 15 GiB: why -->`,
see EXCEPTION_NOTE); `listed_exceptions()` gathers them all. A reader who sees the text and the
output disagree stops trusting both, so a re-executed notebook whose numbers moved fails here until its prose follows.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pytest
from support import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# A number (thousands commas allowed), then a unit of a measurement. `x`/`×` is a ratio ("2.2x",
# "2.2×"); plain counts ("4 layers", "16 bits") are not measurements and are not checked.
UNITS = (r"ms|µs|us|ns|s|sec|seconds?|minutes?|min|tok/s|tokens?/s|tokens? per second|GB/s|MB/s|"
         r"GFLOP/s|TFLOP/s|GFLOPS|TFLOPS|%|x|×|KB|MB|GB|TB|KiB|MiB|GiB|TiB")
NUMBER = re.compile(rf"(?<![\w.\-/^{{])(\d{{1,3}}(?:,\d{{3}})+|\d+(?:\.\d+)?)\s?(?:{UNITS})(?![\w/])")
ANY_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
BENCH_FILE = re.compile(r"docs/bench/[a-z0-9][\w.\-]*\.json")
# The exceptions, in the markdown cell that states them, so the reason sits beside the claim:
#   <!-- not from the run: 15 GiB: Qwen2.5-7B's bf16 weights, 7.6e9 x 2 bytes; 4.5: Q4_0's bits per weight -->
EXCEPTION_NOTE = re.compile(r"<!--\s*not from the run:(.*?)-->", re.S)


def prose_numbers(markdown: str) -> list[str]:
    """The measured numbers of one markdown cell, as written (code spans and LaTeX skipped)."""
    markdown = "\n".join(l for l in markdown.splitlines() if not l.startswith("**Time.**"))  # a reading estimate
    text = re.sub(r"```.*?```|`[^`]*`|\$\$.*?\$\$|\$[^$\n]*\$|<[^>]+>|\]\([^)]*\)", " ", markdown, flags=re.S)
    return [m.group(1) for m in NUMBER.finditer(text)]


def exceptions(markdown: str) -> dict[str, str]:
    """{number: reason} from the cell's `<!-- not from the run: NUMBER UNIT: reason; ... -->` notes."""
    found = {}
    for note in EXCEPTION_NOTE.findall(markdown):
        for entry in filter(None, (e.strip() for e in note.split(";"))):
            claim, _, reason = entry.partition(":")
            numbers = prose_numbers(claim)
            assert len(numbers) == 1 and reason.strip(), f"an exception is 'NUMBER UNIT: reason', got {entry!r}"
            found[numbers[0]] = reason.strip()
    return found


def listed_exceptions() -> list[str]:
    """Every exception of the course, `notebook: number: reason` (for the closing note of a change)."""
    return [f"{path.stem}: {number}: {reason}" for path in NOTEBOOKS
            for cell in json.loads(path.read_text(encoding="utf-8"))["cells"] if cell["cell_type"] == "markdown"
            for number, reason in exceptions("".join(cell["source"])).items()]


def output_text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            parts.append("".join(out["text"]))
        for mime in ("text/plain", "text/markdown", "text/html"):
            if mime in out.get("data", {}):
                parts.append("".join(out["data"][mime]))
    return "\n".join(parts)


def _decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def matches(number: str, printed: set[Decimal]) -> bool:
    """Whether a printed number, rounded to the prose's decimals, is `number`."""
    want = _decimal(number)
    places = Decimal(1).scaleb(want.as_tuple().exponent)
    return any(p == want or p.quantize(places) == want for p in printed)


def printed_numbers(text: str) -> set[Decimal]:
    return {d for d in map(_decimal, ANY_NUMBER.findall(text)) if d is not None}


def unsupported_numbers(path: Path) -> list[str]:
    """The prose numbers of one notebook that neither its outputs nor a named bench file hold."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    outputs = printed_numbers("\n".join(output_text(c) for c in nb["cells"] if c["cell_type"] == "code"))
    missing = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        src = "".join(cell["source"])
        allowed = exceptions(src)
        stale = set(allowed) - set(prose_numbers(src))
        assert not stale, f"{path.name}: an exception names {sorted(stale)}, which its cell's prose does not state"
        bench = set(outputs)
        for name in BENCH_FILE.findall(src):
            file = ROOT / name
            assert file.is_file(), f"{path.name} names {name}, which does not exist"
            bench |= printed_numbers(file.read_text(encoding="utf-8"))
        for number in prose_numbers(src):
            if number not in allowed and not matches(number, bench):
                missing.append(f"{number!r} in: {src.strip().splitlines()[0][:70]}")
    return missing


def test_the_check_finds_a_number_the_outputs_lack():
    assert prose_numbers("The fast path takes 37.7 ms, 2.2x faster; `3 ms` in code is skipped.") == ["37.7", "2.2"]
    assert matches("2.23", {Decimal("2.2317")}) and matches("2,399", {Decimal("2399")})
    assert not matches("0.96", {Decimal("0.62"), Decimal("2399")})
    note = "Its weights are 15 GiB. <!-- not from the run: 15 GiB: 7.6e9 parameters x 2 bytes -->"
    assert exceptions(note) == {"15": "7.6e9 parameters x 2 bytes"} and prose_numbers(note) == ["15"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_prose_numbers_come_from_the_run(path):
    missing = unsupported_numbers(path)
    assert not missing, f"{path.name}: {len(missing)} prose numbers are in no output nor named docs/bench file:\n" + "\n".join(missing)
