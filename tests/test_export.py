"""The notebook -> package exporter (tools/nbexport.py): the repo is in sync, and the
exporter itself does what it promises, on small notebooks written into a temporary project."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT


def load_nbexport():
    """tools/ is not a package: import tools/nbexport.py by path."""
    spec = importlib.util.spec_from_file_location("nbexport", ROOT / "tools" / "nbexport.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nbexport = load_nbexport()


def test_repo_modules_match_their_notebooks():
    result = subprocess.run(
        [sys.executable, "tools/nbexport.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- a temporary project


def code(source: str) -> dict:
    return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
            "source": source.splitlines(keepends=True)}


def markdown(source: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": source.splitlines(keepends=True)}


def write_notebook(root: Path, name: str, cells: list[dict]) -> Path:
    """An nbformat-4 notebook at root/notebooks/name."""
    nb = {
        "cells": cells,
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = root / "notebooks" / name
    path.write_text(json.dumps(nb, indent=1), encoding="utf-8")
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "minillm").mkdir()
    return tmp_path


ATTENTION_CELLS = [
    markdown("# Attention\n\n#| export\nnot code, never exported"),
    code("#| default_exp attention\nimport torch  # the notebook's own setup"),
    code("#| export\nimport math"),
    code("scratch = 1  # an experiment that stays in the notebook"),
    code("#| export\n#| hide\ndef circle(r):\n    return math.pi * r * r"),
]


def export(root: Path, *args: str) -> int:
    return nbexport.main([*args, "--root", str(root)])


def test_export_writes_only_export_cells_under_a_header(project):
    write_notebook(project, "10_attention.ipynb", ATTENTION_CELLS)
    write_notebook(project, "00_intro.ipynb", [markdown("# Intro"), code("print('no export')")])
    assert export(project) == 0

    text = (project / "minillm" / "attention.py").read_text(encoding="utf-8")
    assert text.splitlines()[0].startswith("# Generated from notebooks/10_attention.ipynb ")
    assert "#|" not in text
    assert "import torch" not in text and "scratch" not in text and "never exported" not in text
    namespace: dict = {}
    exec(compile(text, "attention.py", "exec"), namespace)  # the exported cells run, in order
    assert namespace["circle"](1.0) == math.pi
    # a notebook without export cells writes no module
    assert sorted(p.name for p in (project / "minillm").iterdir()) == ["attention.py"]


def test_export_drops_exactly_the_solution_marker_lines(project):
    write_notebook(project, "10_norm.ipynb", [
        code("#| default_exp norm"),
        code('#| export\ndef double(x):\n    """Twice x."""\n    ### BEGIN SOLUTION\n    y = 2 * x\n'
             '    return y  # ### END SOLUTION stays: not a marker line\n    ### END SOLUTION\n'),
        code("def scratch():\n    ### BEGIN SOLUTION\n    return 0\n    ### END SOLUTION"),
    ])
    assert export(project) == 0
    text = (project / "minillm" / "norm.py").read_text(encoding="utf-8")
    assert "### BEGIN SOLUTION" not in text and "\n    ### END SOLUTION" not in text
    assert '    """Twice x."""\n    y = 2 * x\n    return y  # ### END SOLUTION stays: not a marker line\n' in text
    namespace: dict = {}
    exec(compile(text, "norm.py", "exec"), namespace)
    assert namespace["double"](3) == 6 and "scratch" not in namespace
    assert export(project, "--check") == 0


def test_check_passes_after_export_and_names_a_stale_module(project, capsys):
    notebook = write_notebook(project, "10_attention.ipynb", ATTENTION_CELLS)
    module = project / "minillm" / "attention.py"
    assert export(project, "--check") == 1  # not exported yet
    assert "minillm/attention.py" in capsys.readouterr().out

    assert export(project) == 0
    assert export(project, "--check") == 0

    module.write_text(module.read_text(encoding="utf-8") + "x = 2\n", encoding="utf-8")
    capsys.readouterr()
    assert export(project, "--check") == 1
    assert "minillm/attention.py" in capsys.readouterr().out

    module.unlink()
    assert export(project, "--check") == 1
    assert "minillm/attention.py" in capsys.readouterr().out

    assert export(project) == 0
    write_notebook(project, notebook.name, [*ATTENTION_CELLS, code("#| export\nY = 3")])
    capsys.readouterr()
    assert export(project, "--check") == 1, "a notebook edited after export must fail --check"
    assert "minillm/attention.py" in capsys.readouterr().out


def test_export_cells_without_default_exp_is_an_error(project, capsys):
    write_notebook(project, "20_rope.ipynb", [markdown("# RoPE"), code("#| export\ndef rope(): ...")])
    assert export(project) == 2
    assert "20_rope.ipynb" in capsys.readouterr().err
    assert list((project / "minillm").iterdir()) == []


def test_two_notebooks_exporting_one_module_is_an_error(project, capsys):
    cells = [code("#| default_exp norms"), code("#| export\ndef rms_norm(x): ...")]
    write_notebook(project, "30_rmsnorm.ipynb", cells)
    write_notebook(project, "31_layernorm.ipynb", cells)
    assert export(project, "--check") == 2
    err = capsys.readouterr().err
    assert "30_rmsnorm.ipynb" in err and "31_layernorm.ipynb" in err


def test_export_module_sends_a_cell_to_another_module(project, capsys):
    write_notebook(project, "40_model.ipynb", [
        code("#| default_exp model"),
        code("#| export\nimport math\n\ndef area(r):\n    return math.pi * r * r"),
        code("#| export geometry.shapes\ndef square(a):\n    return a * a"),
        code("#| export\nTWO = 2"),
        code("#| exports geometry.shapes\nCUBE = 3"),
        code("#| export model\nTHREE = 3  # naming the default module is the same as not naming it"),
    ])
    assert export(project) == 0
    model = (project / "minillm" / "model.py").read_text(encoding="utf-8")
    shapes = (project / "minillm" / "geometry" / "shapes.py").read_text(encoding="utf-8")
    for text in (model, shapes):
        assert text.splitlines()[0].startswith("# Generated from notebooks/40_model.ipynb ")
    assert "square" not in model and "TWO = 2\n\n\nTHREE = 3" in model  # in cell order
    assert "def square(a):" in shapes and "CUBE = 3" in shapes and "area" not in shapes
    assert export(project, "--check") == 0
    (project / "minillm" / "geometry" / "shapes.py").write_text(shapes + "x = 1\n", encoding="utf-8")
    assert export(project, "--check") == 1
    assert "minillm/geometry/shapes.py" in capsys.readouterr().out


def test_export_makes_each_folder_a_package(project, capsys):
    write_notebook(project, "45_cache.ipynb", [code("#| default_exp cache.paged.blocks"), code("#| export\nX = 1")])
    assert export(project, "--check") == 1  # the module and both folders' __init__.py are missing
    out = capsys.readouterr().out
    assert "minillm/cache/__init__.py: missing" in out and "minillm/cache/paged/__init__.py: missing" in out
    assert export(project) == 0
    init = project / "minillm" / "cache" / "__init__.py"
    assert init.read_text(encoding="utf-8").startswith('"""minillm.cache')
    assert (project / "minillm" / "cache" / "paged" / "__init__.py").exists()
    init.write_text('"""The KV cache, said by hand."""\n', encoding="utf-8")
    assert export(project) == 0 and "said by hand" in init.read_text(encoding="utf-8")  # never overwritten
    assert export(project, "--check") == 0
    init.unlink()
    assert export(project, "--check") == 1


def test_export_module_errors_name_the_notebook(project, capsys):
    write_notebook(project, "50_a.ipynb", [code("#| export rope\ndef rope(): ...")])  # no default_exp needed
    write_notebook(project, "51_b.ipynb", [code("#| default_exp b"), code("#| export rope\nX = 1")])
    assert export(project) == 2
    err = capsys.readouterr().err
    assert "50_a.ipynb" in err and "51_b.ipynb" in err and "'rope'" in err  # one module, one notebook

    (project / "notebooks" / "51_b.ipynb").unlink()
    write_notebook(project, "52_c.ipynb", [code("#| default_exp c"), code("#| export\n#| export d\nX = 1")])
    assert export(project) == 2
    assert "52_c.ipynb" in capsys.readouterr().err

    (project / "notebooks" / "52_c.ipynb").unlink()
    write_notebook(project, "53_d.ipynb", [code("#| export Not-A-Module\nX = 1")])
    assert export(project) == 2
    err = capsys.readouterr().err
    assert "53_d.ipynb" in err and "'Not-A-Module' is not a valid module name" in err
