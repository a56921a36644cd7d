"""The package's shape, read from its source with ast: folders in layers that import only
downward, no import cycle, no import inside a function (but the documented optional ones), short
modules.

The layers are drawn in docs/architecture.md; a new folder must be placed in one of them here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minillm"

# Bottom to top. A module imports from its own folder or from a folder of a lower layer, never from
# a folder beside it or above it. The top-level modules (api, __main__, __init__) are placed too.
LAYERS = [
    {"utils"},             # the notebooks' diagrams, the boundary checks
    {"model"},             # tensors, attention, RoPE, norms and MLP, the decoder
    {"weights", "cache"},  # files in; the KV cache, dense, paged and packed
    {"text", "speed"},     # tokenizer, template, grammar; quantization, the CPU kernel, the fast path
    {"runtime"},           # sampling, generation, the engine, speculative decoding
    {"parallel"},          # tensor parallelism
    {"api"},               # minillm.load and LLM
    {"serve"},             # the OpenAI-compatible server
    {"bench"},             # the benchmark (it measures the server too)
    {"check", "__main__"}, # the student's checks (they use the benchmark's helpers); the CLI
    {"__init__"},
]
LEVEL = {folder: level for level, folders in enumerate(LAYERS) for folder in folders}

# Imports that may sit inside a function, each for a reason written beside it in the module.
IMPORTED_ON_USE = {
    ("bench.cli", "transformers"),  # the peer, installed for tests and benchmarks only
    ("bench.cli", "transformers.utils"),
    ("bench.lora", "peft"),  # the peer of the lora section, installed for tests and benchmarks only
    ("bench.peers", "llama_cpp"),  # llama.cpp, the optional peer of the decode section (pip install llama-cpp-python)
    ("bench.serve", "transformers"),  # the peers of the serve section, installed for tests and benchmarks only
    ("check.lm_eval", "lm_eval"),  # lm-evaluation-harness, imported once behind a clear ImportError (test-only)
    ("speed.cpu_kernel", "torch.utils.cpp_extension"),  # the C++ builder, loaded only to build the kernel
    ("text.grammar", "jsonschema"),  # its import compiles a Lark grammar (IRI formats): 1.3 s of every start-up
    ("speed.cpu_kernel", "ninja"),  # the pip package's build tool, only where none is on PATH
    ("weights.hub", "huggingface_hub"),  # reads HF_HOME / HF_ENDPOINT when first imported
    ("weights.hub", "huggingface_hub.errors"),
}

MAX_LINES = 450


def module_name(path: Path) -> str:
    """minillm/cache/paged.py -> 'cache.paged'; minillm/check/__init__.py -> 'check'; minillm/api.py -> 'api'."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(path): ast.parse(path.read_text(encoding="utf-8"), str(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


def folder(module: str) -> str:
    """The layer unit a module belongs to: its folder, or itself at the top of the package."""
    return module.split(".")[0]


def imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """Full module names an import statement reads (`from minillm.cache import paged` -> minillm.cache.paged)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative imports are not used in this package
        return [f"<relative {node.module}>"]
    if node.module and node.module.startswith("minillm"):
        return [f"{node.module}.{alias.name}" for alias in node.names]
    return [node.module]


def minillm_imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules a module imports (a name imported from a module counts as that module)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in imported(node):
                if name.startswith("minillm."):
                    dotted = name.removeprefix("minillm.")
                    while dotted and dotted not in known:
                        dotted = dotted.rpartition(".")[0]
                    found.add(dotted or "__init__")
    return found


def graph() -> dict[str, set[str]]:
    trees = modules()
    known = set(trees) | {"__init__"}
    return {name: minillm_imports(tree, known) - {name} for name, tree in trees.items()}


def test_every_folder_has_a_layer_and_an_init():
    folders = {folder(name) for name in modules()}
    assert folders == set(LEVEL), "place new folders in LAYERS (and docs/architecture.md's drawing)"
    missing = [p.parent.name for p in PACKAGE.rglob("*.py") if not (p.parent / "__init__.py").exists()]
    assert missing == []


def wrong_imports(imports: dict[str, set[str]]) -> list[str]:
    """Each import of a module in a folder beside or above the importer's."""
    return [f"{name} imports {dep}" for name, deps in imports.items() for dep in sorted(deps)
            if folder(dep) != folder(name) and LEVEL[folder(dep)] >= LEVEL[folder(name)]]


def test_imports_go_only_downward():
    assert wrong_imports(graph()) == []


def test_the_layer_check_catches_sideways_and_upward_imports():  # the rule itself, on planted imports
    planted = {"cache.paged": {"weights.lora", "model.attention"}, "model.decoder": {"runtime.engine"},
               "runtime.engine": {"model.decoder", "runtime.sequence"}}
    assert wrong_imports(planted) == ["cache.paged imports weights.lora", "model.decoder imports runtime.engine"]
    tree = ast.parse("from minillm.weights import lora\nfrom minillm.runtime.engine import Engine\nimport minillm\n")
    assert minillm_imports(tree, {"weights.lora", "runtime.engine"}) == {"weights.lora", "runtime.engine"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of modules that import each other in a circle, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_finds_one():  # the checker itself, on a planted cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_inside_a_function():
    inside = []
    for name, tree in modules().items():
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                inside += [f"{name}.py:{node.lineno} imports {dep}" for dep in imported(node)
                           if (name, dep) not in IMPORTED_ON_USE]
    assert inside == []


@pytest.mark.parametrize("path", sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")))
def test_module_length(path):
    lines = len((PACKAGE / path).read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"minillm/{path} has {lines} lines"


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_ruff_check_passes():
    """The linter as pyproject.toml configures it, over the package, tests, tools and notebooks."""
    result = ruff(".")
    assert result.returncode == 0, result.stdout[-4000:]


def test_ruff_check_catches_a_planted_fault():  # the same configuration, on an undefined name
    result = ruff("--stdin-filename", "minillm/planted.py", "-", stdin="def f():\n    return undefined_name\n")
    assert result.returncode == 1 and "F821" in result.stdout


def test_tests_mirror_the_package_folders():
    """tests/cache/ tests minillm/cache/, and so on; tests of the project as a whole stay in tests/."""
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders and folders <= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


def test_the_front_door_names():
    """`import minillm` gives load, LLM and SamplingParams, the objects the README's example uses."""
    import minillm
    from minillm.api import LLM, load
    from minillm.runtime.sampling import SamplingParams

    assert (minillm.load, minillm.LLM, minillm.SamplingParams) == (load, LLM, SamplingParams)
    assert sorted(minillm.__all__) == ["LLM", "SamplingParams", "load"]
