"""Write the exercise notebooks exercises/NN_x.ipynb from the reference notebooks (standard library only).

In a reference notebook, the lesson's code sits between nbgrader-style marker lines:

    def rms_norm(x, weight, eps):
        \"\"\"...\"\"\"
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

Every notebook with such markers gets an exercise version in which:
- each solution region becomes `raise NotImplementedError("exercise: implement <name>; ...")`
  at the region's indentation (the def line, docstring and argument checks stay);
- a check cell `from minillm import check; check.<name>(<function or class>)` follows each cell
  with a stub;
- `#| export` / `#| default_exp` directives are removed (students' code is never exported); the
  cells that were exported are tagged `module` (`python -m minillm.check` runs those);
- imports of the notebook's own module from minillm are dropped: the notebook defines those names;
- outputs and execution counts are cleared (exercise notebooks are not executed in CI);
- the notebook metadata records the stubs: metadata["minillm"]["stubs"].

Usage:
    python tools/make_exercises.py           write exercises/*.ipynb
    python tools/make_exercises.py --check   list stale or missing exercise notebooks, exit 1 if any
    python tools/make_exercises.py --only notebooks/05_model.ipynb   write only that notebook's exercise
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling tool, whether run or loaded by path
from nbexport import DIRECTIVE, EXPORT, module_texts  # the export markup has one home

ROOT = Path(__file__).resolve().parent.parent

_BEGIN = re.compile(r"^(\s*)### BEGIN SOLUTION\s*$")
_END = re.compile(r"^\s*### END SOLUTION\s*$")
_DEF = re.compile(r"^(\s*)(?:async\s+)?def\s+(\w+)")
_CLASS = re.compile(r"^(\s*)class\s+(\w+)")


class ExerciseError(Exception):
    """A reference notebook's solution markers are wrong (names the notebook and cell)."""


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _enclosing(lines: list[str], i: int, where: str) -> str:
    """Name of the function holding line i: `f`, or `Class.method` for a method."""
    width = _indent(lines[i])
    for j in range(i - 1, -1, -1):
        m = _DEF.match(lines[j])
        if m and len(m.group(1)) < width:
            name, def_width = m.group(2), len(m.group(1))
            for k in range(j - 1, -1, -1):
                c = _CLASS.match(lines[k])
                if c and len(c.group(1)) < def_width:
                    return f"{c.group(2)}.{name}"
                if lines[k].strip() and _indent(lines[k]) < def_width and not c:
                    break
            return name
    raise ExerciseError(f"{where}: '### BEGIN SOLUTION' outside a function")


def stub_cell(source: str, where: str) -> tuple[str, list[str]]:
    """Replace each solution region with a NotImplementedError; return (new source, stub names)."""
    lines = source.splitlines()
    out: list[str] = []
    stubs: list[str] = []
    i = 0
    while i < len(lines):
        m = _BEGIN.match(lines[i])
        if not m:
            if _END.match(lines[i]):
                raise ExerciseError(f"{where}: '### END SOLUTION' without a BEGIN")
            out.append(lines[i])
            i += 1
            continue
        name = _enclosing(lines, i, where)
        end = next((j for j in range(i + 1, len(lines)) if _END.match(lines[j]) or _BEGIN.match(lines[j])), None)
        if end is None or _BEGIN.match(lines[end]):
            raise ExerciseError(f"{where}: '### BEGIN SOLUTION' in {name} has no matching END")
        out.append(f'{m.group(1)}raise NotImplementedError("exercise: implement {name}; see the hint above")')
        stubs.append(name)
        i = end + 1
    return "\n".join(out), stubs


def check_name(stub: str) -> str:
    """The minillm.check function for a stub: `rms_norm`, `KVCache.update` -> `kv_cache_update`."""
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", stub))
    return words.replace(".", "_").lower()


def _code(source: str, tags: list[str] | None = None) -> dict:
    cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
            "source": source.splitlines(keepends=True)}
    if tags:
        cell["metadata"]["tags"] = tags
    return cell


def _markdown(source: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": source.splitlines(keepends=True)}


def exercise_notebook(notebook: Path, root: Path = ROOT) -> dict | None:
    """The exercise version of a reference notebook, or None if it has no solution markers."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    rel = notebook.relative_to(root).as_posix()
    modules = set(module_texts(notebook, root))  # what this notebook exports: the exercise defines those names itself
    own_import = (re.compile(rf"^from minillm\.({'|'.join(map(re.escape, sorted(modules)))}) import [\w, ]+$")
                  if modules else None)
    cells: list[dict] = []
    all_stubs: list[str] = []
    for n, cell in enumerate(nb.get("cells", [])):
        src = _source(cell)
        if cell.get("cell_type") != "code":
            cells.append({"cell_type": cell["cell_type"], "metadata": {}, "source": src.splitlines(keepends=True)})
            continue
        lines = src.splitlines()
        exported = any(EXPORT.match(line) for line in lines)
        lines = [line for line in lines if not DIRECTIVE.match(line)]
        lines = [line for line in lines if not (own_import and own_import.match(line))]
        src, stubs = stub_cell("\n".join(lines).strip("\n"), f"{rel} cell {n}")
        if not src.strip():
            continue  # a cell that held only directives
        cells.append(_code(src, ["module"] if exported else None))
        if stubs:
            all_stubs += stubs
            calls = "\n".join(f"check.{check_name(s)}({s.split('.')[0]})" for s in stubs)
            cells.append(_code(f"from minillm import check\n\n{calls}"))
    if not all_stubs:
        return None
    listing = "\n".join(f"- `{s}`" for s in all_stubs)
    intro = _markdown(
        f"**Exercise notebook.** Generated from `{rel}` by `tools/make_exercises.py`; don't edit it by hand "
        f"(teachers: edit the reference notebook and regenerate).\n\n"
        f"Implement, in order:\n{listing}\n\n"
        "Each one raises `NotImplementedError` until you replace that line with your code. Read the prose and "
        "hints above each function, then run the check cell below it: it prints PASS, or FAIL with the first "
        "wrong element and the likely cause. The cells after a function use it, so they work once it passes. "
        f"To check them all at once: `python -m minillm.check exercises/{notebook.name}`."
    )
    first_md = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"), -1)
    cells.insert(first_md + 1, intro)
    for i, c in enumerate(cells):
        c["id"] = f"cell-{i:03d}"
    metadata = {  # not the reference's language_info: executing it there must not make these stale
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "minillm": {"exercise_of": rel, "stubs": all_stubs},
    }
    return {"cells": cells, "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}


def render(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def collect(root: Path = ROOT) -> dict[Path, str]:
    """Map each exercise notebook path to its text."""
    out = {}
    for notebook in sorted((root / "notebooks").glob("*.ipynb")):
        nb = exercise_notebook(notebook, root)
        if nb is not None:
            out[root / "exercises" / notebook.name] = render(nb)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if an exercise notebook is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="project folder (default: this repo)")
    parser.add_argument("--only", type=Path, action="append", help="write only this notebook's exercise (repeatable)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    only = {path.name for path in args.only or []}
    try:
        wanted = collect(root)
    except (ExerciseError, json.JSONDecodeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        problems = []
        for path, text in wanted.items():
            rel = path.relative_to(root)
            if not path.exists():
                problems.append(f"{rel}: missing (run: python tools/make_exercises.py)")
            elif path.read_text(encoding="utf-8") != text:
                problems.append(f"{rel}: differs from its reference notebook (run: python tools/make_exercises.py)")
        for path in sorted((root / "exercises").glob("*.ipynb")):
            if path not in wanted:
                problems.append(f"{path.relative_to(root)}: no reference notebook has solution markers for it (delete it?)")
        for line in problems:
            print(line)
        return 1 if problems else 0
    for path, text in wanted.items():
        if only and path.name not in only:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
