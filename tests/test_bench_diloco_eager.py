"""benchmarks/bench_diloco_eager.py: time to the target from a loss curve and a timed run's step costs, and
the verdict against the compute-only limit, on made-up runs (nothing is trained); the jobs' cache keys."""

from __future__ import annotations

import pytest

from benchmarks import bench_diloco_eager as bench
from benchmarks.diloco_jobs import Job


def _timed(seconds: list[float], blocked: float = 0.0) -> dict:
    return {"step_seconds": seconds, "hook_stats": {"blocked_s": blocked, "syncs": 2}}


def _curve(losses: list[float]) -> dict:
    return {"val_steps": [10 * (i + 1) for i in range(len(losses))], "val_losses": losses}


def test_seconds_to_a_fractional_step_sums_the_steps_as_they_were_timed_then_the_mean_past_the_end():
    run = _timed([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    assert bench.seconds_to(run, 2.5) == pytest.approx(1.0 + 2.0 + 0.5 * 3.0)
    # past the 7 timed steps: the mean after the first 5 (6.5 s) for each step further
    assert bench.seconds_to(run, 9) == pytest.approx(28.0 + 2 * 6.5)


def test_steps_to_a_target_is_linear_between_validation_points_and_none_if_never_reached():
    assert bench.steps_to(_curve([3.0, 2.0, 1.0]), 1.5) == pytest.approx(25.0)
    assert bench.steps_to(_curve([3.0, 2.0]), 1.5) is None


def test_x_limit_is_the_time_to_the_target_over_its_own_steps_at_the_rounds_no_communication_step():
    dense = _curve([3.0, 2.0, 1.0 / 1.02])  # target (2%): 1.0, which the method reaches at step 30
    curves = {0: {"none": dense, "defaults": _curve([3.0, 2.0, 1.0])},
              1: {"none": dense, "defaults": _curve([3.0, 2.5, 2.0])}}  # fmt: skip
    period = [1.0] * 9 + [4.0]  # one step in ten (the sync) 4x as long: 39 units per 30 steps
    rounds = [{"local": _timed([0.1] * 30), "defaults": _timed([0.1 * x for x in period * 3])},
              {"local": _timed([0.2] * 30), "defaults": _timed([0.2 * x for x in period * 3])}]
    rows, table, notes = bench._time_rows(curves, rounds, ["defaults"], 2.0)
    found = {(r.case, r.backend): r for r in rows}[("dense + 2%, seed 0", "defaults")]
    assert found.value == pytest.approx(1.3)
    assert found.extra["x_dense_limit"] == pytest.approx(3.9 / (0.1 * (20 + 10 * (1.0 / (2.0 - 1.0 / 1.02)))))
    # its own quiet steps (no exchange issued or in flight) are the 0.1 / 0.2 steps as well
    assert found.extra["x_own_quiet_steps"] == pytest.approx([1.3, 1.3])
    assert "| defaults | 30, 1.300x (1.300x) | not reached | 1.300x | 1.300x |" in table
    assert notes == ["defaults, dense + 2%: reached at 1 of 2 seeds (not at [1]); x limit 1.300-1.300 "
                     "(medians over rounds): within 1.1x does not hold; against its own quiet steps "
                     "1.300-1.300: within 1.1x does not hold"]  # fmt: skip


def test_the_step_table_reads_each_round_against_its_own_no_communication_step():
    rounds = [{"local": _timed([0.1] * 20), "noop_ddp": _timed([0.11] * 20),
               "defaults": _timed([0.12] * 20, 0.2)},
              {"local": _timed([0.3] * 20), "noop_ddp": _timed([0.33] * 20),
               "defaults": _timed([0.3] * 20, 0.4)}]  # fmt: skip
    rows, _, found = bench._step_table(rounds, ["defaults"])
    assert found["defaults"]["x_noop"] == pytest.approx(1.1)  # the median of 1.2 and 1.0
    assert found["noop_ddp"]["x_noop"] == pytest.approx(1.1)
    assert [r.extra["wait_per_sync_s"] for r in rows if r.backend == "defaults"] == [[0.1, 0.2]]
    assert found["defaults"]["x_quiet"] == pytest.approx(1.0)


def test_the_quiet_steps_leave_out_the_sync_the_steps_in_flight_the_first_and_the_last():
    # steps 1..20: the first and the last (a sync too) 9 s, the sync at 10 7 s, the two after it 5 s and 3 s
    seconds = [9.0, 3.0, *[1.0] * 7, 7.0, 5.0, 3.0, *[1.0] * 7, 9.0]
    run = _timed(seconds)
    assert bench._quiet_step(run, "defaults") == pytest.approx((3.0 + 7 * 1.0 + 5.0 + 3.0 + 7 * 1.0) / 17)
    # two steps late: the next two steps (in flight, the second landing) are not quiet either
    assert bench._quiet_step(run, "defaults_eager_d2") == pytest.approx(1.0)
    assert bench._quiet_step(run, "none") is None


def test_new_job_fields_keep_the_cache_keys_of_runs_made_before_them_and_tell_timed_runs_apart():
    before = Job("a", None, seed=1)
    assert before.tag == Job("a", None, seed=1, hook="none", val_rows=128, repeat=0, link="").tag
    timed = bench._time_jobs(["defaults"], 250, 40, 0, "10mbit/16kb")
    again = bench._time_jobs(["defaults"], 250, 40, 1, "10mbit/16kb")
    assert [j.name for j in timed] == ["local", "noop_ddp", "defaults", "none"]
    assert len({j.tag for j in timed + again}) == 8
    assert timed[-1].steps == 40 and timed[-1].schedule_steps == 250


def test_batch_size_reaches_every_job_and_keys_its_runs_apart():
    loss = bench._loss_jobs(["defaults"], [0, 1], 250, 10)
    wide = bench._loss_jobs(["defaults"], [0, 1], 250, 10, batch=64)
    assert {j.batch_size for j in loss} == {16} and {j.batch_size for j in wide} == {64}
    assert not {j.tag for j in loss} & {j.tag for j in wide}
    timed = bench._time_jobs(["defaults"], 250, 40, 0, "10mbit/16kb", batch=64)
    assert {j.batch_size for j in timed} == {64}


def test_loss_rows_read_each_seed_against_dense_and_an_eager_row_against_its_delay_0_row():
    curves = {s: {"none": _curve([2.0]), "defaults": _curve([2.0 * (1.01 + s / 100)]),
                  "defaults_eager_d2": _curve([2.0 * (1.012 + s / 100)])} for s in (0, 1)}  # fmt: skip
    rows, table, notes = bench.loss_rows(curves, ["defaults", "defaults_eager_d2"])
    found = {r.backend: r for r in rows}
    assert found["defaults"].value == pytest.approx(2.0)  # seed 1: 1.02 x dense
    assert found["defaults"].extra["per_seed_over_delay0"] == []
    over = found["defaults_eager_d2"].extra["per_seed_over_delay0"]
    assert over == pytest.approx([100 * (1.012 / 1.01 - 1), 100 * (1.022 / 1.02 - 1)])
    assert "| defaults_eager_d2 | +1.20 | +2.20 | +1.70 | +2.20 | +0.20 (defaults) |" in table
    assert notes == ["defaults_eager_d2: final loss over defaults's (same seeds) +0.20% to +0.20%: "
                     "within 0.5% holds"]
