"""benchmarks/bench_diloco_seeds.py: the gap table and its verdicts on made-up runs (nothing is trained)."""

from __future__ import annotations

import pytest

from benchmarks import bench_diloco_seeds


def _run(loss: float) -> dict:
    return {"val_steps": [250, 500], "val_losses": [loss + 0.5, loss]}


FOUND = {
    0: {"none": _run(2.0), "a": _run(2.01), "b": _run(2.02)},
    1: {"none": _run(1.6), "a": _run(1.64), "b": _run(1.616)},
    2: {"none": _run(1.8), "a": _run(1.8), "b": "not run: no loss-b-500-s2.json in --work-dir"},
}


def test_each_gap_is_against_dense_at_the_same_seed_with_the_mean_and_the_worst():
    rows, table, notes = bench_diloco_seeds.gap_rows(FOUND, ["a", "b"], 500)
    by = {(r.case, r.backend, r.metric): r for r in rows}
    assert by["500 steps, seed 1", "a", "val_loss"].ratio == pytest.approx(1.025)
    over = "500 steps, over seeds 0,1,2"
    assert by[over, "a", "gap_mean_pct"].value == pytest.approx((0.5 + 2.5 + 0.0) / 3)
    assert by[over, "a", "gap_worst_pct"].value == pytest.approx(2.5)
    assert (over, "b", "gap_mean_pct") not in by  # a seed is missing: no mean
    assert "| a | +0.50% | +2.50% | +0.00% | +1.00% | +2.50% |" in table
    assert "| b | +1.00% | +1.00% | not run |  |  |" in table
    expected = "a: +1.00% over dense on average over seeds [0, 1, 2], +2.50% at worst: meets on average only"
    assert notes == [f"{expected} the 2% target"]


def test_a_method_within_the_target_at_every_seed_meets_it():
    found = {seed: {"none": _run(2.0), "c": _run(2.02)} for seed in (0, 1)}
    notes = bench_diloco_seeds.gap_rows(found, ["c"], 500)[2]
    assert notes[0].endswith("+1.00% at worst: meets the 2% target")


def test_every_default_method_is_a_train_lm_method():
    from benchmarks.lm_methods import METHODS

    methods = set(METHODS)
    assert set(bench_diloco_seeds.METHODS) | set(bench_diloco_seeds.MORE_METHODS) <= methods
    assert not set(bench_diloco_seeds.SEEDS) & set(bench_diloco_seeds.MORE_SEEDS)
