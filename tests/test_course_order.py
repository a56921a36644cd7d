"""The course is in the order its ideas are needed (issue 44): no notebook's code uses what a later
notebook builds, and no notebook names a later one among its prerequisites.

Each generated module names the notebook that builds it in its first line. A lesson sits at its
number; an appendix sits at the lesson it belongs to (the README's course map says "appendix to
NN"), since it is optional plumbing a reader may open from there. A notebook's code is its own
cells and the modules it exports: each minillm module they import must be built at the notebook's
place or before it. Hand-written modules (check, bench, utils) are tooling, not lessons, and exempt.
One exception, listed below with its reason.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from support import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
GENERATED = re.compile(r"^# Generated from notebooks/((\d\d|A\d)_\w+)\.ipynb")

# The listed exceptions, each with its reason: previews of the real model before the course has
# built all of it, in the lessons named, which say so where they use it.
PREVIEW = {  # (notebook, module): why
    **{(f"{n:02}", "minillm.runtime.llm"): "lessons 01-09 borrow notebook 10's minimal load to show the real model"
       for n in range(1, 10)},
    ("02", "minillm.model.rope"): "02 looks at the real model's attention, whose q and k are rotated (03's apply_rope)",
}


def appendix_parents() -> dict[str, int]:
    """{"A1": 6, ...} from the README's course map rows ('| A1 | [..](..) | appendix to 06: ...')."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return {a: int(n) for a, n in re.findall(r"^\| (A\d) \| \[[^\]]+\]\([^)]+\) \| appendix to (\d\d)\b", readme, re.M)}


def place(key: str, parents: dict[str, int]) -> int:
    return parents[key] if key.startswith("A") else int(key)


def builders() -> dict[str, str]:
    """{module name: key of the notebook that builds it ('06', 'A1')} from the generated headers."""
    out = {}
    for path in (ROOT / "minillm").rglob("*.py"):
        match = GENERATED.match(path.read_text(encoding="utf-8").split("\n", 1)[0])
        if match:
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = match.group(2)
    return out


def imported_modules(code: str) -> set[str]:
    """The minillm modules a piece of code imports ('from minillm.x import y' may import module x.y)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minillm"):
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("minillm"))
    return names


def cell_code(path: Path) -> str:
    """A notebook's code cells, without `#|` directives and IPython lines (! and %)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    lines = [line for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines()
             if not line.lstrip().startswith(("#|", "!", "%"))]
    return "\n".join(lines)


def test_every_appendix_has_its_lesson_in_the_course_map():
    parents = appendix_parents()
    appendices = {p.name[:2] for p in NOTEBOOKS if p.name.startswith("A")}
    assert appendices <= set(parents), f"README course map lacks 'appendix to NN' for {sorted(appendices - set(parents))}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_no_notebook_uses_what_a_later_one_builds(path):
    key, parents, built_by = path.name[:2], appendix_parents(), builders()
    here = place(key, parents)
    later = []
    cell_imports = imported_modules(cell_code(path))
    for name in sorted(cell_imports):
        by = built_by.get(name)
        if by is not None and place(by, parents) > here and (key, name) not in PREVIEW:
            later.append(f"a cell imports {name} (built in {by})")
    for module, by in sorted(built_by.items()):
        if by != key:
            continue
        source = (ROOT / Path(*module.split("."))).with_suffix(".py")
        source = source if source.exists() else ROOT / Path(*module.split(".")) / "__init__.py"
        for name in sorted(imported_modules(source.read_text(encoding="utf-8"))):
            other = built_by.get(name)
            if other is not None and place(other, parents) > here:
                later.append(f"{module} imports {name} (built in {other})")
    assert not later, f"{path.name} uses what a later notebook builds: " + "; ".join(later)


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name[:2].isdigit()], ids=lambda p: p.name)
def test_prerequisites_name_only_earlier_notebooks(path):
    """The opening's **Prerequisites.** paragraph names notebooks by number; each must come earlier."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"][:3]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    match = re.search(r"\*\*Prerequisites\.\*\*(.*?)(?:\n\n|\*\*Time\.\*\*)", text, re.S)
    assert match, f"{path.name}: no **Prerequisites.** paragraph"
    named = {int(n) for n in re.findall(r"(?<![\w.])(\d\d)(?![\w.%])", match.group(1))}
    assert all(n < int(path.name[:2]) for n in named), (
        f"{path.name} names notebooks {sorted(n for n in named if n >= int(path.name[:2]))} as prerequisites")


def test_the_rule_catches_a_forward_import(tmp_path, monkeypatch):
    """A planted forward reference: notebook 05's cells importing the engine (notebook 17) fails."""
    fake = tmp_path / "05_model.ipynb"
    fake.write_text(json.dumps({"cells": [{"cell_type": "code", "source": ["from minillm.runtime.engine import Engine\n"]}]}))
    with pytest.raises(AssertionError, match="runtime.engine"):
        test_no_notebook_uses_what_a_later_one_builds(fake)
