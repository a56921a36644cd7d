"""The benchmark's user rows (minillm/bench/user.py): each side answers in a fresh process, timed from its start.

No timing asserts beyond order and positivity: speed is the benchmark's output, not a test."""

import argparse

from minillm.bench import user
from minillm.weights.embedded import embedded_gguf_path


def test_rows_beside_transformers_and_a_failing_side_named():
    rows, skipped = [], {}

    def row(section, variant, metric, unit, ours, theirs=None, n=None):
        rows.append((section, variant, metric, unit, ours, theirs, n))

    args = argparse.Namespace(threads=1, tokens=3, peers=[])
    user.user_rows(embedded_gguf_path(), ["fast-int4", "readable-compiled"], args, row, skipped)
    assert {r[:3] for r in rows} == {("user", "fast-int4", "fresh: time to first token"),
                                     ("user", "fast-int4", "fresh: whole answer")}
    # ours and transformers', 3 tokens each; the first token after the imports and the load, the answer after it
    assert all(0.5 < r[4] and 0.5 < r[5] and r[6] == 3 for r in rows)
    first, whole = (next(r for r in rows if r[2] == m) for m in ("fresh: time to first token", "fresh: whole answer"))
    assert first[4] <= whole[4] and first[5] <= whole[5]
    # minillm.load refuses compile without fast: the child's error is the reason, for its cold and warm runs
    assert list(skipped) == ["user: readable-compiled", "user: readable-compiled, warm cache"]
    assert all("pass fast=True too" in reason for reason in skipped.values())


def test_a_folder_is_skipped_with_the_reason(tmp_path):
    skipped = {}
    user.user_rows(tmp_path, ["fast"], argparse.Namespace(threads=1, tokens=3, peers=[]), None, skipped)
    assert "load a .gguf file on every side" in skipped["user"]
