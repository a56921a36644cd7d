"""Notebook 17's exploration, speedup_16: with the notebook's measured rates the check computes the
reference itself and accepts 1% either way, naming the likely slip (issue 44: it used to accept
anything from 1 to 20)."""

from __future__ import annotations

from minillm.check import engine as check_engine

RATES = {1: 10.0, 2: 19.0, 4: 35.0, 8: 55.0, 16: 70.0}  # tokens/s at each concurrency


def test_the_reference_is_computed_from_the_rates(capsys):
    assert check_engine.explore_speedup_16(7.0, RATES) and check_engine.explore_speedup_16(7.06, RATES)
    assert not check_engine.explore_speedup_16(7.2, RATES)  # plausible, but not what the rates give
    assert "not the reference answer" in capsys.readouterr().out


def test_the_likely_slips_are_named(capsys):
    for wrong, words in [(1 / 7, "not the reverse"), (7 / 16, "per request"), (5.5, "not 8 with 1"),
                         (70 / 55, "not with 8")]:
        assert not check_engine.explore_speedup_16(wrong, RATES)
        assert words in capsys.readouterr().out, wrong


def test_without_rates_a_plausible_range_is_all_it_can_ask():
    assert check_engine.explore_speedup_16(5.0) and not check_engine.explore_speedup_16(0.2)
