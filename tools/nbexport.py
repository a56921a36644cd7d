"""Export notebook cells into the minillm package (standard library only).

Markup (compatible with nbdev):
    #| default_exp attention   in a code cell: this notebook writes minillm/attention.py
    #| export                  on a code cell: the cell's code belongs in that module
    ### BEGIN SOLUTION         nbgrader-style marker lines around an exercise's solution
    ### END SOLUTION           (tools/make_exercises.py); the module drops these two lines

Usage:
    python tools/nbexport.py            write every module from its notebook
    python tools/nbexport.py --check    list stale modules and exit 1 if any differ
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_DEFAULT_EXP = re.compile(r"^#\|\s*default_exp\s+(\S+)\s*$")
_EXPORT = re.compile(r"^#\|\s*export[is]?\s*$")  # nbdev's export, exporti, exports
_DIRECTIVE = re.compile(r"^#\|")
_SOLUTION = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$")
HEADER_PREFIX = "# Generated from "


class ExportError(Exception):
    """A notebook's export markup is wrong (names the notebook)."""


def _cell_source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def module_text(notebook: Path, root: Path = ROOT) -> tuple[str, str] | None:
    """Return (module name, module text) for a notebook, or None if it exports nothing."""
    try:
        nb = json.loads(notebook.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"{notebook}: cannot read notebook JSON: {exc}") from exc
    module = None
    chunks: list[str] = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        lines = _cell_source(cell).splitlines()
        directives = [line for line in lines if _DIRECTIVE.match(line)]
        for line in directives:
            match = _DEFAULT_EXP.match(line)
            if match:
                if module is not None and module != match.group(1):
                    raise ExportError(
                        f"{notebook}: two default_exp directives ({module!r} and {match.group(1)!r})"
                    )
                module = match.group(1)
        if any(_EXPORT.match(line) for line in directives):
            kept = [line for line in lines if not _DIRECTIVE.match(line) and not _SOLUTION.match(line)]
            code = "\n".join(kept).strip("\n")
            if code:
                chunks.append(code)
    if not chunks:
        return None
    if module is None:
        raise ExportError(
            f"{notebook}: has #| export cells but no '#| default_exp <module>' directive"
        )
    if not re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*", module):
        raise ExportError(f"{notebook}: default_exp {module!r} is not a valid module name")
    rel = notebook.relative_to(root).as_posix()
    header = f"{HEADER_PREFIX}{rel} by tools/nbexport.py: edit the notebook, not this file.\n"
    return module, header + "\n" + "\n\n\n".join(chunks) + "\n"


def module_path(module: str, root: Path = ROOT) -> Path:
    return (root / "minillm").joinpath(*module.split(".")).with_suffix(".py")


def collect(root: Path = ROOT) -> dict[Path, tuple[Path, str]]:
    """Map each module path to (its notebook, its text); two notebooks writing one module is an error."""
    modules: dict[Path, tuple[Path, str]] = {}
    for notebook in sorted((root / "notebooks").glob("*.ipynb")):
        result = module_text(notebook, root)
        if result is None:
            continue
        name, text = result
        path = module_path(name, root)
        if path in modules:
            raise ExportError(
                f"{notebook}: module {name!r} is already exported by {modules[path][0]}"
            )
        modules[path] = (notebook, text)
    return modules


def stale(modules: dict[Path, tuple[Path, str]], root: Path = ROOT) -> list[str]:
    """Describe each module whose file differs from its notebook, and generated modules no notebook makes."""
    problems = []
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
    args = parser.parse_args(argv)
    root = args.root.resolve()
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
    for path, (notebook, text) in modules.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(root)} from {notebook.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
