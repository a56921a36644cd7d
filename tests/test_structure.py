"""The package's shape, read from its source with ast: layers that import only downward, no
import cycle, no import inside a function (but the documented optional ones), short modules.

The layers are drawn in the README ("How the code is organised"); a new module must be placed
in one of them here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minillm"

LAYERS = {  # bottom to top: a module imports from its own layer or the ones below, never above
    "primitives": {"tensor", "devices", "grammar", "constrained", "tools", "gguf_file", "chat_template", "attention", "rope", "layers", "sampling", "tokenizer", "embedded", "diagram"},
    "model and storage": {"model", "kv_cache", "paged_checks", "paged_cache", "paged_attention", "packed", "hub", "weights", "quant", "cpu_kernel_cpp", "cpu_kernel", "lora", "tensor_parallel"},
    "runtime": {"fast", "generate", "sequence", "engine", "evaluate", "speculative", "speculative_engine", "tp_runtime"},
    "front doors": {"api", "server", "server_ops", "openai_protocol", "__main__", "bench", "bench_engine", "bench_speculative", "bench_lora", "bench_serve", "bench_paged", "bench_tp", "bench_peers", "roofline", "check", "check_harness", "check_model", "check_loading", "check_serving", "check_explore", "check_engine", "check_first_versions", "check_speculative", "check_lora",
                    "__init__"},
}
LEVEL = {module: level for level, modules in enumerate(LAYERS.values()) for module in modules}

# Imports that may sit inside a function, each for a reason written beside it in the module.
IMPORTED_ON_USE = {
    ("bench", "transformers"),  # the peer, installed for tests and benchmarks only
    ("bench", "transformers.utils"),
    ("bench_lora", "peft"),
    ("bench_peers", "llama_cpp"),  # llama.cpp, the optional peer of the decode section (pip install llama-cpp-python)  # the peer of the lora section, installed for tests and benchmarks only
    ("bench_serve", "transformers"),  # the peers of the serve section, installed for tests and benchmarks only
    ("cpu_kernel", "torch.utils.cpp_extension"),  # the C++ builder, loaded only to build the kernel
    ("cpu_kernel", "ninja"),  # the pip package's build tool, only where none is on PATH
    ("hub", "huggingface_hub"),  # reads HF_HOME / HF_ENDPOINT when first imported
    ("hub", "huggingface_hub.errors"),
}

MAX_LINES = 450


def modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(encoding="utf-8"), str(path)) for path in sorted(PACKAGE.glob("*.py"))}


def imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """Full module names an import statement reads (`from minillm import api` -> minillm.api)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative imports are not used in this package
        return [f"<relative {node.module}>"]
    if node.module == "minillm":
        return [f"minillm.{alias.name}" for alias in node.names]
    return [node.module]


def minillm_imports(tree: ast.Module) -> set[str]:
    return {name.split(".")[1] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for name in imported(node) if name.startswith("minillm.")}


def test_every_module_has_a_layer():
    assert set(modules()) == set(LEVEL), "place new modules in LAYERS (and the README's drawing)"


def test_imports_go_only_downward():
    upward = [f"{name} ({level_name(name)}) imports {dep} ({level_name(dep)})"
              for name, tree in modules().items() for dep in sorted(minillm_imports(tree)) if LEVEL[dep] > LEVEL[name]]
    assert upward == []


def level_name(module: str) -> str:
    return list(LAYERS)[LEVEL[module]]


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
    graph = {name: minillm_imports(tree) - {name} for name, tree in modules().items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


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


@pytest.mark.parametrize("name", sorted(LEVEL))
def test_module_length(name):
    lines = len((PACKAGE / f"{name}.py").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"minillm/{name}.py has {lines} lines"
