"""benchmarks/bench_convergence.py's report and --merge, on made-up runs (no training)."""

import json
import math
from pathlib import Path

import pytest

from benchmarks import bench_convergence as bench
from benchmarks import convergence_results as conv_results
from benchmarks import convergence_runs as conv_runs
from benchmarks import harness

SHAPED = "shaped 57mbit"


@pytest.fixture()
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(harness.OUTPUT_ENV, str(tmp_path))  # where this run writes
    monkeypatch.setattr(bench, "RESULTS_DIR", tmp_path)  # where --merge reads the earlier result
    return tmp_path


def _run(final: float) -> conv_runs.Run:
    # validation every 50 of 150 steps, falling to ``final``
    losses = [final + 0.6, final + 0.2, final]
    result = {
        "val_steps": [50, 100, 150],
        "val_losses": losses,
        "train_losses": [5.0, 4.0, 3.0],
        "step_seconds": [0.25, 0.3, 0.35],
        "hook_stats": None,
    }
    return conv_runs.Run("ok", result)


def _timing(seconds: float) -> dict:
    phase = {
        "name": "all",
        "first": 1,
        "last": 150,
        "seconds_per_step": seconds,
        "backward_s": seconds / 2,
        "opt_step_s": 0.01,
        "options": {},
    }
    return {"status": "ok", "phases": [phase]}


def _earlier(results: Path) -> conv_results.Report:
    """A plain run of none (1.0 s/step shaped, 0.4 1gbit), q8 and fp16, written to ``results``."""
    runs = {"none": _run(1.8), "q8": _run(1.81), "fp16": _run(1.8)}
    timings = {
        SHAPED: {"none": _timing(1.0), "q8": _timing(0.5), "fp16": _timing(0.7)},
        conv_runs.FAST_LINK: {"none": _timing(0.4), "q8": _timing(0.35), "fp16": _timing(0.38)},
    }
    report = conv_results.Report(["none", "q8", "fp16"], runs, timings, SHAPED, 150)
    conv_results.write(report, ["task: made up", "q8: its line"], 0.0)
    return report


def _powersgd(final: float, shaped_seconds: float) -> conv_results.Report:
    """A fresh run of powersgd alone (validation falling to ``final``; 0.4 s/step on 1gbit)."""
    timings = {SHAPED: {"powersgd": _timing(shaped_seconds)}, conv_runs.FAST_LINK: {"powersgd": _timing(0.4)}}
    return conv_results.Report(["powersgd"], {"powersgd": _run(final)}, timings, SHAPED, 150)


def _summary(results: Path) -> dict:
    return json.loads((results / "bench_convergence.curves.json").read_text())["summary"]


def _rows(results: Path) -> list[dict]:
    return json.loads((results / "bench_convergence.json").read_text())["rows"]


def test_a_written_result_reads_back_to_the_same_rows_and_summary(results: Path) -> None:
    report = _earlier(results)
    rows, summary, curves, target = conv_results.assemble(report)
    previous = conv_results.load_previous(results)
    again = conv_results.assemble(previous.report)
    assert previous.report.methods == ["none", "q8", "fp16"] and previous.rate == "57mbit"
    assert previous.report.steps == 150
    assert json.loads(json.dumps(again[1])) == json.loads(json.dumps(summary))
    assert [(r.case, r.backend, r.value, r.ratio) for r in again[0]] == [
        (r.case, r.backend, r.value, r.ratio) for r in rows
    ]
    assert again[3] == target
    # derived notes are dropped on reading (written again), the setup lines kept
    assert previous.notes == ["task: made up", "q8: its line"]


def test_merge_adds_a_method_compared_with_dense_timed_in_its_own_run(results: Path) -> None:
    _earlier(results)
    before = _summary(results)
    previous = conv_results.load_previous(results)
    # this run was slower (load): dense 2.0 s/step shaped, 0.8 s on 1gbit; powersgd 0.5 and 0.4
    fresh = _powersgd(1.9, 0.5)
    dense = {SHAPED: _timing(2.0), conv_runs.FAST_LINK: _timing(0.8)}
    notes = ["powersgd: PowerSGD rank 4", "shaped 57mbit: veth ...", "merged now: powersgd"]
    report, merged_notes = conv_results.merge(previous, fresh, dense, "now", notes)
    conv_results.write(report, merged_notes, 0.0)
    after = _summary(results)

    assert list(after) == ["none", "q8", "powersgd", "fp16"]  # LOSS_METHODS' order
    for method in ("none", "q8", "fp16"):  # the kept rows are unchanged
        assert after[method] == before[method]
    entry = after["powersgd"]
    assert entry["shaped_speedup"] == pytest.approx(4.0) and entry["fast_speedup"] == pytest.approx(2.0)
    assert entry["vs_reference_pct"] == pytest.approx(100 * (1.9 / 1.8 - 1))
    # time to 1.8 * 1.02 = 1.836: powersgd (losses 2.5, 2.1, 1.9) never gets there; dense at step 150
    assert "time_to_target" not in entry or entry["time_to_target"] is None
    ratio_rows = {(r["case"], r["backend"]): r["ratio"] for r in _rows(results) if r["metric"] == "step_time"}
    assert ratio_rows[(SHAPED, "powersgd")] == pytest.approx(4.0)
    assert ratio_rows[(SHAPED, "q8")] == pytest.approx(2.0)
    assert ratio_rows[(conv_runs.FAST_LINK, "none")] == pytest.approx(1.0)

    written = json.loads((results / "bench_convergence.json").read_text())["notes"]
    assert sum(n.startswith("time-to-loss target:") for n in written) == 1
    assert "powersgd: PowerSGD rank 4" in written and "merged now: powersgd" in written
    assert "merge of now: shaped 57mbit: veth ..." in written
    md = (results / "bench_convergence.md").read_text()
    assert "| powersgd (adamw) | 1.9000 | +5.56% | 0.500 | 4.00x | 0.400 | 2.00x |" in md


def test_a_second_merge_keeps_each_run_against_its_own_dense(results: Path) -> None:
    _earlier(results)
    first = _powersgd(1.7, 0.5)
    report, notes = conv_results.merge(
        conv_results.load_previous(results),
        first,
        {SHAPED: _timing(2.0), conv_runs.FAST_LINK: _timing(0.8)},
        "first",
        [],
    )
    conv_results.write(report, notes, 0.0)
    # redo q8 (timed under no load: dense 1.0) and rerun dense itself
    second = conv_results.Report(
        ["none", "q8"],
        {"none": _run(1.8), "q8": _run(1.805)},
        {
            SHAPED: {"none": _timing(1.0), "q8": _timing(0.25)},
            conv_runs.FAST_LINK: {"none": _timing(0.4), "q8": _timing(0.2)},
        },
        SHAPED,
        150,
    )
    report, notes = conv_results.merge(
        conv_results.load_previous(results),
        second,
        {SHAPED: _timing(1.0), conv_runs.FAST_LINK: _timing(0.4)},
        "second",
        [],
    )
    conv_results.write(report, notes, 0.0)
    after = _summary(results)
    assert after["powersgd"]["shaped_speedup"] == pytest.approx(4.0)  # still against the first merge's 2.0
    assert after["q8"]["shaped_speedup"] == pytest.approx(4.0)
    assert after["fp16"]["shaped_speedup"] == pytest.approx(1.0 / 0.7)  # the earliest run's dense
    assert after["q8"]["val_loss"] == 1.805
    # powersgd (losses 2.3, 1.9, 1.7) reaches 1.836 at step 100 + 50 * 0.064 / 0.2 = 116: 58 s at 0.5 s;
    # dense of the first merge (2.0 s/step) reaches it at step 145 + ... : ratio against that, not 1.0 s
    target = 1.8 * conv_runs.TARGET_SLACK
    t_dense = conv_runs.time_to_loss([50, 100, 150], [2.4, 2.0, 1.8], _timing(2.0), target)[0]
    assert after["powersgd"]["time_to_target"] == pytest.approx(0.5 * 116)
    assert after["powersgd"]["ttt_vs_dense"] == pytest.approx(t_dense / (0.5 * 116))
    assert after["powersgd"]["ttt_vs_fp16"] is None  # fp16 was timed in another run
    merged = json.loads((results / "bench_convergence.curves.json").read_text())["merged"]
    assert merged["origin"] == {"none": "second", "q8": "second", "powersgd": "first", "fp16": ""}


def test_merge_drops_the_earlier_timing_of_a_method_it_reruns_untimed(results: Path) -> None:
    _earlier(results)
    fresh = conv_results.Report(["q8"], {"q8": _run(1.9)}, {}, SHAPED, 150)
    report, _ = conv_results.merge(conv_results.load_previous(results), fresh, {}, "now", [])
    assert all("q8" not in per for per in report.timings.values())
    assert "none" in report.timings[SHAPED]
    _, summary, _, _ = conv_results.assemble(report)
    assert "shaped_step" not in summary["q8"] and math.isclose(summary["q8"]["val_loss"], 1.9)


def test_merge_refuses_another_step_count_and_a_missing_result(results: Path) -> None:
    _earlier(results)
    fresh = conv_results.Report(["q8"], {"q8": _run(1.9)}, {}, SHAPED, 500)
    with pytest.raises(ValueError, match="the earlier result ran 150 steps, this run 500"):
        conv_results.merge(conv_results.load_previous(results), fresh, {}, "now", [])
    (results / "bench_convergence.curves.json").unlink()
    with pytest.raises(FileNotFoundError, match="no earlier result .*bench_convergence.curves.json"):
        bench.main(["--merge", "--methods", "powersgd"])


def test_a_timing_run_that_crashed_is_run_once_more_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    result = {
        "step_seconds": [9.0, 1.0, 2.0, 3.0],
        "backward_seconds": [9.0, 0.5, 0.5, 0.5],
        "optimizer_seconds": [9.0, 0.1, 0.1, 0.1],
    }

    def launch(args, link, port, timeout_s, work, tag):
        calls.append((port, tag))
        if len(calls) == 1:
            return conv_runs.Run("crashed (rank 0 exit -6): terminate called without an active exception")
        return conv_runs.Run("ok", result)

    monkeypatch.setattr(conv_runs, "launch_example", launch)
    settings = conv_runs.Settings(500, 1, 3, tmp_path, tmp_path, False)
    measured, status, crashed = conv_runs.time_phase(
        "q8", conv_runs.Phase("all", 1, 500), None, settings, "t", 29600
    )
    assert status == "ok" and measured == {"seconds_per_step": 2.0, "backward_s": 0.5, "opt_step_s": 0.1}
    assert crashed.startswith("crashed (rank 0 exit -6)")
    assert calls == [(29600, "t"), (29605, "t-again")]
    calls.clear()
    crashed_again = conv_runs.Run("crashed (rank 1 exit 1)")
    monkeypatch.setattr(conv_runs, "launch_example", lambda *a: calls.append(a) or crashed_again)
    measured, status, crashed = conv_runs.time_phase(
        "q8", conv_runs.Phase("all", 1, 500), None, settings, "t", 29600
    )
    assert measured is None and status == "crashed (rank 1 exit 1)" and len(calls) == 2


def test_a_merge_whose_methods_were_all_rerun_since_leaves_no_notes(results: Path) -> None:
    _earlier(results)
    for label, seconds in (("first", 0.5), ("second", 0.45)):
        fresh = _powersgd(1.7, seconds)
        notes = [f"merged {label}: powersgd trained", "link: measured", "powersgd: its line"]
        report, merged = conv_results.merge(
            conv_results.load_previous(results),
            fresh,
            {SHAPED: _timing(2.0), conv_runs.FAST_LINK: _timing(0.8)},
            label,
            notes,
        )
        conv_results.write(report, merged, 0.0)
    assert not [n for n in merged if "first" in n]  # every first-merge row was replaced by the second's
    assert "merge of second: link: measured" in merged and "merged second: powersgd trained" in merged
    assert merged.count("powersgd: its line") == 1 and "q8: its line" in merged
    assert set(report.dense) == {"", "second"}
    assert _summary(results)["powersgd"]["shaped_speedup"] == pytest.approx(2.0 / 0.45)


def test_a_short_form_names_the_committed_full_result() -> None:
    note = bench._short_form_note(["none", "topk", "cadam"], 300)
    counts = f"3 of {len(conv_runs.LOSS_METHODS)} methods, 300 of {conv_runs.FULL_STEPS} steps"
    assert note.startswith(f"short form ({counts})")
    assert str(harness.RESULTS_DIR / "bench_convergence.md") in note and "make bench FULL=1" in note


def test_the_committed_result_reads_back_with_the_timing_of_both_links() -> None:
    # What --merge starts from: every timed method of the committed run keeps its phases on both links.
    previous = conv_results.load_previous(harness.RESULTS_DIR)
    assert set(previous.report.timings) == {previous.report.shaped_name, conv_runs.FAST_LINK}
    timed = [m for m in previous.report.methods if m not in conv_runs.LOSS_ONLY]
    for timing in previous.report.timings.values():
        assert all(timing[m]["phases"] for m in timed)
