"""bench_diloco's summary (loss vs dense, traffic, wait per sync, time to target, the share streaming hides)
on made-up outcomes: no ranks are started."""

from __future__ import annotations

import pytest

from benchmarks import bench_diloco

PARAMETERS = 1_000_003


def _run(losses: list[float], stats: dict[str, float] | None = None) -> dict:
    return {"val_steps": [50 * (i + 1) for i in range(len(losses))], "val_losses": losses,
            "options": {"sync_every": 10}, "parameters": PARAMETERS, "hook_stats": stats}  # fmt: skip


RUNS = {
    "none": _run([3.0, 2.0, 1.5]),
    "diloco_q4": _run([3.1, 2.1, 1.52],
                      {"bytes_sent": 150 * 51_000.0, "inner_steps": 150.0, "syncs": 15.0, "blocked_s": 3.0}),
}
SPEED = {
    "loopback": {"noop": {"s_per_step": 0.25, "blocked_per_step": 0.0}},
    "10mbit": {"none": {"s_per_step": 3.5, "blocked_per_step": 0.0},
               "diloco_q4": {"s_per_step": 0.5, "blocked_per_step": 0.2},
               "streaming_q4": {"s_per_step": 0.3, "blocked_per_step": 0.05}},
}  # fmt: skip


def test_the_summary_compares_loss_traffic_and_time_with_dense():
    rows, table, notes = bench_diloco._summary(RUNS, SPEED, 150)
    line = next(row for row in table.splitlines() if row.startswith("| diloco_q4 "))
    assert "+1.33%" in line  # 1.52 vs 1.5
    dense_bytes = 2 * (bench_diloco.WORLD - 1) * 4 * PARAMETERS / bench_diloco.WORLD
    assert f"{dense_bytes / 51_000:,.0f}x" in line
    assert "| 0.200 |" in line  # 3 s waited over 15 syncs
    # target 1.5 x 1.02 = 1.53: diloco_q4 reaches it at step 100 + 50 x (2.1 - 1.53) / (2.1 - 1.52)
    steps = 100 + 50 * (2.1 - 1.53) / (2.1 - 1.52)
    assert f"{steps:.0f}" in line and f"{steps * 0.5:.0f} s" in line and f"{steps * 0.25:.0f} s" in line
    ratios = {row.backend: row.ratio for row in rows if row.metric == "val_loss"}
    assert ratios["diloco_q4"] == pytest.approx(1.52 / 1.5)
    assert any("hides 75%" in note for note in notes), notes  # 1 - 0.05 / 0.2


def test_a_failed_run_is_a_row_with_its_status():
    _, table, _ = bench_diloco._summary({"none": RUNS["none"], "diloco": "timed out after 9 s"}, {}, 150)
    assert "| diloco | - | timed out after 9 s |" in table
