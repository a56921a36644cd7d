"""Notebook hygiene: every notebook is committed executed top to bottom, error-free, with one
title and sections (see the "Notebook -> package" section of the design). nbval checks the
outputs themselves; these checks catch what a careless save or a cleaning tool breaks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def source(cell: dict) -> str:
    text = cell.get("source", "")
    return "".join(text) if isinstance(text, list) else text


def markdown_lines(nb: dict) -> list[str]:
    """Markdown lines outside fenced code blocks (where '# ' is a comment, not a heading)."""
    lines, fenced = [], False
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for line in source(cell).splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced:
                lines.append(line)
        fenced = False
    return lines


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/*.ipynb"


def test_notebook_numbers_are_two_digits_and_unique():
    """Lessons are 01_…, 02_…; optional appendices (the plumbing a lesson links to) are A1_…, A2_…."""
    numbers = []
    for path in NOTEBOOKS:
        match = re.match(r"(\d{2}|A\d)[_-]", path.name)
        assert match, f"{path.name}: name must start with a two-digit number (01_tensors.ipynb) or A and a digit (A1_untrusted_files.ipynb)"
        numbers.append(match.group(1))
    duplicates = sorted({n for n in numbers if numbers.count(n) > 1})
    assert not duplicates, f"notebook numbers used twice: {duplicates}"


notebook_param = pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])


@notebook_param
def test_kernelspec_is_python3(path):
    assert load(path)["metadata"]["kernelspec"]["name"] == "python3"


@notebook_param
def test_executed_top_to_bottom(path):
    """Execution counts of non-empty code cells are exactly 1..N: run in order, in one
    fresh kernel, and not cleaned (nbval needs them)."""
    cells = [c for c in load(path)["cells"] if c["cell_type"] == "code" and source(c).strip()]
    counts = [c.get("execution_count") for c in cells]
    assert counts == list(range(1, len(cells) + 1)), f"execution counts {counts}"


@notebook_param
def test_no_error_outputs(path):
    errors = [
        f"cell {i}: {out.get('ename')}: {out.get('evalue')}"
        for i, cell in enumerate(load(path)["cells"])
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors, errors


@notebook_param
def test_one_title_then_sections(path):
    """The first cell is markdown opening with the '# ' title, the only one in the notebook;
    '## ' sections make JupyterLab's table of contents."""
    nb = load(path)
    first = nb["cells"][0]
    assert first["cell_type"] == "markdown", "the first cell must be the markdown title"
    assert source(first).lstrip().startswith("# "), "the first cell must start with '# Title'"
    lines = markdown_lines(nb)
    titles = [line for line in lines if line.startswith("# ")]
    assert len(titles) == 1, f"exactly one '# ' title expected, found {titles}"
    assert any(line.startswith("## ") for line in lines), "no '## ' section"
