"""The per-step A/B harness's bookkeeping (ops/bench/step_ab.py): variants parsed from the command line, the null
variant beside them, each round's order drawn at random, and the paired figures."""

from __future__ import annotations

import argparse

import pytest

from ops.bench.step_ab import NULL_SWITCH, paired_summary, parse_variant, round_orders, with_null


def test_a_variant_is_a_name_and_its_variables() -> None:
    assert parse_variant("base:") == ("base", {})
    assert parse_variant("fp32:TOLLWAY_DECODE_DOTS=fp32,OTHER=") == ("fp32", {"TOLLWAY_DECODE_DOTS": "fp32", "OTHER": ""})
    for bad in ("base", ":X=1", "a:X", "a:=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)


def test_the_null_variant_repeats_the_baseline_under_a_switch_nothing_reads() -> None:
    variants = with_null([("base", {"A": "1"}), ("other", {"A": "2"})])
    assert variants[-1] == ("null", {"A": "1", NULL_SWITCH: "1"})
    with pytest.raises(ValueError):
        with_null([("a", {}), ("a", {"X": "1"})])
    with pytest.raises(ValueError):
        with_null([("null", {})])


def test_each_round_runs_every_variant_once_in_a_drawn_order() -> None:
    orders = round_orders(3, 200, seed=5)
    assert all(sorted(order) == [0, 1, 2] for order in orders)
    assert orders == round_orders(3, 200, seed=5)  # seeded
    firsts = [order[0] for order in orders]
    assert all(firsts.count(v) > 40 for v in range(3))  # not one fixed order (each ~67 of 200)
    assert len({tuple(order) for order in orders}) == 6  # every order of three occurs


def test_the_figures_pair_each_round_with_the_baseline() -> None:
    times = [[1.0, 2.0, 3.0], [1.5, 1.0, 3.1]]  # seconds: variant 1 faster only in round 2
    (base_median, base_diff, _), (median, diff, faster) = paired_summary(times)
    assert base_median == 2.0 and base_diff is None
    assert median == 1.5 and diff == pytest.approx(0.1) and faster == 1  # differences +0.5, -1.0, +0.1
