"""The teaching rules of the design ("Teaching"), checked on the notebooks.

- every notebook imports only what requirements.txt installs (a reader runs them after
  `make demo` alone; transformers and openai are test-only);
- no notebook points at a file outside the repository;
- every notebook has at least 45% of its source in markdown, and no lesson cell longer than 40
  lines outside a "Plumbing" section (exercise markers and `#|` directives not counted);
- every notebook opens with learning goals, prerequisites and a time, and closes with three to
  five key ideas (issue 44).
"""

from __future__ import annotations

import ast
import json
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from support import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MIN_PROSE = 0.45
MAX_LESSON_LINES = 40


def cells(path: Path) -> list[tuple[str, str]]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]


def imported_modules(code: str) -> set[str]:
    """Top-level names a cell imports (IPython magics and shell lines skipped)."""
    python = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
    names = set()
    for node in ast.walk(ast.parse(python)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module.split(".")[0])
    return names


def runtime_distributions(requirements: Path = ROOT / "requirements.txt") -> set[str]:
    """requirements.txt's distributions and everything they depend on (what `make demo` installs)."""
    todo = ["minillm"]
    for line in requirements.read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            todo.append(Requirement(line).name)
    seen: set[str] = set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def missing_after_demo(modules: set[str], installed: set[str]) -> set[str]:
    """The modules that neither the standard library nor the runtime distributions provide."""
    providers = metadata.packages_distributions()
    return {m for m in modules if m not in sys.stdlib_module_names
            and not {canonicalize_name(d) for d in providers.get(m, [m])} & installed}


def test_the_import_check_catches_a_test_only_import():
    installed = runtime_distributions()
    assert missing_after_demo({"torch", "json", "minillm", "matplotlib"}, installed) == set()
    assert missing_after_demo({"transformers", "openai", "pytest"}, installed) == {"transformers", "openai", "pytest"}


notebook_param = pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])


@notebook_param
def test_notebook_runs_after_make_demo(path):
    code = "\n".join(src for kind, src in cells(path) if kind == "code")
    missing = missing_after_demo(imported_modules(code), runtime_distributions())
    assert not missing, f"{path.name} imports {sorted(missing)}, which requirements.txt does not install"


@notebook_param
def test_notebook_points_at_nothing_outside_the_repository(path):
    text = "\n".join(src for _, src in cells(path))
    outside = re.findall(r"(?:\.\./shared|/work/|shared/seeds)\S*", text)
    assert not outside, f"{path.name} refers to files outside the repository: {outside[:3]}"


@notebook_param
def test_prose_leads(path):
    sizes = {"markdown": 0, "code": 0}
    for kind, src in cells(path):
        if kind in sizes:
            sizes[kind] += len(src)
    share = sizes["markdown"] / max(sum(sizes.values()), 1)
    assert share >= MIN_PROSE, f"{path.name}: {share:.0%} of the source is prose, want >= {MIN_PROSE:.0%}"


def lesson_cell_lengths(path: Path) -> list[tuple[int, str]]:
    """(lines, first line) of each code cell outside a section whose heading says 'Plumbing'."""
    lengths, plumbing = [], False
    for kind, src in cells(path):
        if kind == "markdown" and re.match(r"#+ ", src):
            plumbing = "plumbing" in src.splitlines()[0].lower()
        elif kind == "code" and not plumbing:
            lines = [l for l in src.splitlines() if l.strip() and not l.strip().startswith(("#|", "### BEGIN SOLUTION", "### END SOLUTION"))]
            lengths.append((len(lines), lines[0] if lines else ""))
    return lengths


@notebook_param
def test_lesson_cells_are_small_steps(path):
    long = [(n, first) for n, first in lesson_cell_lengths(path) if n > MAX_LESSON_LINES]
    assert not long, f"{path.name}: lesson cells over {MAX_LESSON_LINES} lines (move checks to a Plumbing section, or split): {long}"


GOALS = ("**Learning goals.**", "**Prerequisites.**", "**Time.**")


@notebook_param
def test_notebook_opens_with_goals_prerequisites_and_time(path):
    """The cell after the title says what the student will understand, what it assumes and how long
    it takes (reading and running), so a student can plan a session (issue 44)."""
    markdown = [src for kind, src in cells(path) if kind == "markdown"]
    opening = markdown[0] + "\n" + (markdown[1] if len(markdown) > 1 else "")
    missing = [g for g in GOALS if g not in opening]
    assert not missing, f"{path.name}: the opening (title cell or the one after) lacks {missing}"


@notebook_param
def test_notebook_closes_with_three_to_five_key_ideas(path):
    """A `## Key ideas` section near the end: three to five ideas to keep, in words."""
    sources = cells(path)
    found = [i for i, (kind, src) in enumerate(sources) if kind == "markdown" and src.startswith("## Key ideas")]
    assert len(found) == 1, f"{path.name}: want one '## Key ideas' cell, found {len(found)}"
    bullets = [l for l in sources[found[0]][1].splitlines() if re.match(r"[-*] |\d+\. ", l)]
    assert 3 <= len(bullets) <= 5, f"{path.name}: Key ideas has {len(bullets)} bullets, want 3 to 5"
    assert found[0] >= len(sources) - 6, f"{path.name}: Key ideas is cell {found[0]} of {len(sources)}, want it among the last"


def notebook_minutes(path: Path) -> int:
    """The first number of the opening's `**Time.**` line: the minutes to read and run it."""
    for kind, src in cells(path)[:3]:
        for line in src.splitlines():
            if kind == "markdown" and line.startswith("**Time.**"):
                return int(re.search(r"\d+", line).group())
    raise AssertionError(f"{path.name}: no **Time.** line in the opening")


def test_course_map_lists_every_notebook_with_its_time():
    """The README's course map is the one page a student plans with: every lesson and appendix,
    linked, with the time its own opening states (so the two cannot drift apart)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| \w\w \| \[[^\]]+\]\(notebooks/([\w\-]+\.ipynb)\) \|.*\| (\d+) min \|$", readme, re.M))
    for path in NOTEBOOKS:
        assert path.name in rows, f"README's course map has no row for {path.name} (with its time, 'N min')"
        assert int(rows[path.name]) == notebook_minutes(path), f"README gives {path.name} {rows[path.name]} min, its opening {notebook_minutes(path)}"
