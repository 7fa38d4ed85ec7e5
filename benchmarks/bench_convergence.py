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

The runs are :mod:`benchmarks.convergence_runs`, the tables and figure :mod:`benchmarks.convergence_tables`,
the result files and ``--merge`` :mod:`benchmarks.convergence_results`; the methods
:mod:`benchmarks.lm_methods`. This module is the command line.

Run::

    python -m benchmarks.bench_convergence    # everything: ~8,000 training steps, ~1.8 h on 2 idle cores
    python -m benchmarks.bench_convergence --steps 100 --methods none,q8,cadam --timed-steps 5
    python -m benchmarks.bench_convergence --work-dir /tmp/conv   # keep (and reuse) each run's result
    python -m benchmarks.bench_convergence --merge --methods powersgd   # add one method: ~15 min
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import netlab
from benchmarks.convergence_results import Report, load_previous, merge, write
from benchmarks.convergence_runs import (
    COMM_TO_COMPUTE,
    FAST_LINK,
    FULL_STEPS,
    LOSS_METHODS,
    NAME,
    REFERENCE,
    Run,
    Settings,
    dense_payload_bytes,
    last_phase_step,
    loss_run,
    reference_check,
    shaped_rate,
    time_link,
)
from benchmarks.convergence_tables import phase_text
from benchmarks.harness import RESULTS_DIR, progress
from benchmarks.lm_methods import METHODS, load_example

__all__ = ["main"]


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
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {sorted(METHODS)}")
    previous = load_previous(RESULTS_DIR) if args.merge else None
    if previous is not None:
        if args.steps != previous.report.steps:
            parser.error(f"--merge: the existing result ran {previous.report.steps} steps, not {args.steps}")
        if args.rate and previous.rate and args.rate != previous.rate:
            parser.error(f"--merge: the existing result's shaped link is {previous.rate}, not {args.rate}")
        args.rate = args.rate or previous.rate
    # The loss references: trained in this run unless a merge finds them in the existing result.
    for needed in ("none", "sgd", "fp16"):
        have = previous is not None and previous.report.runs.get(needed, Run("")).status == "ok"
        if needed not in methods and not have and any(REFERENCE.get(m, "none") == needed for m in methods):
            methods.insert(0, needed)
    methods = list(dict.fromkeys(methods))

    with tempfile.TemporaryDirectory(prefix="bench_convergence_") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        paths = train_lm.prepare_data(train_lm.default_data_dir())
        settings = Settings(
            args.steps,
            args.warmup_steps,
            args.timed_steps,
            paths.train.parent.parent,
            work,
            args.work_dir is not None,
            args.reuse_only,
        )
        notes = [
            f"task: examples/train_lm.py, {dense_payload_bytes(train_lm) // 4:,}-parameter byte-level GPT "
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
            spec = METHODS[method]
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
            noop = time_link(["noop"], None, "loopback", settings)["noop"]
            noop_seconds = last_phase_step(noop)
            if noop_seconds is None:
                raise RuntimeError(f"the no-communication step could not be timed: {noop['status']}")
            payload = dense_payload_bytes(train_lm)
            if previous is not None and args.rate:
                rate = args.rate
                notes.append(
                    f"no-communication step (no-op hook, loopback): {noop_seconds:.3f} s; shaped link rate "
                    f"{rate} (the existing result's)"
                )
            else:
                rate = args.rate or shaped_rate(noop_seconds, payload)
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
                    timings[name] = time_link(timed_methods, link, name.split()[0], settings)
            for name, per in timings.items():
                for method, timing in per.items():
                    for crash in timing.get("first_run_crashed", []):
                        notes.append(
                            f"{method} on the {name} link, phase {crash}; the row is a second run of the "
                            "same configuration"
                        )
            dense_shaped = last_phase_step(timings[shaped_name].get("none", {}))
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
        runs: dict[str, Run] = {}
        for number, method in enumerate(methods, 1):
            progress(f"[{NAME}] loss run {number} of {len(methods)}: {method}, {args.steps} steps, loopback")
            begin = time.perf_counter()
            runs[method] = loss_run(method, settings)
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
            notes.append(reference_check(previous.report.runs.get("none", Run("missing")), settings))
            print(f"[{NAME}] {notes[-1]}", file=sys.stderr, flush=True)

    notes.append(f"{load_at_start} at the start; {_load_text().removeprefix('load average ')} at the end")
    if previous is None:
        report = Report(methods, runs, timings, shaped_name, args.steps)
        return write(report, notes, started)

    # -- merge into the existing result ------------------------------------------------------------------
    label = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    fresh_dense = {name: per["none"] for name, per in timings.items() if "none" in per}
    rerun_timings = {name: {m: t for m, t in per.items() if m in methods} for name, per in timings.items()}
    fresh = Report(methods, runs, rerun_timings, previous.report.shaped_name, args.steps)
    if timings and shaped_name != previous.report.shaped_name:
        raise RuntimeError(
            f"--merge: timed on {shaped_name!r}, the existing result on {previous.report.shaped_name!r}"
        )
    dense_text = (
        ", ".join(f"{name} {phase_text(t)} s/step" for name, t in fresh_dense.items()) or "not timed"
    )
    kept_dense = ", ".join(
        f"{name} {phase_text(per.get('none'))} s/step" for name, per in previous.report.timings.items()
    )
    notes.append(
        f"merged {label}: {', '.join(methods)} trained and timed in this run, every other row kept from the "
        f"earlier run; their speed ratios and time-to-target ratios are against dense allreduce timed again "
        f"in this run ({dense_text}; the earlier run's: {kept_dense}), their loss ratios against the "
        "kept losses (see the dense reference check)"
    )
    report, merged_notes = merge(previous, fresh, fresh_dense, label, notes)
    return write(report, merged_notes, started)


if __name__ == "__main__":
    print(main())

