"""bench_advisor's table and notes on made-up outcomes (no ranks are started)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

from benchmarks import bench_advisor
from fastcomm.advise import KernelRates, Link
from fastcomm.advise.kernels import KERNELS

RATES = KernelRates(dict.fromkeys(KERNELS, 5e9), 1e8, "cpu", 1, "test")
LOOPBACK = Link(1e-4, 1e9, overlaps_compute=False)


def _outcome(seconds: float, compress: float | None = None, floor: float | None = 0.25) -> SimpleNamespace:
    stats = None if compress is None else {"compress_seconds": 4 * compress}
    return SimpleNamespace(status="ok", step_seconds=seconds, stats=stats, floor_seconds=floor)


def _rows(**measured: float):
    outcomes = {name: (_outcome(seconds, 0.05 if name != "allreduce" else None), 1.0)
                for name, seconds in measured.items()}
    kwargs = {"params": 25_182_208, "rates": RATES, "shapes": bench_advisor._SHAPES, "gpus": 2,
              "gpus_per_node": 2, "link": LOOPBACK, "intra": LOOPBACK}
    return bench_advisor._rows("loopback", outcomes, kwargs, timed_steps=4)


def test_each_row_has_the_prediction_beside_the_measurement():
    rows = _rows(allreduce=0.36, sign=0.30)
    sign = {r.backend: r for r in rows}["sign"]
    assert sign.extra["floor_s"] == 0.25
    assert sign.value == 0.30 and sign.extra["predicted_s"] > 0.25
    assert sign.extra["error"].endswith("%") and sign.extra["within_25%"] in ("yes", "NO")
    assert sign.extra["measured_compress_s"] == 0.05


def test_each_configuration_is_priced_by_the_advisor_method_of_its_compressor():
    measured = _rows(allreduce=0.36, bf16_cast=0.3, quant8=0.3, quant4=0.3, powersgd_r4=0.3)
    rows = {r.backend: r for r in measured}
    assert {name: row.extra["method"] for name, row in rows.items()} == {
        "allreduce": "allreduce", "bf16_cast": "cast_bf16", "quant8": "quantize8", "quant4": "quantize4",
        "powersgd_r4": "powersgd_r4",
    }  # fmt: skip


def test_a_row_off_by_more_than_25_percent_gets_a_note_with_its_parts():
    rows = _rows(allreduce=0.36, quant8=2.0)
    notes = bench_advisor._off_notes(rows)
    assert len(notes) == 1 and "loopback quant8" in notes[0] and "the hook counted 0.050 s" in notes[0]
    assert bench_advisor._summary(rows)[0].startswith("1 of 2 predictions within 25%")


def test_a_run_without_a_floor_has_no_prediction():
    kwargs = {"params": 25_182_208, "rates": RATES, "shapes": bench_advisor._SHAPES, "gpus": 2,
              "gpus_per_node": 2, "link": LOOPBACK, "intra": LOOPBACK}
    crashed = SimpleNamespace(status="crashed (rank 0 exit 1)", step_seconds=math.nan, stats=None,
                              floor_seconds=None)
    (row,) = bench_advisor._rows("loopback", {"sign": (crashed, 1.0)}, kwargs, timed_steps=4)
    assert row.value != row.value and "predicted_s" not in row.extra
    assert row.extra["status"].startswith("crashed")


def test_plot_writes_a_png(tmp_path: Path):
    rows = _rows(allreduce=0.36, sign=0.30)
    payload = {"rows": [vars(r) for r in rows]}
    bench_advisor.plot(json.loads(json.dumps(payload)), tmp_path / "advisor.png")
    assert (tmp_path / "advisor.png").stat().st_size > 0


def test_auto_gets_a_row_with_its_choice_and_the_issue_targets_as_notes():
    kwargs = {"params": 25_182_208, "rates": RATES, "shapes": bench_advisor._SHAPES, "gpus": 2,
              "gpus_per_node": 2, "link": LOOPBACK, "intra": LOOPBACK}
    stats = {"auto_dense_buckets": 0, "auto_quantize4_buckets": 2, "auto_reverted": 1,
             "auto_trial_chosen_step_s": 0.41, "auto_trial_dense_step_s": 0.37}
    auto = SimpleNamespace(status="ok", step_seconds=0.372, stats=stats, floor_seconds=0.25)
    outcomes = {"allreduce": (_outcome(0.36), 1.0), "quant4": (_outcome(0.40, 0.05), 1.0),
                "auto": (auto, 1.0)}
    rows = bench_advisor._rows("loopback", outcomes, kwargs, timed_steps=4)
    row = {r.backend: r for r in rows}["auto"]
    assert row.value == 0.372 and "predicted_s" not in row.extra
    assert row.extra["reason"] == ("chose quantize4 x2 bucket sizes; trial 0.410 s vs dense 0.370 s per "
                                   "step: reverted to dense")
    (note,) = bench_advisor._auto_notes(rows)
    assert note == "loopback: auto <= 1.03x allreduce: MISSED (auto 0.372 s / allreduce 0.360 s = 1.03x)"
    shaped = [bench_advisor.Row("1gbit", name, "step_time", value, "s")
              for name, value in (("auto", 0.30), ("quant8", 0.33), ("quant4", 0.29), ("allreduce", 0.9))]
    assert bench_advisor._auto_notes(shaped) == [
        "1gbit: auto within 5% of the best hook at loss parity: MET (auto 0.300 s / quant4 0.290 s = 1.03x)"
    ]
