"""Loss parity and time-to-loss of each method on a real task: the LM of ``examples/train_lm.py``.

The question: a hook that makes a step faster only pays if the training still reaches the same loss; does
each method reach dense's loss, and how much sooner in wall time on a slow link?

1. The task, model, data and training loop are ``examples/train_lm.py`` (imported from there and run as
   that script, so the benchmark measures exactly what a user runs): a 1,457,856-parameter byte-level GPT
   on the running Python's stdlib ``.py`` files (5% of the files held out), fastio shards read by
   ``StreamLoader``, 2 gloo ranks of one thread each, batch 16 x 128 tokens per rank, 500 steps, warm-up 30
   then cosine, the same seed and data order for every method.
2. Loss runs (loopback): each method trains 500 steps in its own pair of rank processes (killed at a
   timeout, or 15 s after one rank fails); validation loss every 50 steps and at 500.
3. Speed runs: each method's step time (slower rank's median over the timed steps, after warm-up steps)
   on a netlab link (:mod:`benchmarks.netlab`) shaped so dense allreduce's communication is about 3x the
   no-communication step (the rate is derived from the measured no-op step and the dense payload, then
   verified), and on a 1 Gbit/s link. A method with two phases (CompressedAdam's dense warm-up, DGC's
   sparsity warm-up) is timed in each phase: the warm-up phase as configured, the later phase in a run
   whose warm-up is set to 2 steps (``--opt warmup_steps=2``), whose warm-up steps are not timed.
4. Loss vs seconds: the loss trajectory does not depend on the link, so a step's wall time on a link is
   the measured step time of the phase the step is in; the time to a loss is found by linear interpolation
   between validation points (every 50 steps) of validation loss against that cumulative time.
5. Written to ``harness.output_dir()``: ``bench_convergence.json/.md`` (harness rows and a summary table),
   ``bench_convergence.png`` (validation loss vs step and vs seconds on the shaped link, one line per
   method, dense AdamW drawn as the reference) and ``bench_convergence.curves.json`` (every curve).
6. ``--merge``: add (or redo) ``--methods`` in the existing result without training the others. Only
   they are trained and timed; dense allreduce is timed again on both links in the same run (under the
   same load) as their speed reference, and its first 50 steps are trained again to check that they
   repeat the kept loss curve bit for bit (the kept dense loss stays the loss reference). Every other row
   is kept as it was, each compared with the dense timing of the run it came from (kept in
   ``curves.json["merged"]``); a note says what was rerun, when, and under which load.

Run::

    python -m benchmarks.bench_convergence    # everything: ~8,000 training steps, ~1.8 h on 2 idle cores
    python -m benchmarks.bench_convergence --steps 100 --methods none,q8,cadam --timed-steps 5
    python -m benchmarks.bench_convergence --work-dir /tmp/conv   # keep (and reuse) each run's result
    python -m benchmarks.bench_convergence --merge --methods powersgd   # add one method: ~15 min
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import netlab
from benchmarks.common import REPO_ROOT, free_port, launch, median, rank_env, tail
from benchmarks.harness import RESULTS_DIR, Row, output_dir, progress, write_results

__all__ = ["LOSS_METHODS", "main"]

EXAMPLE = REPO_ROOT / "examples" / "train_lm.py"
NAME = "bench_convergence"
# Rows of the loss comparison, each against its dense reference (AdamW rows: "none"; DGC: dense SGD m0.9).
LOSS_METHODS = (
    "none",
    "cast",
    "q8",
    "q4",
    "topk",
    "sign",
    "powersgd",
    "cadam",
    "cadam_w100",
    "cadam_q8w",
    "cadam_q8",
    "fp16",
    "sgd",
    "sgd_clip",
    "dgc",
    "diloco",
    "diloco_q4",
    "streaming_q4",
)
REFERENCE = {"sgd": "none", "sgd_clip": "sgd", "dgc": "sgd"}
LOSS_ONLY = {"sgd_clip": "a loss reference (top-k at ratio 1.0 sends twice the dense bytes): not timed"}
FULL_STEPS = 500  # the committed result's loss runs
FAST_LINK = "1gbit"
COMM_TO_COMPUTE = 3.0  # the shaped link: dense allreduce's communication about 3x the no-comm step
TARGET_SLACK = 1.02  # time to reach dense AdamW's 500-step validation loss + 2%
_FAIL_GRACE_S = 15.0


def load_example() -> Any:
    """``examples/train_lm.py`` as a module (the one source of the model, data, methods and loop)."""
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------------
# Launching one method on two rank processes


@dataclasses.dataclass
class _Run:
    status: str  # "ok", or what went wrong
    result: dict[str, Any] | None = None
    seconds: float = 0.0


def _launch(
    args: Sequence[str], link: netlab.Link | None, port: int, timeout_s: float, work: Path, tag: str
) -> _Run:
    """Run ``examples/train_lm.py args`` as ranks 0 and 1 (in the link's namespaces when given)."""
    out = work / f"{tag}.json"
    out.unlink(missing_ok=True)
    master = link.addresses[0] if link else "127.0.0.1"
    command = [sys.executable, str(EXAMPLE), *args, "--json", str(out)]
    commands = [[*link.exec_prefix(r), *command] if link else command for r in range(2)]
    interfaces = link.interfaces if link else ("lo", "lo")
    envs = [rank_env(r, 2, port, master, GLOO_SOCKET_IFNAME=interfaces[r]) for r in range(2)]
    logs = [work / f"{tag}.rank{r}.log" for r in range(2)]
    ranks = launch(commands, envs, logs, timeout_s, fail_grace_s=_FAIL_GRACE_S)
    if not ranks.ok:
        return _Run(ranks.describe(), seconds=ranks.seconds)
    if not out.exists():
        return _Run(f"no result written: {tail(ranks.logs[0])}", seconds=ranks.seconds)
    return _Run("ok", json.loads(out.read_text()), ranks.seconds)


# ---------------------------------------------------------------------------------------------------------
# Phases and timing


@dataclasses.dataclass(frozen=True)
class _Phase:
    """Steps ``first..last`` of the loss run, timed in a run with ``options`` added.

    ``period``: 0, the step time is the median of the timed steps; else the timed steps are whole periods
    of that many steps (DiLoCo's syncs) and the step time is their mean.
    """

    name: str
    first: int
    last: int
    options: tuple[tuple[str, Any], ...] = ()
    period: int = 0


def _phases(train_lm: Any, method: str, steps: int) -> list[_Phase]:
    options = train_lm.METHODS[method].options
    warmup = int(options.get("warmup_steps", 0))
    if method.startswith("cadam") and 0 < warmup < steps:
        return [
            _Phase("dense warm-up", 1, warmup),
            _Phase("compressed", warmup + 1, steps, (("warmup_steps", 2),)),
        ]
    if method == "dgc" and 0 < warmup < steps:
        return [
            _Phase("sparsity warm-up", 1, warmup),
            _Phase("top-k", warmup + 1, steps, (("warmup_steps", 0),)),
        ]
    if train_lm.METHODS[method].optimizer == "diloco":
        return [_Phase("all", 1, steps, period=int(options["sync_every"]))]
    return [_Phase("all", 1, steps)]


@dataclasses.dataclass(frozen=True)
class _Settings:
    steps: int
    warmup: int
    timed: int
    data_dir: Path
    work: Path
    reuse: bool
    reuse_only: bool = False
    seed: int = 0  # train_lm's --seed (initial weights and data order); loss runs only


def _time_phase(
    method: str, phase: _Phase, link: netlab.Link | None, settings: _Settings, tag: str, port: int
) -> tuple[dict[str, float] | None, str, str | None]:
    """Medians over the timed steps of ``method`` in ``phase`` on ``link`` (the slower rank's step time,
    rank 0's backward and optimizer step), the run's status, and how a first run crashed if it did.

    A crashed run is run once more (gloo now and then aborts a rank at process exit, after its steps:
    "terminate called without an active exception"); the second run's numbers are the row's, and the
    first run's status is returned for the notes."""
    timed_steps = -(-settings.timed // phase.period) * phase.period if phase.period else settings.timed
    n = settings.warmup + timed_steps
    args = [
        "--hook",
        method,
        "--steps",
        str(n),
        "--schedule-steps",
        str(settings.steps),
        "--eval-every",
        "0",
        "--val-rows",
        "1",
        "--log-every",
        "0",
        "--data-dir",
        str(settings.data_dir),
    ]
    for key, value in phase.options:
        args += ["--opt", f"{key}={value}"]
    run = _launch(args, link, port, 90.0 + 20.0 * n, settings.work, tag)
    crashed = None
    if run.status.startswith("crashed"):
        crashed = run.status
        run = _launch(args, link, port + 5, 90.0 + 20.0 * n, settings.work, f"{tag}-again")
    if run.status != "ok" or run.result is None:
        return None, run.status, crashed
    timed = slice(settings.warmup, None)
    steps_taken = run.result["step_seconds"][timed]
    return (
        {
            "seconds_per_step": sum(steps_taken) / len(steps_taken) if phase.period else median(steps_taken),
            "backward_s": median(run.result["backward_seconds"][timed]),
            "opt_step_s": median(run.result["optimizer_seconds"][timed]),
        },
        "ok",
        crashed,
    )


def _time_link(
    train_lm: Any,
    methods: Sequence[str],
    link: netlab.Link | None,
    link_name: str,
    settings: _Settings,
    available: dict[str, str | None],
) -> dict[str, dict[str, Any]]:
    """Per method: each phase's step time on ``link`` (``{"phases": [...], "status": ...}``)."""
    timings: dict[str, dict[str, Any]] = {}
    for index, method in enumerate(methods):
        if available.get(method) or method in LOSS_ONLY:
            why = available.get(method) or LOSS_ONLY[method]
            timings[method] = {"status": f"skipped: {why}", "phases": []}
            continue
        phases = []
        status = "ok"
        crashes = []
        for number, phase in enumerate(_phases(train_lm, method, settings.steps)):
            port = 29600 + 10 * index + number if link else free_port()
            begin = time.perf_counter()
            measured, phase_status, crashed = _time_phase(
                method, phase, link, settings, f"time-{link_name}-{method}-{number}", port
            )
            if crashed:
                crashes.append(f"{phase.name}: {crashed}")
            shown = (
                f"{measured['seconds_per_step']:.3f} s/step (backward {measured['backward_s']:.3f}, "
                f"optimizer {measured['opt_step_s']:.4f})"
                if measured
                else phase_status
            )
            print(
                f"[{NAME}] {link_name:10s} {method:8s} {phase.name:16s} {shown} "
                f"({time.perf_counter() - begin:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            if measured is None:
                status = phase_status
            phases.append(
                {
                    "name": phase.name,
                    "first": phase.first,
                    "last": phase.last,
                    "seconds_per_step": None,
                    **(measured or {}),
                    "options": dict(phase.options),
                }
            )
        timings[method] = {"status": status, "phases": phases}
        if crashes:
            timings[method]["first_run_crashed"] = crashes
    return timings


def _mean_step(timing: dict[str, Any]) -> float | None:
    """The step time averaged over the whole run (phases weighted by their length)."""
    phases = timing.get("phases") or []
    if not phases or any(p["seconds_per_step"] is None for p in phases):
        return None
    steps = sum(p["last"] - p["first"] + 1 for p in phases)
    return sum(p["seconds_per_step"] * (p["last"] - p["first"] + 1) for p in phases) / steps


def _last_phase_step(timing: dict[str, Any]) -> float | None:
    phases = timing.get("phases") or []
    return phases[-1]["seconds_per_step"] if phases else None


def _elapsed(timing: dict[str, Any], step: int) -> float | None:
    """Wall seconds of steps 1..``step`` on the link: each step at its phase's measured step time."""
    total = 0.0
    for phase in timing.get("phases") or []:
        if phase["seconds_per_step"] is None:
            return None
        steps_in = max(0, min(step, phase["last"]) - phase["first"] + 1)
        total += steps_in * phase["seconds_per_step"]
    return total


def _time_to_loss(
    val_steps: Sequence[int], val_losses: Sequence[float], timing: dict[str, Any], target: float
) -> tuple[float | None, float | None]:
    """``(seconds, step)`` at which validation loss first reaches ``target`` (linear between points)."""
    points = [(0, 0.0, math.inf)]
    for step, loss in zip(val_steps, val_losses, strict=True):
        seconds = _elapsed(timing, step)
        if seconds is None:
            return None, None
        points.append((step, seconds, loss))
    for (s0, t0, l0), (s1, t1, l1) in zip(points[:-1], points[1:], strict=True):
        if l1 <= target:
            if not math.isfinite(l0):
                return t1, float(s1)
            frac = (l0 - target) / (l0 - l1)
            return t0 + frac * (t1 - t0), s0 + frac * (s1 - s0)
    return None, None


# ---------------------------------------------------------------------------------------------------------
# The shaped link


def _dense_payload_bytes(train_lm: Any) -> int:
    return 4 * sum(p.numel() for p in train_lm.GPT(train_lm.ModelConfig()).parameters())


def _shaped_rate(noop_seconds: float, payload_bytes: int) -> str:
    """The tbf rate at which a ring allreduce of ``payload_bytes`` between 2 ranks (each sends the payload
    once) takes ``COMM_TO_COMPUTE`` x ``noop_seconds``, rounded to a whole Mbit/s."""
    bits_per_second = 8 * payload_bytes / (COMM_TO_COMPUTE * noop_seconds)
    return f"{max(1, round(bits_per_second / 1e6))}mbit"


# ---------------------------------------------------------------------------------------------------------
# Loss runs


def _loss_run(train_lm: Any, method: str, settings: _Settings, available: dict[str, str | None]) -> _Run:
    if available.get(method):
        return _Run(f"skipped: {available[method]}")
    tag = f"loss-{method}-{settings.steps}" + (f"-s{settings.seed}" if settings.seed else "")
    cached = settings.work / f"{tag}.json"
    if settings.reuse and cached.exists():
        found = json.loads(cached.read_text())
        wanted = json.loads(json.dumps(train_lm.METHODS[method].options))
        if found.get("options") == wanted and found.get("start_step") == 0:
            return _Run("ok", found)
        if settings.reuse_only:
            return _Run(
                f"not run: {cached.name} was trained with options {found.get('options')} from step "
                f"{found.get('start_step')}, the method now has {wanted} from step 0"
            )
    if settings.reuse_only:
        return _Run(f"not run: no {cached.name} in --work-dir (--reuse-only)")
    args = [
        "--hook",
        method,
        "--steps",
        str(settings.steps),
        "--eval-every",
        "50",
        "--log-every",
        "50",
        "--data-dir",
        str(settings.data_dir),
        "--seed",
        str(settings.seed),
    ]
    run = _launch(args, None, free_port(), 120.0 + 6.0 * settings.steps, settings.work, tag)
    return run


# ---------------------------------------------------------------------------------------------------------
# Report


def _round(value: float | None) -> float | str:
    return round(value, 4) if value is not None else ""


def _pct(value: float, reference: float) -> float:
    return 100.0 * (value / reference - 1.0)


def _verdicts(summary: dict[str, dict[str, Any]], shaped: str) -> list[str]:
    """The issue's targets, each PASS, FAIL or not evaluated, with the numbers."""

    def val(method: str) -> float | None:
        return summary.get(method, {}).get("val_loss")

    lines = []

    def within(method: str, reference: str, percent: float) -> None:
        v, r = val(method), val(reference)
        label = f"{method} within {percent}% of {reference} at the last step"
        if v is None or r is None:
            lines.append(f"{label}: not evaluated (no loss for {method if v is None else reference})")
            return
        gap = _pct(v, r)
        lines.append(f"{label}: {'PASS' if gap <= percent else 'FAIL'} ({v:.4f} vs {r:.4f}, {gap:+.2f}%)")

    within("cadam", "none", 2.0)
    cadam, dense = summary.get("cadam", {}), summary.get("none", {})
    step_c, step_d = cadam.get("shaped_step_compressed"), dense.get("shaped_step")
    label = f"cadam >= 2.5x faster per step than dense allreduce on the {shaped} link (compressed phase)"
    if step_c and step_d:
        ratio = step_d / step_c
        lines.append(
            f"{label}: {'PASS' if ratio >= 2.5 else 'FAIL'} ({step_d:.3f} s / {step_c:.3f} s = {ratio:.2f}x)"
        )
    else:
        lines.append(f"{label}: not evaluated (no step time)")

    # Each method's time against dense's (and fp16's) timed in the same run (a merged file holds several).
    reached = {
        m: s
        for m, s in summary.items()
        if s.get("time_to_target") is not None
        and s.get("ttt_vs_dense")
        and m not in ("none", "fp16", "sgd", "sgd_clip", "dgc")
    }
    label = (
        f"best fastcomm method >= 2x sooner to dense's loss +2% than dense, and sooner than torch fp16 "
        f"({shaped} link)"
    )
    if reached:
        best = max(reached, key=lambda m: reached[m]["ttt_vs_dense"])
        seconds, vs_dense = reached[best]["time_to_target"], reached[best]["ttt_vs_dense"]
        vs_fp16 = reached[best].get("ttt_vs_fp16")
        fp16 = summary.get("fp16", {})
        ok = vs_dense >= 2.0 and (vs_fp16 is None or vs_fp16 > 1.0)
        if vs_fp16 is not None:
            fp16_text = f", fp16 {seconds * vs_fp16:.0f} s"
        elif fp16.get("time_to_target") is not None:
            fp16_text = ", fp16 not timed in the same run"
        else:
            fp16_text = ", fp16 never reached it" if "fp16" in summary else ", fp16 not run"
        lines.append(
            f"{label}: {'PASS' if ok else 'FAIL'} ({best} {seconds:.0f} s, dense "
            f"{seconds * vs_dense:.0f} s = {vs_dense:.2f}x{fp16_text})"
        )
    else:
        lines.append(f"{label}: not evaluated (no fastcomm method reached it, or dense has no time)")
    within("dgc", "sgd", 2.0)
    within("dgc", "sgd_clip", 2.0)  # the same local clipping without sparsification: what top-k itself costs
    within("q8", "none", 0.5)
    within("cast", "none", 0.5)
    return lines


def _summary_table(summary: dict[str, dict[str, Any]], shaped: str) -> str:
    head = [
        "method",
        "val loss",
        "vs dense",
        f"s/step {shaped}",
        "speedup",
        "s/step 1gbit",
        "speedup",
        "time to target",
        "vs dense",
        "vs fp16",
        "backward_s 1gbit",
        "opt_step_s 1gbit",
        "status",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(value: float | None, pattern: str) -> str:
        return pattern.format(value) if value is not None else "-"

    for method, s in summary.items():
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{method} ({s['optimizer']})",
                    fmt(s.get("val_loss"), "{:.4f}"),
                    fmt(s.get("vs_reference_pct"), "{:+.2f}%")
                    + (
                        f" vs {s['reference']}"
                        if s["reference"] != "none" and s.get("vs_reference_pct") is not None
                        else ""
                    ),
                    s.get("shaped_text", "-"),
                    fmt(s.get("shaped_speedup"), "{:.2f}x"),
                    s.get("fast_text", "-"),
                    fmt(s.get("fast_speedup"), "{:.2f}x"),
                    fmt(s.get("time_to_target"), "{:.0f} s"),
                    fmt(s.get("ttt_vs_dense"), "{:.2f}x"),
                    fmt(s.get("ttt_vs_fp16"), "{:.2f}x"),
                    fmt(s.get("fast_backward"), "{:.3f}"),
                    fmt(s.get("fast_opt_step"), "{:.4f}"),
                    s.get("status", ""),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def _phase_text(timing: dict[str, Any] | None) -> str:
    if not timing or not timing.get("phases"):
        return "-"
    phases = timing["phases"]
    if any(p["seconds_per_step"] is None for p in phases):
        return "failed"
    if len(phases) == 1:
        return f"{phases[0]['seconds_per_step']:.3f}"
    return " / ".join(f"{p['seconds_per_step']:.3f} ({p['name']})" for p in phases)


def _plot(curves: dict[str, dict[str, Any]], shaped: str, target: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(15, 5.5))
    for method, curve in curves.items():
        if not curve.get("val_steps"):
            continue
        style = {"color": "black", "linewidth": 2.5, "zorder": 5} if method == "none" else {"linewidth": 1.3}
        dashed = {"linestyle": "--"} if curve["optimizer"].startswith("sgd") else {}
        by_step.plot(
            curve["val_steps"], curve["val_losses"], marker="o", markersize=3, label=method, **style, **dashed
        )
        if curve.get("shaped_seconds") and max(curve["shaped_seconds"]) > 0:  # untimed rows: step panel only
            by_time.plot(
                curve["shaped_seconds"], curve["val_losses"], marker="o", markersize=3, **style, **dashed
            )
    for ax in (by_step, by_time):
        if target is not None:
            ax.axhline(
                target,
                color="grey",
                linestyle=":",
                linewidth=1,
                label="dense AdamW + 2%" if ax is by_step else None,
            )
        ax.set_ylabel("validation loss (nats per byte)")
        ax.grid(alpha=0.3)
    by_step.set_xlabel("step")
    by_step.set_title("validation loss vs step (2 gloo ranks)")
    by_time.set_xlabel(f"seconds on the {shaped} link (step count x measured step time of its phase)")
    by_time.set_title(f"validation loss vs wall time, {shaped} link")
    fig.legend(loc="center right", fontsize=8, title="--hook (dashed: SGD rows)", title_fontsize=8)
    drawn = [c["val_losses"] for c in curves.values() if c.get("val_losses")]
    if drawn:
        # Every curve's end in view, without the first points' steep fall flattening the rest.
        low = min(min(v) for v in drawn)
        high = min(max(max(v) for v in drawn), max(v[-1] for v in drawn) + 0.3, low + 1.5)
        for ax in (by_step, by_time):
            ax.set_ylim(low - 0.05, max(high, low + 0.3))
    fig.tight_layout(rect=(0, 0, 0.87, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Report:
    """What the files are written from: each method's loss run and per-link timing, and which run timed it.

    ``origin[method]`` names the run a method was trained and timed in ("" for this one); ``dense[origin]``
    is dense allreduce's timing per link in that run, the reference of that run's speed ratios (a merged
    file holds rows of several runs, each compared with its own run's dense step, never across runs).
    """

    methods: list[str]
    runs: dict[str, _Run]
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


def _assemble(
    train_lm: Any, report: _Report
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
        spec = train_lm.METHODS[method]
        run = runs[method]
        reference = REFERENCE.get(method, "none")
        entry: dict[str, Any] = {"optimizer": spec.optimizer, "reference": reference, "status": run.status}
        loss, ref_loss = final(method), final(reference)
        if loss is not None:
            entry["val_loss"] = loss
            if ref_loss is not None and method != reference:
                entry["vs_reference_pct"] = _pct(loss, ref_loss)
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
            last, dense_step = _last_phase_step(timing), _last_phase_step(dense_timing)
            mean, dense_mean = _mean_step(timing), _mean_step(dense_timing)
            entry[f"{key}_text"] = _phase_text(timing)
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
                            "backward_s": _round(phase.get("backward_s")),
                            "opt_step_s": _round(phase.get("opt_step_s")),
                        },
                    )
                )
            if key == "shaped" and run.result and _elapsed(timing, 1) is not None:
                curve["shaped_seconds"] = [_elapsed(timing, s) for s in run.result["val_steps"]]
                if target is not None:
                    entry["time_to_target"], entry["step_to_target"] = _time_to_loss(
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
        if target is None or none is None or not none.result or _elapsed(timing, 1) is None:
            return None
        return _time_to_loss(none.result["val_steps"], none.result["val_losses"], timing, target)[0]

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


# notes that _write derives from the numbers (a merge drops the old ones and derives them again)
_DERIVED_NOTES = ("time-to-loss target:", "benchmark wall time:", "backward_s / opt_step_s:", "speedup = ")


def _derived_notes(steps: int, target: float | None, dense_loss: float | None) -> list[str]:
    lines = []
    if target is not None and dense_loss is not None:
        lines.append(
            f"time-to-loss target: dense AdamW's {steps}-step validation loss {dense_loss:.4f} "
            f"+ 2% = {target:.4f}"
        )
    return lines


def _write(train_lm: Any, report: _Report, notes: list[str], started: float) -> str:
    """Write ``bench_convergence.json/.md/.png/.curves.json`` from ``report`` and return the Markdown."""
    rows, summary, curves, target = _assemble(train_lm, report)
    none = report.runs.get("none")
    dense_loss = none.result["val_losses"][-1] if none and none.status == "ok" and none.result else None
    notes = [*notes, *_derived_notes(report.steps, target, dense_loss)]
    verdicts = _verdicts(summary, report.shaped_name)
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
    table = _summary_table(summary, report.shaped_name)
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
    _plot(curves, report.shaped_name, target, output_dir() / f"{NAME}.png")
    return f"{text}\n## Summary\n\n{table}\n"


@dataclasses.dataclass
class _Previous:
    """An earlier result read back: its methods, loss runs and timings, and the notes it was written with
    (less those :func:`_write` derives again)."""

    report: _Report
    notes: list[str]
    rate: str | None  # the shaped link's tbf rate ("57mbit"), None if it was not timed


def _load_previous(train_lm: Any, directory: Path) -> _Previous:
    """Read ``bench_convergence.json`` and ``.curves.json`` from ``directory`` back into runs and timings.

    A loss run comes back as its validation curve, training losses, hook stats and loopback median step
    time (what the files keep); a timing as its phases and the status its step-time rows carry.

    Raises:
        FileNotFoundError: a file is missing (nothing to merge into).
        ValueError: a method of the file is no longer in ``train_lm.METHODS``.
    """
    json_path, curves_path = directory / f"{NAME}.json", directory / f"{NAME}.curves.json"
    for path in (json_path, curves_path):
        if not path.exists():
            raise FileNotFoundError(f"--merge: no earlier result {path} to merge into")
    payload = json.loads(json_path.read_text())
    saved = json.loads(curves_path.read_text())
    shaped_name = saved["shaped_link"]
    methods = list(saved["curves"])
    gone = [m for m in methods if m not in train_lm.METHODS]
    if gone:
        raise ValueError(f"--merge: {curves_path.name} has method(s) {gone} that train_lm.METHODS lacks")
    steps_cases = {r["case"] for r in payload["rows"] if r["metric"] == "val_loss"}
    steps = int(next(iter(steps_cases)).rsplit(" ", 1)[-1]) if steps_cases else 0
    status_of = {
        (r["case"], r["backend"]): r["extra"].get("status", "ok")
        for r in payload["rows"]
        if r["metric"] == "step_time"
    }
    runs: dict[str, _Run] = {}
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
        runs[method] = _Run(curve["status"], result)
        for link_name, key in ((shaped_name, "shaped"), (FAST_LINK, "fast")):
            if f"{key}_phases" in curve:
                timings.setdefault(link_name, {})[method] = {
                    "status": status_of.get((link_name, method), "ok"),
                    "phases": curve[f"{key}_phases"],
                }
    verdict_labels = {line.split(": ")[0] for line in _verdicts({}, shaped_name)}
    notes = [
        n
        for n in payload["notes"]
        if not n.startswith(_DERIVED_NOTES) and n.split(": ")[0] not in verdict_labels
    ]
    rate = shaped_name.split()[-1] if shaped_name.startswith("shaped ") else None
    merged = saved.get("merged", {})  # which run each method came from, when the file is a merge
    origin, dense = dict(merged.get("origin", {})), dict(merged.get("dense", {}))
    return _Previous(_Report(methods, runs, timings, shaped_name, steps, origin, dense), notes, rate)


def _merge_label(note: str) -> str | None:
    """The run label of a note written by a merge (``"merge of <label>: ..."``, ``"merged <label>: ..."``)."""
    for prefix in ("merge of ", "merged "):
        if note.startswith(prefix) and ": " in note:
            return note[len(prefix) : note.index(": ")]
    return None


def _merge(
    previous: _Previous,
    fresh: _Report,
    fresh_dense: dict[str, dict[str, Any]],
    label: str,
    notes: list[str],
) -> tuple[_Report, list[str]]:
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
    report = _Report(methods, runs, timings, old.shaped_name, old.steps, origin, dense)
    replaced = {n.split(": ")[0]: n for n in notes if n.split(": ")[0] in fresh.runs}
    # an earlier merge whose every method was rerun since describes no row any more: its notes go
    in_use = set(origin.values())
    report.dense = {run: timing for run, timing in report.dense.items() if run in in_use or run == ""}
    kept = [n for n in previous.notes if _merge_label(n) in in_use or _merge_label(n) is None]
    merged = [replaced.pop(n.split(": ")[0], n) for n in kept]
    merged += replaced.values()  # the new methods' lines
    merged += [
        n if n.startswith("merged ") else f"merge of {label}: {n}"
        for n in notes
        if n.split(": ")[0] not in fresh.runs
    ]
    return report, merged


def _reference_check(kept: _Run, settings: _Settings) -> str:
    """Train dense AdamW's first 50 steps again and say whether they repeat ``kept``'s losses bit for bit
    (a merge keeps dense's loss curve as the loss reference: this checks that the code and data still give
    it)."""
    if kept.result is None or not kept.result.get("val_steps"):
        return "dense reference check: not run (the kept dense run has no curve)"
    check = min(50, settings.steps, kept.result["val_steps"][0])
    args = [
        "--hook",
        "none",
        "--steps",
        str(settings.steps),
        "--stop-after",
        str(check),
        "--eval-every",
        str(check),
        "--log-every",
        "0",
        "--data-dir",
        str(settings.data_dir),
    ]
    run = _launch(args, None, free_port(), 120.0 + 6.0 * check, settings.work, "reference-check-none")
    if run.status != "ok" or run.result is None:
        return f"dense reference check: failed to run ({run.status})"
    same_train = run.result["train_losses"] == kept.result["train_losses"][:check]
    same_val = (
        kept.result["val_steps"][0] == check and run.result["val_losses"][0] == kept.result["val_losses"][0]
    )
    if same_train and same_val:
        return (
            f"dense reference check: dense AdamW's first {check} steps trained again repeat the kept "
            f"run's training and validation losses bit for bit (val loss {run.result['val_losses'][0]:.4f})"
        )
    return (
        f"dense reference check: DIFFERS, dense AdamW's first {check} steps trained again give val loss "
        f"{run.result['val_losses'][0]:.6f} (kept: {kept.result['val_losses'][0]:.6f}), training losses "
        f"{'equal' if same_train else 'different'}: the kept rows may be stale; rerun 'none' with the rest"
    )


def _short_form_note(methods: Sequence[str], steps: int) -> str:
    """What a run with fewer methods or steps than the committed result is, and where the full one is."""
    return (
        f"short form ({len(methods)} of {len(LOSS_METHODS)} methods, {steps} of {FULL_STEPS} steps): "
        f"compare with the full run committed in {RESULTS_DIR / (NAME + '.md')} (make bench FULL=1 runs it, "
        "about 1.5 h)"
    )


def _load_text() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark, write ``bench_convergence.*`` to ``harness.output_dir()``; return the Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=FULL_STEPS, help="training steps of each loss run")
    parser.add_argument("--methods", default=",".join(LOSS_METHODS), help="comma-separated subset")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps of each speed run")
    parser.add_argument("--timed-steps", type=int, default=20, help="timed steps of each speed run")
    parser.add_argument("--rate", default=None, help="the shaped link's tbf rate (default: derived)")
    parser.add_argument("--skip-speed", action="store_true", help="loss runs only")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep each run's result and logs here; loss runs found there are reused",
    )
    parser.add_argument(
        "--reuse-speed",
        action="store_true",
        help="with --work-dir: take the speed rows an earlier run saved there (speed.json)",
    )
    parser.add_argument(
        "--reuse-only",
        action="store_true",
        help="with --work-dir: start no loss run, report only those found there",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="add --methods to the existing benchmarks/results/bench_convergence.* (replacing their rows): "
        "only they are trained; dense allreduce is timed again on both links as their speed reference, its "
        "loss (deterministic) and every other row are kept",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    if (args.reuse_only or args.reuse_speed) and args.work_dir is None:
        parser.error("--reuse-only and --reuse-speed need --work-dir")
    started = time.perf_counter()
    load_at_start = _load_text()
    train_lm = load_example()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(train_lm.METHODS))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {sorted(train_lm.METHODS)}")
    previous = _load_previous(train_lm, RESULTS_DIR) if args.merge else None
    if previous is not None:
        if args.steps != previous.report.steps:
            parser.error(f"--merge: the existing result ran {previous.report.steps} steps, not {args.steps}")
        if args.rate and previous.rate and args.rate != previous.rate:
            parser.error(f"--merge: the existing result's shaped link is {previous.rate}, not {args.rate}")
        args.rate = args.rate or previous.rate
    # The loss references: trained in this run unless a merge finds them in the existing result.
    for needed in ("none", "sgd", "fp16"):
        have = previous is not None and previous.report.runs.get(needed, _Run("")).status == "ok"
        if needed not in methods and not have and any(REFERENCE.get(m, "none") == needed for m in methods):
            methods.insert(0, needed)
    methods = list(dict.fromkeys(methods))

    with tempfile.TemporaryDirectory(prefix="bench_convergence_") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        paths = train_lm.prepare_data(train_lm.default_data_dir())
        settings = _Settings(
            args.steps,
            args.warmup_steps,
            args.timed_steps,
            paths.train.parent.parent,
            work,
            args.work_dir is not None,
            args.reuse_only,
        )
        available = {m: train_lm.method_unavailable(m) for m in [*methods, "noop", "none"]}
        notes = [
            f"task: examples/train_lm.py, {_dense_payload_bytes(train_lm) // 4:,}-parameter byte-level GPT "
            "(d_model 192, 3 layers, 4 heads, context 128, untied head), stdlib .py files of Python "
            f"{sys.version.split()[0]}: {paths.train_files} train files ({paths.train_bytes / 1e6:.1f} MB), "
            f"{paths.val_files} validation files ({paths.val_bytes / 1e6:.2f} MB, every 20th file)",
            f"training: 2 gloo ranks, 1 thread each, batch 16 x 128 tokens per rank, {args.steps} steps, "
            "warm-up 30 then cosine to 0, seed 0 (same data order for every method); AdamW lr 2e-3 betas "
            "(0.9, 0.95) weight decay 0.1; SGD lr 0.1 (dense: momentum 0.9; dgc: momentum 0, the hook's "
            "momentum correction 0.9)",
            "validation loss: mean cross entropy (nats per byte) over 128 fixed windows of 129 bytes per "
            "rank (256 in all) of the held-out files, every 50 steps and at the last",
        ]
        if previous is not None:
            notes = []  # the earlier result's setup lines stay; this run adds its methods' lines
        for method in methods:
            spec = train_lm.METHODS[method]
            notes.append(f"{method}: {spec.description} {spec.options}")
        if previous is None and (args.steps != FULL_STEPS or set(LOSS_METHODS) - set(methods)):
            notes.append(_short_form_note(methods, args.steps))
            progress(notes[-1])

        # -- speed -------------------------------------------------------------------------------------
        shaped_name, fast_name = "shaped", FAST_LINK
        timings: dict[str, dict[str, dict[str, Any]]] = {}
        reason = netlab.unavailable_reason()
        speed_cache = work / "speed.json"
        # a merge's speed reference: dense allreduce timed again in the same run, unless it is rerun itself
        timed_methods = methods if previous is None or "none" in methods else ["none", *methods]
        if args.skip_speed:
            notes.append("speed: skipped (--skip-speed)")
        elif args.reuse_speed:
            if not speed_cache.exists():
                parser.error(f"--reuse-speed: no {speed_cache}")
            cached = json.loads(speed_cache.read_text())
            shaped_name, timings = cached["shaped_name"], cached["timings"]
            if previous is not None and any("none" not in per for per in timings.values()):
                parser.error(f"--merge --reuse-speed: {speed_cache} has no dense allreduce timing")
            notes += [*cached["notes"], f"speed rows reused from an earlier run ({cached['when']})"]
        elif reason:
            notes.append(f"speed: skipped, {reason}")
        else:
            speed_notes_start = len(notes)
            noop = _time_link(train_lm, ["noop"], None, "loopback", settings, available)["noop"]
            noop_seconds = _last_phase_step(noop)
            if noop_seconds is None:
                raise RuntimeError(f"the no-communication step could not be timed: {noop['status']}")
            payload = _dense_payload_bytes(train_lm)
            if previous is not None and args.rate:
                rate = args.rate
                notes.append(
                    f"no-communication step (no-op hook, loopback): {noop_seconds:.3f} s; shaped link rate "
                    f"{rate} (the existing result's)"
                )
            else:
                rate = args.rate or _shaped_rate(noop_seconds, payload)
                how = "given" if args.rate else f"derived for communication = {COMM_TO_COMPUTE}x compute"
                notes.append(
                    f"no-communication step (no-op hook, loopback): {noop_seconds:.3f} s; dense payload "
                    f"{payload / 1e6:.2f} MB per rank and step; shaped link rate {rate} ({how})"
                )
            shaped_name = f"shaped {rate}"
            for name, link_rate in ((shaped_name, rate), (fast_name, FAST_LINK)):
                with netlab.Link(rate=link_rate) as link:
                    measured = netlab.measure_throughput(link, nbytes=8 << 20)
                    notes.append(
                        f"{name}: veth between two namespaces, tbf {link_rate} each way, measured "
                        f"{measured:.2f} MB/s (TCP, one direction, 8 MB)"
                    )
                    timings[name] = _time_link(
                        train_lm, timed_methods, link, name.split()[0], settings, available
                    )
            for name, per in timings.items():
                for method, timing in per.items():
                    for crash in timing.get("first_run_crashed", []):
                        notes.append(
                            f"{method} on the {name} link, phase {crash}; the row is a second run of the "
                            "same configuration"
                        )
            dense_shaped = _last_phase_step(timings[shaped_name].get("none", {}))
            if dense_shaped is not None:
                comm = dense_shaped - noop_seconds
                notes.append(
                    f"{shaped_name}: dense allreduce step {dense_shaped:.3f} s = no-comm "
                    f"{noop_seconds:.3f} s + {comm:.3f} s communication ({comm / noop_seconds:.2f}x "
                    "the no-comm step)"
                )
            notes.append(
                f"speed: {args.warmup_steps} warm-up + {args.timed_steps} timed steps per method "
                "and phase, the slower rank's median; loss vs seconds = the loss run's validation "
                "curve with each step at its phase's measured step time on that link"
            )
            speed_notes = notes[speed_notes_start:]
            when = time.strftime("%Y-%m-%d %H:%M")
            speed_cache.write_text(
                json.dumps(
                    {"shaped_name": shaped_name, "timings": timings, "notes": speed_notes, "when": when}
                )
            )

        # -- loss --------------------------------------------------------------------------------------
        runs: dict[str, _Run] = {}
        for number, method in enumerate(methods, 1):
            progress(f"[{NAME}] loss run {number} of {len(methods)}: {method}, {args.steps} steps, loopback")
            begin = time.perf_counter()
            runs[method] = _loss_run(train_lm, method, settings, available)
            run = runs[method]
            if run.status == "ok" and run.result is not None:
                (work / f"loss-{method}-{args.steps}.json").write_text(json.dumps(run.result))
                shown = f"val loss {run.result['val_losses'][-1]:.4f}"
            else:
                shown = run.status
            print(
                f"[{NAME}] loss {method:8s} {shown} ({time.perf_counter() - begin:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        if previous is not None and "none" not in methods and not args.reuse_only:
            notes.append(_reference_check(previous.report.runs.get("none", _Run("missing")), settings))
            print(f"[{NAME}] {notes[-1]}", file=sys.stderr, flush=True)

    notes.append(f"{load_at_start} at the start; {_load_text().removeprefix('load average ')} at the end")
    if previous is None:
        report = _Report(methods, runs, timings, shaped_name, args.steps)
        return _write(train_lm, report, notes, started)

    # -- merge into the existing result ------------------------------------------------------------------
    label = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    fresh_dense = {name: per["none"] for name, per in timings.items() if "none" in per}
    rerun_timings = {name: {m: t for m, t in per.items() if m in methods} for name, per in timings.items()}
    fresh = _Report(methods, runs, rerun_timings, previous.report.shaped_name, args.steps)
    if timings and shaped_name != previous.report.shaped_name:
        raise RuntimeError(
            f"--merge: timed on {shaped_name!r}, the existing result on {previous.report.shaped_name!r}"
        )
    dense_text = (
        ", ".join(f"{name} {_phase_text(t)} s/step" for name, t in fresh_dense.items()) or "not timed"
    )
    kept_dense = ", ".join(
        f"{name} {_phase_text(per.get('none'))} s/step" for name, per in previous.report.timings.items()
    )
    notes.append(
        f"merged {label}: {', '.join(methods)} trained and timed in this run, every other row kept from the "
        f"earlier run; their speed ratios and time-to-target ratios are against dense allreduce timed again "
        f"in this run ({dense_text}; the earlier run's: {kept_dense}), their loss ratios against the "
        "kept losses (see the dense reference check)"
    )
    report, merged_notes = _merge(previous, fresh, fresh_dense, label, notes)
    return _write(train_lm, report, merged_notes, started)


if __name__ == "__main__":
    print(main())
