"""Automatic checks for the classroom exercises (plumbing, not a lesson): the front door.

Each check takes a student's function or class, runs it on small inputs, compares with torch
(or with a few lines of reference math written here), prints PASS or FAIL with the first wrong
element and the likely cause, and returns True or False. The same checks grade the reference
package: `check.rms_norm(minillm.model.layers.rms_norm)` passes.

In an exercise notebook:      from minillm import check; check.rms_norm(rms_norm)
From the command line:        python -m minillm.check exercises/04_norm_mlp.ipynb
                              python -m minillm.check submissions/        (every notebook in a folder)
                              python -m minillm.check my_layers.py        (a student's module)
Grading a class:              python -m minillm.check grade submissions/ [--csv grades.csv]

`grade` treats each first-level folder of submissions/ as one student (every .ipynb and .py under
it), or each file directly in submissions/ as a student named by the file's stem; it runs every
check quietly and prints a table, student x exercise, of checks passed out of checks run
(`3/3`, `0/3`; `-` where a student handed in nothing for that exercise). --csv writes the same
table, one row per student, with a `passed` and a `total` column per exercise (numbers, so that
a spreadsheet does not read 3/3 as a date). An exercise is named by the reference notebook it was
generated from (09_sampling), else by the file's stem. It runs students' code: use a sandbox.

The checks live in minillm/check/model.py (notebooks 01-05), minillm/check/loading.py (06, 07, 10),
minillm/check/serving.py (08-13), minillm/check/engine.py (12, 14), validate_speculative.py (17),
check_lora.py (19) and check_first_versions.py (the lessons' first versions in 02, 10 and 13:
naive_attention, greedy_decode, fake_quant). The exploration tasks' checks (check.explore_<name>, named in EXPLORE,
not in CHECKS: they take a measured number and run in the notebook) are in minillm/check/explore.py
(counts and bytes), check_engine.py (12 and 14: measurements), validate_speculative.py (17) and
check_lora.py (19); minillm/check/structured.py and parallel.py hold notebook 14's and 20's stubs and explorations,
minillm/check/linear_attention.py notebook 22's, minillm/check/moe.py notebook 23's. All run on the harness of minillm/check/harness.py;
this module names them (CHECKS, EXPLORE) and runs them.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import io
import json
import re
import sys
import types
from pathlib import Path
from collections.abc import Callable

from minillm.check import engine as check_engine, explore as check_explore, lora as check_lora, speculative as validate_speculative
from minillm.check import parallel as check_parallel, structured as check_structured
from minillm.check.engine import (admit, explore_speedup_16, explore_text_share, make_room, output_events,
                                  preempt_seq)
from minillm.check.explore import (
    explore_attention_crossover_tokens,
    explore_broken_tokens,
    explore_chinese_share,
    explore_gather_copy_mib,
    explore_gqa_saved_bytes_per_token,
    explore_int4_bits_per_weight,
    explore_kv_crossover_tokens,
    explore_mlp_share_of_model,
    explore_qwen7b_bytes,
    explore_sequences_that_fit,
    explore_slow_pairs_theta_10k,
    explore_tail,
    explore_transpose_copy_bytes,
)
from minillm.check.first_versions import fake_quant, greedy_decode, naive_attention
from minillm.check.harness import CheckFailed
from minillm.check.loading import bpe, stop_strings_push, stream, stream_decoder_push, unpermute_qk
from minillm.check.model import (
    apply_rope,
    attention_forward,
    attention_weights,
    causal_mask,
    contiguous_strides,
    decoder_layer_forward,
    expand,
    matmul,
    mlp_forward,
    rms_norm,
    rope_cos_sin,
    rotate_half,
    scaled_dot_product_attention,
    transpose,
)
from minillm.check.serving import (
    batch_layout,
    dequantize_q4_1,
    fold_block,
    gather_reference,
    kv_cache_update,
    min_p_filter,
    quantize_int4,
    top_k_filter,
    top_p_filter,
)
from minillm.check import linear_attention as check_linear_attention
from minillm.check.linear_attention import explore_state_crossover_tokens, recurrent_gated_delta_rule
from minillm.check.lora import explore_adapter_megabytes, multi_lora_linear_forward
from minillm.check import moe as check_moe
from minillm.check.moe import experts_loop, explore_experts_touched_16, route
from minillm.check import performance as check_performance
from minillm.check.performance import decode_bytes, explore_h200_crossover_batch
from minillm.check.parallel import explore_kv_bytes_per_token_tp4, split_kv_heads
from minillm.check.structured import explore_allowed_after_twelve, vocabulary_allowed
from minillm.check.speculative import accept_sampled, explore_lookup_forwards_saved

__all__ = [
    "contiguous_strides", "transpose", "expand", "matmul",
    "naive_attention", "causal_mask", "attention_weights", "scaled_dot_product_attention",
    "rotate_half", "rope_cos_sin", "apply_rope",
    "rms_norm", "mlp_forward", "attention_forward", "decoder_layer_forward",
    "kv_cache_update", "gather_reference", "batch_layout", "fold_block", "top_k_filter", "top_p_filter", "min_p_filter", "fake_quant", "quantize_int4",
    "dequantize_q4_1", "unpermute_qk", "bpe", "stream_decoder_push", "stop_strings_push", "greedy_decode", "stream",
    "explore_transpose_copy_bytes", "explore_gqa_saved_bytes_per_token", "explore_kv_crossover_tokens",
    "explore_tail", "explore_broken_tokens", "explore_int4_bits_per_weight", "explore_slow_pairs_theta_10k",
    "explore_mlp_share_of_model", "explore_sequences_that_fit", "explore_gather_copy_mib", "explore_attention_crossover_tokens",
    "explore_qwen7b_bytes", "explore_chinese_share", "accept_sampled", "explore_lookup_forwards_saved", "EXPLORE",
    "multi_lora_linear_forward", "explore_adapter_megabytes",
    "decode_bytes", "explore_h200_crossover_batch",
    "split_kv_heads", "explore_kv_bytes_per_token_tp4", "vocabulary_allowed", "explore_allowed_after_twelve",
    "recurrent_gated_delta_rule", "explore_state_crossover_tokens", "route", "experts_loop", "explore_experts_touched_16",
    "admit", "preempt_seq", "make_room", "explore_speedup_16", "output_events", "explore_text_share",
    "CheckFailed", "CHECKS", "check_namespace", "check_path", "grade", "main",
]


# ------------------------------------------------------------------ the command line

CHECKS: dict[str, Callable[[object], bool]] = {
    "contiguous_strides": contiguous_strides, "transpose": transpose, "expand": expand, "matmul": matmul,
    "naive_attention": naive_attention, "causal_mask": causal_mask, "attention_weights": attention_weights,
    "scaled_dot_product_attention": scaled_dot_product_attention,
    "rotate_half": rotate_half, "rope_cos_sin": rope_cos_sin, "apply_rope": apply_rope,
    "rms_norm": rms_norm, "MLP.forward": mlp_forward,
    "Attention.forward": attention_forward, "DecoderLayer.forward": decoder_layer_forward,
    "KVCache.update": kv_cache_update, "gather_reference": gather_reference, "batch_layout": batch_layout,
    "fold_block": fold_block,
    "top_k_filter": top_k_filter, "top_p_filter": top_p_filter, "min_p_filter": min_p_filter,
    "fake_quant": fake_quant, "quantize_int4": quantize_int4, "dequantize_q4_1": dequantize_q4_1,
    "unpermute_qk": unpermute_qk, "bpe": bpe, "StreamDecoder.push": stream_decoder_push,
    "StopStrings.push": stop_strings_push, "greedy_decode": greedy_decode, "stream": stream,
    "admit": admit, "preempt_seq": preempt_seq, "make_room": make_room, "output_events": output_events,
    "accept_sampled": accept_sampled, "MultiLoRALinear.forward": multi_lora_linear_forward,
    "decode_bytes": decode_bytes,
    "Split.kv_heads": split_kv_heads, "Vocabulary.allowed": vocabulary_allowed,
    "recurrent_gated_delta_rule": recurrent_gated_delta_rule, "route": route, "experts_loop": experts_loop,
}
"""Exercise name (a function, or Class.method) -> its check, which takes the function or the class."""

EXPLORE: dict[str, Callable[[object], bool]] = {**check_explore.EXPLORE, **check_engine.EXPLORE,
                                                 **validate_speculative.EXPLORE, **check_lora.EXPLORE,
                                                 **check_parallel.EXPLORE, **check_performance.EXPLORE,
                                                 **check_structured.EXPLORE, **check_linear_attention.EXPLORE,
                                                 **check_moe.EXPLORE}
"""Exploration name (the answer's variable) -> its check, which takes the number (check.explore_<name>)."""

_EXPORT = re.compile(r"^#\|\s*export")


def check_namespace(ns: dict, names: list[str] | None = None) -> tuple[int, int]:
    """Run the checks for `names` (default: every checkable name defined in ns); return (passed, total)."""
    if names is None:  # the checkable names the code defines itself (not those it imports)
        names = [n for n in CHECKS
                 if getattr(ns.get(n.split(".")[0]), "__module__", None) == ns.get("__name__", "__main__")]
    passed = 0
    for name in names:
        obj = ns.get(name.split(".")[0])
        if obj is None:
            print(f"FAIL {name}: not defined")
            continue
        passed += CHECKS[name](obj)
    return passed, len(names)


def _notebook_code(path: Path) -> tuple[str, list[str] | None]:
    """The code of a notebook's module cells (exercise cells tagged 'module', or '#| export' cells), and its stubs."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    chunks = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        src = cell.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        tagged = "module" in cell.get("metadata", {}).get("tags", [])
        if tagged or any(_EXPORT.match(line) for line in src.splitlines()):
            chunks.append("\n".join(line for line in src.splitlines() if not line.startswith("#|")))
    stubs = nb.get("metadata", {}).get("minillm", {}).get("stubs")
    lines = "\n\n".join(chunks).splitlines()  # several modules' cells: their __future__ imports go first
    future = [line for line in lines if line.startswith("from __future__ import")]
    code = "\n".join([*dict.fromkeys(future), *(line for line in lines if line not in future)])
    return code, stubs if stubs is not None else _solution_names(code)


def _solution_names(code: str) -> list[str] | None:
    """A reference notebook's exercises: the functions and Class.methods whose body holds a solution
    region (None when there is none: then every checkable name the code defines is checked). Without
    this, a name another notebook's exercise uses (notebook 19's speculative `stream`) would be
    checked against the wrong exercise."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None  # check_path reports it
    marks = [n for n, line in enumerate(code.splitlines(), 1) if line.strip() == "### BEGIN SOLUTION"]
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions = [(node, node.name)]
        elif isinstance(node, ast.ClassDef):
            functions = [(m, f"{node.name}.{m.name}") for m in node.body if isinstance(m, ast.FunctionDef)]
        else:
            continue
        found += [name for fn, name in functions if any(fn.lineno <= m <= fn.end_lineno for m in marks)]
    names = [name for name in found if name in CHECKS]
    return names or None


def _keep_definitions(code: str) -> str:
    """code with a line after each top-level def and class that keeps the object in __minillm_own__.

    A later cell may rebind the name (notebook 10's `from minillm.runtime.generate import stream` replaces
    its own `stream`): the checks take the code's own definition, not the package's copy.
    """
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code  # exec reports it
    lines = code.splitlines()
    for node in reversed(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines.insert(node.end_lineno, f"__minillm_own__[{node.name!r}] = {node.name}")
    return "\n".join(lines)


def check_path(path: str | Path) -> tuple[int, int]:
    """Load a student's notebook (.ipynb) or module (.py) and run every check it has code for."""
    path = Path(path)
    if path.suffix == ".ipynb":
        code, stubs = _notebook_code(path)
    else:
        code, stubs = path.read_text(encoding="utf-8"), None
    name = "minillm_student_" + re.sub(r"\W", "_", path.stem)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    module.__minillm_own__ = {}
    sys.modules[name] = module  # dataclasses look their module up
    try:
        exec(compile(_keep_definitions(code), str(path), "exec"), module.__dict__)
    except Exception as exc:
        print(f"FAIL {path}: its code does not run: {type(exc).__name__}: {exc}")
        return 0, len(stubs or []) or 1
    finally:
        sys.modules.pop(name, None)
    return check_namespace({**module.__dict__, **module.__minillm_own__}, stubs)


# ------------------------------------------------------------------ grading a folder of submissions


def _submissions(folder: Path) -> list[tuple[str, Path]]:
    """(student, file) for every notebook and module: first-level folders are students, loose files too."""
    def wanted(q: Path) -> bool:
        return q.suffix in (".ipynb", ".py") and ".ipynb_checkpoints" not in q.parts and not q.name.startswith(".")

    out = []
    for entry in sorted(folder.iterdir()):
        if entry.is_dir() and not entry.name.startswith("."):
            out += [(entry.name, q) for q in sorted(entry.rglob("*")) if q.is_file() and wanted(q.relative_to(folder))]
        elif entry.is_file() and wanted(entry):
            out.append((entry.stem, entry))
    return out


def _exercise(path: Path) -> str:
    """The reference notebook an exercise came from (its stem), else the file's stem."""
    if path.suffix == ".ipynb":
        try:
            source = json.loads(path.read_text(encoding="utf-8")).get("metadata", {}).get("minillm", {})
            return Path(source["exercise_of"]).stem
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            pass
    return path.stem


def grade(folder: str | Path) -> dict[str, dict[str, tuple[int, int]]]:
    """{student: {exercise: (passed, total)}} for a folder of submissions (the checks' output is not shown)."""
    grades: dict[str, dict[str, tuple[int, int]]] = {}
    for student, path in _submissions(Path(folder)):
        with contextlib.redirect_stdout(io.StringIO()):
            passed, total = check_path(path)
        exercise = _exercise(path)
        old = grades.setdefault(student, {}).get(exercise, (0, 0))
        grades[student][exercise] = (old[0] + passed, old[1] + total)
    return grades


def grade_table(grades: dict[str, dict[str, tuple[int, int]]]) -> str:
    exercises = sorted({e for row in grades.values() for e in row})
    header = ["student", *exercises, "total"]
    rows = []
    for student, row in sorted(grades.items()):
        p, t = sum(v[0] for v in row.values()), sum(v[1] for v in row.values())
        rows.append([student, *(f"{row[e][0]}/{row[e][1]}" if e in row else "-" for e in exercises), f"{p}/{t}"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def write_grades_csv(grades: dict[str, dict[str, tuple[int, int]]], path: str | Path) -> None:
    exercises = sorted({e for row in grades.values() for e in row})
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(["student", *(f"{e} {k}" for e in exercises for k in ("passed", "total")), "passed", "total"])
        for student, row in sorted(grades.items()):
            cells = [x for e in exercises for x in (row[e] if e in row else ("", ""))]
            out.writerow([student, *cells, sum(v[0] for v in row.values()), sum(v[1] for v in row.values())])


def grade_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.check grade",
                                     description="Grade a folder of submissions: one first-level folder (or file) per student.")
    parser.add_argument("folder", type=Path, help="the submissions folder")
    parser.add_argument("--csv", type=Path, help="also write the table to this CSV file")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"error: {args.folder} is not a folder", file=sys.stderr)
        return 2
    grades = grade(args.folder)
    if not grades:
        print(f"error: no .ipynb or .py files in {args.folder}", file=sys.stderr)
        return 2
    print(grade_table(grades))
    if args.csv:
        write_grades_csv(grades, args.csv)
        print(f"wrote {args.csv}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["grade"]:
        return grade_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m minillm.check",
                                     description="Check exercise notebooks or student modules.")
    parser.add_argument("paths", nargs="+", type=Path, help="exercise notebooks, .py modules, or folders of them")
    args = parser.parse_args(argv)
    files: list[Path] = []
    for p in args.paths:
        if p.is_dir():
            files += sorted(q for q in p.rglob("*") if q.suffix in (".ipynb", ".py") and ".ipynb_checkpoints" not in q.parts)
        elif p.exists():
            files.append(p)
        else:
            print(f"error: {p} does not exist", file=sys.stderr)
            return 2
    results = []
    for f in files:
        print(f"== {f}")
        results.append((f, *check_path(f)))
    if len(results) > 1:
        print("\nsummary")
        for f, passed, total in results:
            print(f"  {passed}/{total}  {f}")
    return 0 if all(p == t for _, p, t in results) else 1
