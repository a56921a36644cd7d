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
- each cell with a stub is followed by the stub's Hint (see `hint NAME` below), then a check cell
  `from minillm import check; check.<name>(<function or class>)`;
- `#| export` / `#| default_exp` directives are removed (students' code is never exported); the
  cells that were exported are tagged `module` (`python -m minillm.check` runs those), and so is a
  lesson cell with a stub (a first version, like notebook 02's naive_attention), which must then
  hold only imports and definitions;
- imports of the notebook's own module from minillm are dropped: the notebook defines those names;
- outputs and execution counts are cleared (exercise notebooks are not executed in CI);
- the notebook metadata records the stubs: metadata["minillm"]["stubs"].

Exploration tasks: a question answered by a measurement and a sentence. In a cell that is not
exported, a solution region at the top level (indentation 0, outside any function) is the
measurement; it is named by the last name it assigns at its top level, its answer (`crossover`):

    ### BEGIN SOLUTION
    per_token = 2 * config.num_hidden_layers * ...
    crossover = math.ceil(weights / per_token)
    ### END SOLUTION

It becomes `raise NotImplementedError("exercise: compute crossover; see the Hint below")`; it needs
a `hint crossover` cell like a stub (placed after it), but no check cell is added: the reference
notebook writes its own, `check.explore_crossover(crossover)` (minillm/check/explore.py), which
computes the reference number itself. Explorations are recorded in metadata["minillm"]["explore"],
not in "stubs" (`python -m minillm.check` runs only the exported cells; the sentence is for a
teacher to read). In a markdown cell, the lines between `<!-- BEGIN SOLUTION -->` and
`<!-- END SOLUTION -->` (the reference's answer sentence) become `*(your answer here)*`.

Marker lines: a reference cell whose FIRST line is an exercise marker is handled specially (the
marker line itself never reaches the exercise). In a code cell the marker is a comment, in a
markdown cell an HTML comment (invisible when the reference notebook is rendered):

    # exercise: drop                        <!-- exercise: drop -->
    # exercise: collapse
    # exercise: after check NAME            <!-- exercise: after check NAME -->
    # exercise: after check NAME, collapsed
                                            <!-- exercise: hint NAME -->

- `drop`: the cell is left out of the exercise. Use it for a cell that computes what a stub must
  compute (a worked version, a near-answer with one planted bug) when no later cell needs it.
- `collapse` (code only): the cell stays where it is, its source collapsed in the exercise (metadata
  jupyter.source_hidden). The fallback for a leaking cell that can be neither dropped nor moved
  because cells above the check need it; the student sees its output and opens it with a click.
- `after check NAME`: the cell goes right below NAME's check cell (it stays where it is if it is
  already below it). Use it for a leaking cell that later cells need, and for the cells that must
  travel with it (its prose, cells that use what it defines): moved cells keep their order.
- `after check NAME, collapsed`: the same, and the code cell's source is collapsed in the
  exercise (metadata jupyter.source_hidden): the leaking cell itself, so that the answer is not in
  plain sight of a student scrolling down, and one click away once they have passed the check.
- `hint NAME` (markdown only): the hint for stub NAME: where to look (which equation, which
  cell, which torch function family), never the code. Write it next to the lesson, right after
  the cell with the solution, as a collapsed block:

      <!-- exercise: hint rms_norm -->
      <details><summary>Hint</summary>

      The four steps of the recipe above ...

      </details>

  In the exercise it is placed after the stub's cell, before the check cell (a body without
  `<details>` is wrapped in one). Every stub needs exactly one hint: a missing one is an error.
  The stub's NotImplementedError says "see the Hint below".

Markers are validated: an unknown NAME, a `drop`, `collapse` or `after check` on an exported cell,
a stub without a hint, or a move/drop that changes which cell provides a name that another
exercise cell reads (a NameError or a silently different value when the student runs it) are
errors that name the notebook and cell.

Usage:
    python tools/make_exercises.py           write exercises/*.ipynb
    python tools/make_exercises.py --check   list stale or missing exercise notebooks, exit 1 if any
    python tools/make_exercises.py --only notebooks/05_model.ipynb   write only that notebook's exercise
"""

from __future__ import annotations

import argparse
import ast
import builtins
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
_ACTION = r"exercise:\s*(drop|collapse|after check\s+[\w.]+(?:,\s*collapsed)?|hint\s+[\w.]+)"
_MARKER = {"code": re.compile(rf"^#\s*{_ACTION}\s*$"), "markdown": re.compile(rf"^<!--\s*{_ACTION}\s*-->\s*$")}
SEE_HINT = "see the Hint below"


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


_MD_BEGIN = re.compile(r"^\s*<!--\s*BEGIN SOLUTION\s*-->\s*$")
_MD_END = re.compile(r"^\s*<!--\s*END SOLUTION\s*-->\s*$")
YOUR_ANSWER = "*(your answer here)*"


def _answer_name(region: list[str], where: str) -> str:
    """The last name a top-level solution region (an exploration) assigns at its top level."""
    try:
        tree = ast.parse("\n".join(region))
    except SyntaxError as exc:
        raise ExerciseError(f"{where}: a top-level solution region does not parse: {exc}") from None
    names = [t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)]
    if not names:
        raise ExerciseError(f"{where}: a top-level solution region assigns no name (its answer)")
    return names[-1]


def answer_markdown(source: str, where: str) -> str:
    """A markdown cell with its `<!-- BEGIN SOLUTION -->` ... `<!-- END SOLUTION -->` lines replaced."""
    if "SOLUTION" not in source:
        return source
    out: list[str] = []
    inside = False
    for line in source.splitlines():
        if _MD_BEGIN.match(line):
            if inside:
                raise ExerciseError(f"{where}: '<!-- BEGIN SOLUTION -->' inside another")
            inside = True
            out.append(YOUR_ANSWER)
        elif _MD_END.match(line):
            if not inside:
                raise ExerciseError(f"{where}: '<!-- END SOLUTION -->' without a BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ExerciseError(f"{where}: '<!-- BEGIN SOLUTION -->' has no matching END")
    return "\n".join(out)


def stub_cell(source: str, where: str, explore: list[str] | None = None) -> tuple[str, list[str]]:
    """Replace each solution region with a NotImplementedError; return (new source, stub names).

    explore: where to append the answer names of top-level regions (explorations); without it they are errors.
    """
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
        top = explore is not None and not m.group(1)  # indentation 0: outside any function
        name = "" if top else _enclosing(lines, i, where)
        end = next((j for j in range(i + 1, len(lines)) if _END.match(lines[j]) or _BEGIN.match(lines[j])), None)
        if end is None or _BEGIN.match(lines[end]):
            raise ExerciseError(f"{where}: '### BEGIN SOLUTION' in {name or 'a top-level region'} has no matching END")
        if top:
            name = _answer_name(lines[i + 1:end], where)
            out.append(f'raise NotImplementedError("exercise: compute {name}; {SEE_HINT}")')
            explore.append(name)
        else:
            out.append(f'{m.group(1)}raise NotImplementedError("exercise: implement {name}; {SEE_HINT}")')
            stubs.append(name)
        i = end + 1
    return "\n".join(out), stubs


def _check_definitions_only(source: str, where: str) -> None:
    """A lesson cell (not exported) with a stub is tagged `module` too, so `python -m minillm.check` runs
    it with the module cells: it must hold only imports and definitions, not a demonstration."""
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            raise ExerciseError(f"{where}: a cell with a stub holds only imports and definitions (python -m "
                                f"minillm.check runs it); move line {node.lineno} to a cell of its own below")


def check_name(stub: str) -> str:
    """The minillm.check function for a stub: `rms_norm`, `KVCache.update` -> `kv_cache_update`,
    `MultiLoRALinear.forward` -> `multi_lora_linear_forward` (LoRA is one word)."""
    stub = stub.replace("LoRA", "Lora")
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


def marker(cell: dict) -> tuple[str, str | None, str]:
    """(action, NAME or None, source without the marker line) of a cell; action '' when unmarked.

    action: 'drop', 'collapse', 'after check', 'after check, collapsed', 'hint' or ''.
    """
    src = _source(cell)
    first, _, rest = src.partition("\n")
    pattern = _MARKER.get(cell.get("cell_type", ""))
    m = pattern.match(first.strip()) if pattern else None
    if not m:
        return "", None, src
    words = m.group(1).replace(",", " ").split()
    if words[0] == "after":
        return "after check" + (", collapsed" if words[-1] == "collapsed" else ""), words[2], rest.lstrip("\n")
    return words[0], words[1] if len(words) > 1 else None, rest.lstrip("\n")


def _names(source: str) -> tuple[set[str], set[str]]:
    """(names a code cell binds at its top level, global names it reads that it does not bind): for moves.

    Imported names count as bound by no cell (re-importing a module gives the same module).
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set(), set()
    stores: set[str] = set()
    reads: set[str] = set()
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)

    def local_names(fn) -> set[str]:
        args = fn.args if not isinstance(fn, ast.ClassDef) else None
        out = {a.arg for a in (args.posonlyargs + args.args + args.kwonlyargs) if a} if args else set()
        if args:
            out |= {a.arg for a in (args.vararg, args.kwarg) if a}
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, scopes) and node is not fn and not isinstance(node, ast.Lambda):
                out.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update((a.asname or a.name).split(".")[0] for a in node.names)
        return out

    def visit(node, local: set[str] | None):
        if isinstance(node, scopes):
            if local is None and not isinstance(node, ast.Lambda):
                stores.add(node.name)
            local = (local or set()) | local_names(node)
        elif isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Store):
                if local is None:
                    stores.add(node.id)
            elif local is None or node.id not in local:
                reads.add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child, local)

    visit(tree, None)
    imported = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    return stores - imported, reads - stores - imported - set(dir(builtins))


def _flow_problems(ref: list[tuple[int, str]], ex: list[tuple[int, str]], rel: str) -> list[str]:
    """Cells whose read names come from another cell in the exercise than in the reference.

    ref, ex: (reference cell index, code) in each notebook's order (ex: only reference cells).
    """
    info = {n: _names(src) for n, src in ref}

    def providers(order):
        out, last = {}, {}
        for n, _ in order:
            out[n] = {name: last.get(name) for name in info[n][1]}
            for name in info[n][0]:
                last[name] = n
        return out

    before, after = providers(ref), providers(ex)
    problems = []
    for n, _ in ex:
        for name, cell in sorted(after[n].items()):
            if cell != before[n][name]:
                problems.append(f"{rel} cell {n} reads `{name}` from cell {before[n][name]} in the reference "
                                f"but from cell {cell} in the exercise (mark the cells that go with it)")
    return problems


def _hint(source: str) -> str:
    body = source.strip("\n")
    return body if "<details>" in body else f"<details><summary>Hint</summary>\n\n{body}\n\n</details>"


def exercise_notebook(notebook: Path, root: Path = ROOT) -> dict | None:
    """The exercise version of a reference notebook, or None if it has no solution markers."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    rel = notebook.relative_to(root).as_posix()
    modules = set(module_texts(notebook, root))  # what this notebook exports: the exercise defines those names itself
    own_import = (re.compile(rf"^from minillm\.({'|'.join(map(re.escape, sorted(modules)))}) import [\w, ]+$")
                  if modules else None)
    ref_cells = nb.get("cells", [])
    hints: dict[str, str] = {}
    for n, cell in enumerate(ref_cells):  # hints first: each goes right after its stub's cell
        action, name, src = marker(cell)
        if action == "hint" and cell.get("cell_type") != "markdown":
            raise ExerciseError(f"{rel} cell {n}: a hint is a markdown cell")
        if action == "hint":
            if name in hints:
                raise ExerciseError(f"{rel} cell {n}: a second hint for {name}")
            hints[name] = _hint(src)
    cells: list[dict] = []
    all_stubs: list[str] = []
    all_explore: list[str] = []
    checked: set[str] = set()
    pending: dict[str, list[tuple[int, dict]]] = {}  # stub -> cells waiting for its check
    ref_code: list[tuple[int, str]] = []  # (reference index, code) in reference order, for the flow check
    placed: list[tuple[int, dict]] = []  # (reference index, cell) in exercise order

    def emit(n: int, cell: dict) -> None:
        cells.append(cell)
        placed.append((n, cell))

    for n, cell in enumerate(ref_cells):
        action, name, src = marker(cell)
        if action == "hint":
            continue
        if cell.get("cell_type") != "code":
            if cell.get("cell_type") == "markdown":
                src = answer_markdown(src, f"{rel} cell {n}")
            out = {"cell_type": cell["cell_type"], "metadata": {}, "source": src.splitlines(keepends=True)}
        else:
            lines = src.splitlines()
            exported = any(EXPORT.match(line) for line in lines)
            if exported and action:
                raise ExerciseError(f"{rel} cell {n}: '{action}' on an exported cell (the module needs it)")
            lines = [line for line in lines if not DIRECTIVE.match(line)]
            lines = [line for line in lines if not (own_import and own_import.match(line))]
            explored: list[str] = []
            src, stubs = stub_cell("\n".join(lines).strip("\n"), f"{rel} cell {n}", None if exported else explored)
            if not src.strip():
                continue  # a cell that held only directives
            ref_code.append((n, src))
            if action == "drop":
                continue
            if stubs and not exported:
                _check_definitions_only(src, f"{rel} cell {n}")
            out = _code(src, ["module"] if exported or stubs else None)
            if action in ("collapse", "after check, collapsed"):
                out["metadata"]["jupyter"] = {"source_hidden": True}
            if explored:
                if stubs or action:
                    raise ExerciseError(f"{rel} cell {n}: an exploration's cell holds no stub and no marker")
                emit(n, out)
                for s in explored:
                    if s not in hints:
                        raise ExerciseError(f"{rel} cell {n}: exploration {s} has no hint cell "
                                            f"(a markdown cell starting '<!-- exercise: hint {s} -->')")
                    cells.append(_markdown(hints[s]))
                all_explore += explored
                continue
            if stubs:
                emit(n, out)
                all_stubs += stubs
                for s in stubs:
                    if s not in hints:
                        raise ExerciseError(f"{rel} cell {n}: stub {s} has no hint cell "
                                            f"(a markdown cell starting '<!-- exercise: hint {s} -->')")
                    cells.append(_markdown(hints[s]))
                calls = "\n".join(f"check.{check_name(s)}({s.split('.')[0]})" for s in stubs)
                cells.append(_code(f"from minillm import check\n\n{calls}"))
                checked.update(stubs)
                for s in stubs:
                    for item in pending.pop(s, []):
                        emit(*item)
                continue
        if action == "drop":
            continue
        if action.startswith("after check") and name not in checked:
            pending.setdefault(name, []).append((n, out))
            continue
        emit(n, out)
    if not all_stubs:
        return None
    for name, waiting in pending.items():
        raise ExerciseError(f"{rel} cell {waiting[0][0]}: 'after check {name}', but {name} is not a stub above")
    for name in hints:
        if name not in all_stubs and name not in all_explore:
            raise ExerciseError(f"{rel}: a hint for {name}, which is not a stub")
    problems = _flow_problems(ref_code, [(n, "".join(c["source"])) for n, c in placed if c["cell_type"] == "code"], rel)
    if problems:
        raise ExerciseError("\n".join(problems))
    listing = "\n".join(f"- `{s}`" for s in all_stubs)
    intro = _markdown(
        f"**Exercise notebook.** Generated from `{rel}` by `tools/make_exercises.py`; don't edit it by hand "
        f"(teachers: edit the reference notebook and regenerate).\n\n"
        f"Implement, in order:\n{listing}\n\n"
        + (f"Explore (measure, then explain in a sentence below the check): "
           f"{', '.join(f'`{e}`' for e in all_explore)}.\n\n" if all_explore else "")
        + "Each one raises `NotImplementedError` until you replace that line with your code. Read the prose "
        "above each function; if you are stuck, open the **Hint** below it (it says where to look, not "
        "what to write). Then run the check cell below that: it prints PASS, or FAIL with the first wrong "
        "element and the likely cause. The cells after a function use it, so they work once it passes. A few "
        "cells that would give an answer away are collapsed (click to open) and come after the check where the "
        "lesson allows. "
        f"To check them all at once: `python -m minillm.check exercises/{notebook.name}`."
    )
    first_md = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"), -1)
    cells.insert(first_md + 1, intro)
    for i, c in enumerate(cells):
        c["id"] = f"cell-{i:03d}"
    metadata = {  # not the reference's language_info: executing it there must not make these stale
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "minillm": {"exercise_of": rel, "stubs": all_stubs, **({"explore": all_explore} if all_explore else {})},
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
