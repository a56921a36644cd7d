"""Export notebook cells into the minillm package (standard library only).

Markup (compatible with nbdev):
    #| default_exp model.attention  in a code cell: this notebook's module is minillm/model/attention.py
    #| export                       on a code cell: the cell's code belongs in that module
    #| export model.rope            on a code cell: the cell's code belongs in minillm/model/rope.py,
                                    so one notebook can teach one idea and put each piece where it belongs
    ### BEGIN SOLUTION              nbgrader-style marker lines around an exercise's solution
    ### END SOLUTION                (tools/make_exercises.py); the module drops these two lines
A dotted name is a module in a concept folder. Each folder is a package: a missing __init__.py is
written (a one-line docstring, to be replaced by hand), and --check reports one that is missing.

Usage:
    python tools/nbexport.py            write every module from its notebook
    python tools/nbexport.py --check    list stale modules and exit 1 if any differ
    python tools/nbexport.py --only notebooks/05_model.ipynb   write only that notebook's modules
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The markup, also read by tools/make_exercises.py.
DEFAULT_EXP = re.compile(r"^#\|\s*default_exp\s+(\S+)\s*$")
EXPORT = re.compile(r"^#\|\s*export[is]?(?:\s+(\S+))?\s*$")  # nbdev's export, exporti, exports [module]
DIRECTIVE = re.compile(r"^#\|")
SOLUTION = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$")
HEADER_PREFIX = "# Generated from "


class ExportError(Exception):
    """A notebook's export markup is wrong (names the notebook)."""


def _cell_source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def module_texts(notebook: Path, root: Path = ROOT) -> dict[str, str]:
    """Return {module name: module text} for every module a notebook exports ({} if none)."""
    try:
        nb = json.loads(notebook.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"{notebook}: cannot read notebook JSON: {exc}") from exc
    default = None
    exported: list[tuple[str | None, str]] = []  # (module, or None for the default one; code), in cell order
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        lines = _cell_source(cell).splitlines()
        directives = [line for line in lines if DIRECTIVE.match(line)]
        for line in directives:
            match = DEFAULT_EXP.match(line)
            if match:
                if default is not None and default != match.group(1):
                    raise ExportError(
                        f"{notebook}: two default_exp directives ({default!r} and {match.group(1)!r})"
                    )
                default = match.group(1)
        targets = {match.group(1) for match in map(EXPORT.match, directives) if match}
        if len(targets) > 1:
            raise ExportError(f"{notebook}: a cell exported to two modules: {sorted(map(str, targets))}")
        if targets:
            kept = [line for line in lines if not DIRECTIVE.match(line) and not SOLUTION.match(line)]
            code = "\n".join(kept).strip("\n")
            if code:
                exported.append((targets.pop(), code))
    if default is None and any(target is None for target, _ in exported):
        raise ExportError(
            f"{notebook}: has #| export cells but no '#| default_exp <module>' directive"
        )
    chunks: dict[str, list[str]] = {}
    for target, code in exported:
        chunks.setdefault(default if target is None else target, []).append(code)
    rel = notebook.relative_to(root).as_posix()
    header = f"{HEADER_PREFIX}{rel} by tools/nbexport.py: edit the notebook, not this file.\n"
    for name in chunks:
        if not re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*", name):
            raise ExportError(f"{notebook}: {name!r} is not a valid module name")
    return {name: header + "\n" + "\n\n\n".join(code) + "\n" for name, code in chunks.items()}


def module_path(module: str, root: Path = ROOT) -> Path:
    return (root / "minillm").joinpath(*module.split(".")).with_suffix(".py")


def collect(root: Path = ROOT) -> dict[Path, tuple[Path, str]]:
    """Map each module path to (its notebook, its text); two notebooks writing one module is an error."""
    modules: dict[Path, tuple[Path, str]] = {}
    for notebook in sorted((root / "notebooks").glob("*.ipynb")):
        for name, text in module_texts(notebook, root).items():
            path = module_path(name, root)
            if path in modules:
                raise ExportError(
                    f"{notebook}: module {name!r} is already exported by {modules[path][0]}"
                )
            modules[path] = (notebook, text)
    return modules


def package_inits(modules: dict[Path, tuple[Path, str]], root: Path = ROOT) -> list[Path]:
    """The __init__.py of every folder between minillm/ and a module, which makes it a package."""
    inits = set()
    for path in modules:
        folder = path.parent
        while folder != root / "minillm":
            inits.add(folder / "__init__.py")
            folder = folder.parent
    return sorted(inits)


def stale(modules: dict[Path, tuple[Path, str]], root: Path = ROOT) -> list[str]:
    """Describe each module whose file differs from its notebook, generated modules no notebook makes,
    and folders that are not packages."""
    problems = [f"{init.relative_to(root)}: missing (run: python tools/nbexport.py)"
                for init in package_inits(modules, root) if not init.exists()]
    for path in sorted((root / "minillm").rglob("*.py")):
        if path not in modules and path.read_text(encoding="utf-8").startswith(HEADER_PREFIX):
            problems.append(f"{path.relative_to(root)}: generated, but no notebook exports it (delete it?)")
    for path, (notebook, text) in modules.items():
        rel = path.relative_to(root)
        if not path.exists():
            problems.append(f"{rel}: missing (export {notebook.name})")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"{rel}: differs from {notebook.name} (run: python tools/nbexport.py)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a module is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="project folder (default: this repo)")
    parser.add_argument("--only", type=Path, action="append", help="write only this notebook's modules (repeatable)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    only = {path.name for path in args.only or []}
    try:
        modules = collect(root)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        problems = stale(modules, root)
        for line in problems:
            print(line)
        return 1 if problems else 0
    for init in package_inits(modules, root):
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(f'"""minillm.{init.parent.name}: modules built in the notebooks."""\n', encoding="utf-8")
            print(f"wrote {init.relative_to(root)}")
    for path, (notebook, text) in modules.items():
        if only and notebook.name not in only:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(root)} from {notebook.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
