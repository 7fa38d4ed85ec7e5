"""bench_diloco's summaries on made-up outcomes (no ranks are started): loss vs dense, traffic, wait per
sync, the share an overlapped sync hides; time to target per link against the compute-only limit
(CompressedAdam timed per phase); the wall-time curves and the plot."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_diloco
from benchmarks.lm_methods import METHODS, load_example

PARAMETERS = 1_000_003


def _run(losses: list[float], stats: dict[str, float] | None = None) -> dict:
    return {"val_steps": [50 * (i + 1) for i in range(len(losses))], "val_losses": losses,
            "options": {"sync_every": 10}, "parameters": PARAMETERS, "hook_stats": stats}  # fmt: skip


RUNS = {
    "none": _run([3.0, 2.0, 1.5]),
    "diloco_q4": _run([3.1, 2.1, 1.52],
                      {"sent_bytes": 150 * 51_000.0, "inner_steps": 150.0, "syncs": 15.0, "blocked_s": 3.0}),
}
SPEED = {
    "loopback": {"noop": {"s_per_step": 0.25, "blocked_per_step": 0.0}},
    "10mbit": {"none": {"s_per_step": 3.5, "blocked_per_step": 0.0},
               "diloco_q4": {"s_per_step": 0.5, "blocked_per_step": 0.2},
               "streaming_q4": {"s_per_step": 0.3, "blocked_per_step": 0.05}},
}  # fmt: skip


def test_the_summary_compares_loss_traffic_and_steps_to_target_with_dense():
    rows, table, notes = bench_diloco._summary(RUNS, SPEED, 150)
    line = next(row for row in table.splitlines() if row.startswith("| diloco_q4 "))
    assert "+1.33%" in line  # 1.52 vs 1.5
    dense_bytes = 2 * (bench_diloco.WORLD - 1) * 4 * PARAMETERS / bench_diloco.WORLD
    assert f"{dense_bytes / 51_000:,.0f}x" in line
    assert "| 0.200 |" in line  # 3 s waited over 15 syncs
    # target 1.5 x 1.02 = 1.53: diloco_q4 reaches it at step 100 + 50 x (2.1 - 1.53) / (2.1 - 1.52)
    steps = 100 + 50 * (2.1 - 1.53) / (2.1 - 1.52)
    assert line.endswith(f"| {steps:.0f} |")  # the time to it: _time_table
    ratios = {row.backend: row.ratio for row in rows if row.metric == "val_loss"}
    assert ratios["diloco_q4"] == pytest.approx(1.52 / 1.5)
    assert any("hides 75%" in note for note in notes), notes  # 1 - 0.05 / 0.2


def test_a_failed_run_is_a_row_with_its_status():
    _, table, _ = bench_diloco._summary({"none": RUNS["none"], "diloco": "timed out after 9 s"}, {}, 150)
    assert "| diloco | - | timed out after 9 s |" in table


def _timed(seconds: float, blocked: float = 0.0) -> dict:
    return {"s_per_step": seconds, "blocked_per_step": blocked,
            "phases": [{"name": "all", "first": 1, "last": 150, "seconds_per_step": seconds}]}  # fmt: skip


# a run cached in --work-dir before the counter's rename: bytes_sent is read as sent_bytes
CADAM_STATS = {"bytes_sent": 150 * 700_000.0, "optimizer_steps": 150.0, "steps": 100.0}
TIMED_RUNS = {**RUNS, "cadam": _run([3.0, 1.9, 1.5], CADAM_STATS)}
WARMUP = {"name": "dense warm-up", "first": 1, "last": 50, "seconds_per_step": 2.0}
COMPRESSED = {"name": "compressed", "first": 51, "last": 150, "seconds_per_step": 1.0}
TIMED = {
    "loopback": {"noop": _timed(0.25)},
    "57mbit": {"none": _timed(1.0), "diloco_q4": _timed(0.28)},
    "10mbit": {"none": _timed(5.0), "diloco_q4": _timed(0.3),
               "cadam": {"s_per_step": 4 / 3, "blocked_per_step": 0.0, "phases": [WARMUP, COMPRESSED]}},
}  # fmt: skip


def _line(table: str, link: str, method: str) -> list[str]:
    return next(row for row in table.splitlines() if row.startswith(f"| {link} | {method} |")).split(" | ")


def test_time_to_target_is_against_the_methods_own_steps_at_the_no_communication_step():
    rows, table, _ = bench_diloco._time_table(TIMED_RUNS, TIMED, 150)
    dense_steps = 100 + 50 * (2.0 - 1.53) / (2.0 - 1.5)
    steps = 100 + 50 * (2.1 - 1.53) / (2.1 - 1.52)
    cells = _line(table, "10mbit", "diloco_q4")
    assert cells[3:7] == [f"{steps:.0f}", f"{steps * 0.3:.0f} s", f"{steps * 0.25:.0f} s", "1.20x"]
    assert cells[7] == f"{steps * 0.3 / (dense_steps * 0.25):.2f}x"  # against dense's steps: stricter
    assert cells[8] == f"{dense_steps * 5.0 / (steps * 0.3):.1f}x |"
    row = next(r for r in rows if r.case == "150 steps, 10mbit" and r.backend == "diloco_q4")
    assert row.value == pytest.approx(steps * 0.3) and row.ratio == pytest.approx(1.2)


def test_compressed_adam_is_timed_per_phase():
    _, table, _ = bench_diloco._time_table(TIMED_RUNS, TIMED, 150)
    steps = 100 + 50 * (1.9 - 1.53) / (1.9 - 1.5)  # in the compressed phase: 50 x 2 s + the rest x 1 s
    cells = _line(table, "10mbit", "cadam")
    assert cells[3:5] == [f"{steps:.0f}", f"{100 + (steps - 50) * 1.0:.0f} s"]
    assert "cadam" not in table.split("| 10mbit |")[0]  # not timed on 57mbit: no row there


def test_the_verdicts_name_who_meets_the_limit_and_beats_dense_and_cadam_on_the_slowest_link():
    _, _, notes = bench_diloco._time_table(TIMED_RUNS, TIMED, 150)
    assert "57mbit: within 1.15x of its own compute-only limit: diloco_q4" in notes  # 0.28 / 0.25
    assert "10mbit: within 1.15x of its own compute-only limit: none" in notes  # diloco_q4 is 1.20x
    assert "10mbit: >= 10x sooner than dense and sooner than cadam: diloco_q4" in notes
    assert any("x dense's limit" in note and "0.250 s" in note for note in notes)


def test_a_target_not_reached_or_a_failed_speed_run_is_a_row_saying_so():
    runs = {**TIMED_RUNS, "streaming_q4": _run([3.2, 2.5, 1.9])}
    speed = {**TIMED, "10mbit": {**TIMED["10mbit"], "streaming_q4": _timed(0.3), "diloco_q4": None}}
    _, table, _ = bench_diloco._time_table(runs, speed, 150)
    assert _line(table, "10mbit", "streaming_q4")[3] == "not reached"
    assert _line(table, "10mbit", "diloco_q4")[2] == "speed run failed"


def test_an_entry_of_one_step_time_and_a_longer_run_extend_the_last_phase():
    assert bench_diloco._timing({"s_per_step": 0.5}, 40) == {
        "phases": [{"first": 1, "last": 40, "seconds_per_step": 0.5}]}  # fmt: skip
    timing = bench_diloco._timing(TIMED["10mbit"]["cadam"], 1500)
    assert [(p["first"], p["last"]) for p in timing["phases"]] == [(1, 50), (51, 1500)]
    assert TIMED["10mbit"]["cadam"]["phases"][-1]["last"] == 150  # the entry is left as it was


def test_compressed_adams_bytes_are_counted_over_its_optimizer_steps():
    per_step, fewer = bench_diloco._traffic(TIMED_RUNS["cadam"], PARAMETERS)
    assert per_step == 700_000.0
    dense_bytes = 2 * (bench_diloco.WORLD - 1) * 4 * PARAMETERS / bench_diloco.WORLD
    assert fewer == pytest.approx(dense_bytes / 700_000)


def test_wall_curves_put_each_validation_step_at_its_phase_times():
    walls = bench_diloco._wall_curves(TIMED_RUNS, TIMED, 150)
    assert set(walls) == {"57mbit", "10mbit"}
    assert walls["10mbit"]["cadam"] == [100.0, 150.0, 200.0]  # 50 x 2 s, then 1 s a step
    assert walls["57mbit"]["diloco_q4"] == pytest.approx([14.0, 28.0, 42.0])


@pytest.mark.parametrize(("link", "mbit"), [("10mbit", 10.0), ("1gbit", 1000.0), ("500kbit", 0.5)])
def test_link_rates_are_read_in_mbit(link, mbit):
    assert bench_diloco._mbit(link) == mbit


def test_the_plot_has_a_wall_time_panel_per_link(tmp_path):
    path = tmp_path / "plot.png"
    bench_diloco._plot(TIMED_RUNS, TIMED_RUNS, TIMED, 150, path)
    assert path.stat().st_size > 10_000
    bench_diloco._plot(TIMED_RUNS, TIMED_RUNS, {}, 150, tmp_path / "steps_only.png")  # no speed runs


def test_each_phase_is_timed_apart_and_the_step_time_is_their_weighted_mean(tmp_path, monkeypatch):
    # per phase: its runs' step times (the first settings.warmup = 2 untimed), and the median
    # bench_convergence reports for a phase without syncs; the mean is the step time (2.0, then 1.0)
    taken = iter((([9.0, 9.0, 1.0, 1.0, 4.0], 1.0), ([9.0, 9.0, 1.0, 1.0, 1.0], 1.0)))
    calls = []

    def time_phase(method, phase, link, settings, tag, port):
        calls.append((phase.first, phase.last, dict(phase.options), tag, port))
        steps, median = next(taken)
        (settings.work / f"{tag}.json").write_text(json.dumps({"hook_stats": None, "step_seconds": steps}))
        return {"seconds_per_step": median}, "ok", None

    monkeypatch.setattr(bench_diloco.conv, "time_phase", time_phase)
    settings = bench_diloco.conv.Settings(500, 2, 20, tmp_path, tmp_path, True)
    timed = bench_diloco._time_method(None, "10mbit", "cadam", 29000, settings)
    warmup = METHODS["cadam"].options["warmup_steps"]
    assert [c[:2] for c in calls] == [(1, warmup), (warmup + 1, 500)]
    assert calls[1][2] == {"warmup_steps": 2}  # the compressed phase's run skips the warm-up
    assert len({c[3] for c in calls}) == len({c[4] for c in calls}) == 2
    assert timed["s_per_step"] == pytest.approx((2.0 * warmup + 1.0 * (500 - warmup)) / 500)
    assert [p["median_s_per_step"] for p in timed["phases"]] == [1.0, 1.0]


def test_every_default_method_is_a_train_lm_method_and_every_timed_one_has_a_loss_run():
    methods = set(METHODS)
    overlapped = set(bench_diloco.OVERLAPPED) | set(bench_diloco.OVERLAPPED.values())
    assert set(bench_diloco.LOSS_METHODS) | overlapped <= methods
    assert set(bench_diloco.SPEED_METHODS) <= set(bench_diloco.LOSS_METHODS)


def test_every_diloco_method_of_train_lm_builds_and_a_ramp_becomes_the_outer_lr_function():
    import torch
    from torch import nn

    import fastcomm

    train_lm = load_example()
    for name, method in METHODS.items():
        if method.optimizer != "diloco":
            continue
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))  # 6 parameters: up to 6 fragments
        outer = fastcomm.DiLoCo(model, torch.optim.AdamW(model.parameters()),
                                **train_lm.diloco_arguments(method.options))  # fmt: skip
        ramp = method.options.get("outer_lr_ramp")
        if ramp is None:
            assert outer.outer_lr == method.options["outer_lr"], name
            continue
        start, end, hold, until = ramp
        assert [outer.outer_lr(s) for s in (1, hold, until, until + 7)] == [start, start, end, end], name
        assert start < outer.outer_lr((hold + until) // 2) < end, name


def test_a_method_timed_as_its_twin_takes_the_twins_entry_where_it_was_not_timed():
    ((method, twin),) = list(bench_diloco.TIMED_AS.items())[:1]
    own = {"s_per_step": 0.5, "blocked_per_step": 0.0}
    speed = {"57mbit": {twin: {"s_per_step": 0.3, "blocked_per_step": 0.01}},
             "10mbit": {twin: {"s_per_step": 0.4, "blocked_per_step": 0.02}, method: own},
             "loopback": {"noop": {"s_per_step": 0.2}}}  # fmt: skip
    notes = bench_diloco._timed_as_twins(speed)
    assert speed["57mbit"][method] == speed["57mbit"][twin]
    assert speed["10mbit"][method] is own  # timed itself: kept
    assert method not in speed["loopback"] and len(notes) == 1 and twin in notes[0]
    assert set(bench_diloco.TIMED_AS) <= set(bench_diloco.LOSS_METHODS)
    assert set(bench_diloco.TIMED_AS.values()) <= set(bench_diloco.SPEED_METHODS)
