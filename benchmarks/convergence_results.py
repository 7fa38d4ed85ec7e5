"""The result of :mod:`benchmarks.bench_convergence` as data: what its files are written from
(:class:`Report`), the rows and summary assembled from it, the files written, an earlier result read back,
and a ``--merge`` of fresh runs into it.

Example::

    rows, summary, curves, target = assemble(report)
    write(load_example(), report, notes, started=time.perf_counter())
    previous = load_previous(RESULTS_DIR)
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import median
from benchmarks.convergence_runs import (
    FAST_LINK,
    LOSS_METHODS,
    NAME,
    REFERENCE,
    TARGET_SLACK,
    Run,
    elapsed,
    last_phase_step,
    mean_step,
    time_to_loss,
)
from benchmarks.convergence_tables import pct, phase_text, plot, rounded, summary_table, verdict_lines
from benchmarks.harness import Row, output_dir, write_results
from benchmarks.lm_methods import METHODS

__all__ = [
    "DERIVED_NOTES",
    "Previous",
    "Report",
    "assemble",
    "derived_notes",
    "load_previous",
    "merge",
    "merge_label",
    "write",
]


@dataclasses.dataclass
class Report:
    """What the files are written from: each method's loss run and per-link timing, and which run timed it.

    ``origin[method]`` names the run a method was trained and timed in ("" for this one); ``dense[origin]``
    is dense allreduce's timing per link in that run, the reference of that run's speed ratios (a merged
    file holds rows of several runs, each compared with its own run's dense step, never across runs).
    """

    methods: list[str]
    runs: dict[str, Run]
    timings: dict[str, dict[str, dict[str, Any]]]  # link name -> method -> {"status", "phases"}
    shaped_name: str
    steps: int
    origin: dict[str, str] = dataclasses.field(default_factory=dict)
    dense: dict[str, dict[str, dict[str, Any]]] = dataclasses.field(default_factory=dict)

    def dense_timing(self, method: str, link_name: str) -> dict[str, Any]:
        origin = self.origin.get(method, "")
        if origin in self.dense:
            return self.dense[origin].get(link_name, {})
        return self.timings.get(link_name, {}).get("none", {})


def assemble(
    report: Report,
) -> tuple[list[Row], dict[str, dict[str, Any]], dict[str, dict[str, Any]], float | None]:
    """The harness rows, the summary and the curves of ``report``, and the time-to-loss target."""
    runs, timings, shaped_name, steps = report.runs, report.timings, report.shaped_name, report.steps
    fast_name = FAST_LINK

    def final(method: str) -> float | None:
        run = runs.get(method)
        return run.result["val_losses"][-1] if run and run.status == "ok" and run.result else None

    dense_loss = final("none")
    target = dense_loss * TARGET_SLACK if dense_loss is not None else None
    rows: list[Row] = []
    summary: dict[str, dict[str, Any]] = {}
    curves: dict[str, dict[str, Any]] = {}
    for method in report.methods:
        spec = METHODS[method]
        run = runs[method]
        reference = REFERENCE.get(method, "none")
        entry: dict[str, Any] = {"optimizer": spec.optimizer, "reference": reference, "status": run.status}
        loss, ref_loss = final(method), final(reference)
        if loss is not None:
            entry["val_loss"] = loss
            if ref_loss is not None and method != reference:
                entry["vs_reference_pct"] = pct(loss, ref_loss)
            rows.append(
                Row(
                    case=f"val loss at step {steps}",
                    backend=method,
                    metric="val_loss",
                    value=loss,
                    unit="nats/byte",
                    ratio=loss / ref_loss if ref_loss else None,
                    ratio_to=f"{reference} loss" if ref_loss and method != reference else None,
                    extra={"status": run.status},
                )
            )
        else:
            rows.append(
                Row(
                    case=f"val loss at step {steps}",
                    backend=method,
                    metric="val_loss",
                    value=math.nan,
                    unit="nats/byte",
                    extra={"status": run.status},
                )
            )
        curve = {"label": spec.description, "optimizer": spec.optimizer, "status": run.status}
        if run.result:
            curve.update(
                val_steps=run.result["val_steps"],
                val_losses=run.result["val_losses"],
                train_losses=run.result["train_losses"],
                loopback_step_seconds=median(run.result["step_seconds"]),
                hook_stats=run.result["hook_stats"],
            )
        for link_name, key in ((shaped_name, "shaped"), (fast_name, "fast")):
            timing = timings.get(link_name, {}).get(method)
            if timing is None:
                continue
            dense_timing = report.dense_timing(method, link_name)
            last, dense_step = last_phase_step(timing), last_phase_step(dense_timing)
            mean, dense_mean = mean_step(timing), mean_step(dense_timing)
            entry[f"{key}_text"] = phase_text(timing)
            if timing["phases"]:
                entry[f"{key}_backward"] = timing["phases"][-1].get("backward_s")
                entry[f"{key}_opt_step"] = timing["phases"][-1].get("opt_step_s")
            entry[f"{key}_step"] = mean
            if len(timing["phases"]) > 1:
                entry[f"{key}_step_compressed"] = last
            elif method == "cadam":
                entry[f"{key}_step_compressed"] = last
            if mean and dense_mean:
                entry[f"{key}_speedup"] = dense_mean / mean
            curve[f"{key}_phases"] = timing["phases"]
            for phase in timing["phases"] or [{"name": "all", "seconds_per_step": None}]:
                value = phase["seconds_per_step"]
                rows.append(
                    Row(
                        case=link_name,
                        backend=method,
                        metric="step_time",
                        value=value if value is not None else math.nan,
                        unit="s",
                        ratio=dense_step / value if value and dense_step else None,
                        ratio_to="dense allreduce speedup" if value and dense_step else None,
                        extra={
                            "phase": phase["name"],
                            "status": timing["status"],
                            "backward_s": rounded(phase.get("backward_s")),
                            "opt_step_s": rounded(phase.get("opt_step_s")),
                        },
                    )
                )
            if key == "shaped" and run.result and elapsed(timing, 1) is not None:
                curve["shaped_seconds"] = [elapsed(timing, s) for s in run.result["val_steps"]]
                if target is not None:
                    entry["time_to_target"], entry["step_to_target"] = time_to_loss(
                        run.result["val_steps"], run.result["val_losses"], timing, target
                    )
        summary[method] = entry
        curves[method] = curve

    def dense_time(method: str) -> float | None:
        """Dense allreduce's time to the target in the run ``method`` was timed in."""
        if report.origin.get(method, "") == report.origin.get("none", ""):
            return summary.get("none", {}).get("time_to_target")
        none = runs.get("none")
        timing = report.dense_timing(method, shaped_name)
        if target is None or none is None or not none.result or elapsed(timing, 1) is None:
            return None
        return time_to_loss(none.result["val_steps"], none.result["val_losses"], timing, target)[0]

    t_fp16 = summary.get("fp16", {}).get("time_to_target")
    for method, entry in summary.items():
        seconds = entry.get("time_to_target")
        if seconds is None:
            continue
        t_dense = dense_time(method)
        same_fp16 = report.origin.get(method, "") == report.origin.get("fp16", "")
        entry["ttt_vs_dense"] = t_dense / seconds if t_dense else None
        entry["ttt_vs_fp16"] = t_fp16 / seconds if t_fp16 and same_fp16 else None
        rows.append(
            Row(
                case=f"{shaped_name}: time to dense loss + 2%",
                backend=method,
                metric="time_to_loss",
                value=seconds,
                unit="s",
                ratio=entry["ttt_vs_dense"],
                ratio_to="dense time / this",
                extra={
                    "step": round(entry["step_to_target"], 1),
                    "vs_fp16": round(entry["ttt_vs_fp16"], 2) if entry["ttt_vs_fp16"] else "",
                },
            )
        )
    return rows, summary, curves, target


# notes that write derives from the numbers (a merge drops the old ones and derives them again)
DERIVED_NOTES = ("time-to-loss target:", "benchmark wall time:", "backward_s / opt_step_s:", "speedup = ")


def derived_notes(steps: int, target: float | None, dense_loss: float | None) -> list[str]:
    lines = []
    if target is not None and dense_loss is not None:
        lines.append(
            f"time-to-loss target: dense AdamW's {steps}-step validation loss {dense_loss:.4f} "
            f"+ 2% = {target:.4f}"
        )
    return lines


def write(report: Report, notes: list[str], started: float) -> str:
    """Write ``bench_convergence.json/.md/.png/.curves.json`` from ``report`` and return the Markdown."""
    rows, summary, curves, target = assemble(report)
    none = report.runs.get("none")
    dense_loss = none.result["val_losses"][-1] if none and none.status == "ok" and none.result else None
    notes = [*notes, *derived_notes(report.steps, target, dense_loss)]
    verdicts = verdict_lines(summary, report.shaped_name)
    for line in verdicts:
        print(f"[{NAME}] {line}", file=sys.stderr, flush=True)
    notes += verdicts
    total = time.perf_counter() - started
    print(f"[{NAME}] total {total:.0f} s", file=sys.stderr, flush=True)
    notes.append(
        f"benchmark wall time: {total:.0f} s (2 CPU cores shared with other work; loss runs "
        f"reused from --work-dir count as 0)"
    )
    notes.append(
        "backward_s / opt_step_s: rank 0's median backward (DDP's hooks and their communication "
        "included) and optimizer.step() of the last phase: opt_step_s bounds what fusing the "
        "optimizer step into the hook could save"
    )
    notes.append(
        "speedup = dense allreduce's step time / this (phases weighted by their share of the run); "
        "time to target = seconds on the shaped link until the validation loss reaches dense's "
        "final loss + 2% (linear between validation points every 50 steps); '-' = never reached"
    )
    text = write_results(NAME, rows, notes=notes, plot_metric="loss curves are drawn by this script")
    table = summary_table(summary, report.shaped_name)
    with (output_dir() / f"{NAME}.md").open("a") as handle:
        handle.write(f"\n## Summary\n\n{table}\n")
    saved: dict[str, Any] = {
        "target": target,
        "shaped_link": report.shaped_name,
        "curves": curves,
        "summary": summary,
    }
    if report.dense:  # a merge: which run each row is from, and each run's dense timing (the next merge's)
        saved["merged"] = {"origin": report.origin, "dense": report.dense}
    (output_dir() / f"{NAME}.curves.json").write_text(json.dumps(saved, indent=1))
    plot(curves, report.shaped_name, target, output_dir() / f"{NAME}.png")
    return f"{text}\n## Summary\n\n{table}\n"


@dataclasses.dataclass
class Previous:
    """An earlier result read back: its methods, loss runs and timings, and the notes it was written with
    (less those :func:`write` derives again)."""

    report: Report
    notes: list[str]
    rate: str | None  # the shaped link's tbf rate ("57mbit"), None if it was not timed


def load_previous(directory: Path) -> Previous:
    """Read ``bench_convergence.json`` and ``.curves.json`` from ``directory`` back into runs and timings.

    A loss run comes back as its validation curve, training losses, hook stats and loopback median step
    time (what the files keep); a timing as its phases and the status its step-time rows carry.

    Raises:
        FileNotFoundError: a file is missing (nothing to merge into).
        ValueError: a method of the file is no longer in ``METHODS``.
    """
    json_path, curves_path = directory / f"{NAME}.json", directory / f"{NAME}.curves.json"
    for path in (json_path, curves_path):
        if not path.exists():
            raise FileNotFoundError(f"--merge: no earlier result {path} to merge into")
    payload = json.loads(json_path.read_text())
    saved = json.loads(curves_path.read_text())
    shaped_name = saved["shaped_link"]
    methods = list(saved["curves"])
    gone = [m for m in methods if m not in METHODS]
    if gone:
        raise ValueError(f"--merge: {curves_path.name} has method(s) {gone} that METHODS lacks")
    steps_cases = {r["case"] for r in payload["rows"] if r["metric"] == "val_loss"}
    steps = int(next(iter(steps_cases)).rsplit(" ", 1)[-1]) if steps_cases else 0
    status_of = {
        (r["case"], r["backend"]): r["extra"].get("status", "ok")
        for r in payload["rows"]
        if r["metric"] == "step_time"
    }
    runs: dict[str, Run] = {}
    timings: dict[str, dict[str, dict[str, Any]]] = {}
    for method, curve in saved["curves"].items():
        result = None
        if curve.get("val_steps"):
            result = {
                "method": method,
                "val_steps": curve["val_steps"],
                "val_losses": curve["val_losses"],
                "train_losses": curve.get("train_losses", []),
                "step_seconds": [curve.get("loopback_step_seconds", math.nan)],
                "hook_stats": curve.get("hook_stats"),
            }
        runs[method] = Run(curve["status"], result)
        for link_name, key in ((shaped_name, "shaped"), (FAST_LINK, "fast")):
            if f"{key}_phases" in curve:
                timings.setdefault(link_name, {})[method] = {
                    "status": status_of.get((link_name, method), "ok"),
                    "phases": curve[f"{key}_phases"],
                }
    verdict_labels = {line.split(": ")[0] for line in verdict_lines({}, shaped_name)}
    notes = [
        n
        for n in payload["notes"]
        if not n.startswith(DERIVED_NOTES) and n.split(": ")[0] not in verdict_labels
    ]
    rate = shaped_name.split()[-1] if shaped_name.startswith("shaped ") else None
    merged = saved.get("merged", {})  # which run each method came from, when the file is a merge
    origin, dense = dict(merged.get("origin", {})), dict(merged.get("dense", {}))
    return Previous(Report(methods, runs, timings, shaped_name, steps, origin, dense), notes, rate)


def merge_label(note: str) -> str | None:
    """The run label of a note written by a merge (``"merge of <label>: ..."``, ``"merged <label>: ..."``)."""
    for prefix in ("merge of ", "merged "):
        if note.startswith(prefix) and ": " in note:
            return note[len(prefix) : note.index(": ")]
    return None


def merge(
    previous: Previous,
    fresh: Report,
    fresh_dense: dict[str, dict[str, Any]],
    label: str,
    notes: list[str],
) -> tuple[Report, list[str]]:
    """``previous`` with ``fresh``'s methods added or replacing theirs; the notes merged.

    Every method keeps the run it was measured in: the earlier ones origin "" (their speed ratios against
    the earlier run's dense timing, kept even if "none" is rerun), the rerun ones origin ``label`` (against
    ``fresh_dense``, dense allreduce timed in the same run). The method order follows ``LOSS_METHODS``,
    methods not in it last. ``notes``: this run's notes for its methods (the ``"<method>: ..."`` lines
    replace the earlier ones, the rest are appended).
    """
    old = previous.report
    if fresh.steps != old.steps:
        raise ValueError(f"--merge: the earlier result ran {old.steps} steps, this run {fresh.steps}")
    known = [*old.methods, *(m for m in fresh.methods if m not in old.methods)]
    methods = [m for m in LOSS_METHODS if m in known] + [m for m in known if m not in LOSS_METHODS]
    runs = {**old.runs, **fresh.runs}
    # a rerun method's earlier timing goes with its earlier loss run, even when this run did not time it
    timings = {
        name: {m: t for m, t in per.items() if m not in fresh.runs} for name, per in old.timings.items()
    }
    for name, per in fresh.timings.items():
        timings.setdefault(name, {}).update(per)
    origin = {m: (label if m in fresh.runs else old.origin.get(m, "")) for m in methods}
    dense = {**old.dense, label: fresh_dense}
    if "" not in dense:  # the earlier run's own dense timing, before a rerun "none" replaces it
        dense[""] = {name: per["none"] for name, per in old.timings.items() if "none" in per}
    report = Report(methods, runs, timings, old.shaped_name, old.steps, origin, dense)
    replaced = {n.split(": ")[0]: n for n in notes if n.split(": ")[0] in fresh.runs}
    # an earlier merge whose every method was rerun since describes no row any more: its notes go
    in_use = set(origin.values())
    report.dense = {run: timing for run, timing in report.dense.items() if run in in_use or run == ""}
    kept = [n for n in previous.notes if merge_label(n) in in_use or merge_label(n) is None]
    merged = [replaced.pop(n.split(": ")[0], n) for n in kept]
    merged += replaced.values()  # the new methods' lines
    merged += [
        n if n.startswith("merged ") else f"merge of {label}: {n}"
        for n in notes
        if n.split(": ")[0] not in fresh.runs
    ]
    return report, merged


