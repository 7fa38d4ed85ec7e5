"""benchmarks/bench_diloco_seeds.py: the gap table (each row against its reference at the same seed, the mean
and the worst seed, the bytes) and its verdicts on made-up runs (nothing is trained); the jobs it trains."""

from __future__ import annotations

import pytest

from benchmarks import bench_diloco_seeds
from benchmarks.diloco_jobs import Job


def _run(loss: float, sent: float | None = None) -> dict:
    stats = {"sent_bytes": sent} if sent else None
    return {"val_steps": [125, 250], "val_losses": [loss + 0.5, loss], "hook_stats": stats,
            "train_losses": [0.0] * 250, "parameters": 1000}  # fmt: skip


FOUND = {
    0: {"none": _run(2.0), "none_reorder": _run(2.01), "diloco_q4_defaults": _run(2.01, 4000.0)},
    1: {"none": _run(1.6), "none_reorder": _run(1.59), "diloco_q4_defaults": _run(1.64, 4000.0)},
    2: {"none": _run(1.8), "none_reorder": _run(1.8), "diloco_q4_defaults": "not run: not in --work-dir"},
}


def test_each_gap_is_against_its_reference_at_the_same_seed_with_the_mean_and_the_worst():
    rows, table, notes = bench_diloco_seeds.gap_rows(
        {s: FOUND[s] for s in (0, 1)}, ["none_reorder", "diloco_q4_defaults"], 250
    )
    by = {(r.case, r.backend, r.metric): r for r in rows}
    assert by["250 steps, seed 1", "diloco_q4_defaults", "val_loss"].ratio == pytest.approx(1.025)
    over = "250 steps, over seeds 0,1"
    assert by[over, "none_reorder", "gap_mean_pct"].value == pytest.approx((0.5 - 0.625) / 2)
    assert by[over, "diloco_q4_defaults", "gap_worst_pct"].value == pytest.approx(2.5)
    # dense sends 2 (W-1)/W 4 P bytes a step: 4000 per step x 250 steps over 4000 sent
    assert by[over, "diloco_q4_defaults", "fewer_bytes"].value == pytest.approx(250.0)
    assert "| diloco_q4_defaults | none | +0.50% | +2.50% | +1.50% | +2.50% | 250x |" in table
    assert notes == ["diloco_q4_defaults: +1.50% over none on average over seeds [0, 1], +2.50% at the worst "
                     "seed: meets on average only the 2% target"]  # fmt: skip


def test_a_missing_seed_leaves_the_mean_out():
    rows, table, _ = bench_diloco_seeds.gap_rows(FOUND, ["diloco_q4_defaults"], 250)
    assert not [r for r in rows if r.metric == "gap_mean_pct"]
    assert "| diloco_q4_defaults | none | +0.50% | +2.50% | not run |  |  | 250x |" in table


def test_the_noise_row_is_dense_with_another_data_order_at_the_same_seeds():
    jobs = bench_diloco_seeds.jobs_of("none_reorder", [0, 3], 250)
    assert [(j.options, j.seed, j.data_seed) for j in jobs] == [(None, 0, 100), (None, 3, 103)]
    assert jobs[0].tag != bench_diloco_seeds.jobs_of("none", [0], 250)[0].tag


def test_a_jobs_cache_key_ignores_its_row_name_but_not_what_it_trains():
    assert Job("a", None, seed=1).tag == Job("b", None, seed=1).tag
    assert Job("a", None, seed=1).tag != Job("a", None, seed=1, steps=100).tag


def test_every_row_has_a_reference_row_and_the_seed_halves_are_apart():
    settings = bench_diloco_seeds.SETTINGS
    assert all(s.against in settings or s.against == "" for s in settings.values())
    assert not set(bench_diloco_seeds.CHOICE_SEEDS) & set(bench_diloco_seeds.CONFIRM_SEEDS)
