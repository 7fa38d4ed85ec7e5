"""DiLoCo against dense AdamW on the LM task: validation loss, traffic, overlap, time to loss on slow links.

The question (issue 22): syncing every ``H`` steps sends ~``H``x fewer bytes (and 4-bit pseudo-gradients
8x fewer again); does the training still reach dense's loss, and how much sooner on a slow link?

1. Loss runs: ``examples/train_lm.py`` as :mod:`benchmarks.bench_convergence` runs it (its launcher, its
   cached ``loss-<method>-<steps>.json`` in ``--work-dir``): dense allreduce AdamW (``none``) and each
   DiLoCo method of ``train_lm.METHODS`` (AdamW inner, the same batch and tokens per rank, no DDP), 2 gloo
   ranks of one thread each, ``--steps`` steps, up to ``--parallel`` runs at once; ``--long-steps`` trains
   ``--long-methods`` again for a longer run (its own cosine schedule).
2. Traffic: bytes one rank sends per step: DiLoCo's own count (``stats()["bytes_sent"]`` over the steps;
   ring all-reduce ``2 (W - 1) / W`` of the payload) against dense's ring all-reduce of the fp32 gradients.
3. Overlap: seconds a rank waited for the sync, per sync (``stats()["blocked_s"]``); streaming's exchanges
   are applied ``H / F`` steps after they are issued, so its wait is what the inner steps did not hide.
4. Speed (``--links``, netlab as root): each method's mean step time over whole sync periods on each
   shaped link, and the no-communication step time (``noop``) on loopback. Time to the target (dense's
   final validation loss + 2%) = the steps the loss run took to reach it (linear between validation
   points) x the mean step time; the compute-only limit = those steps x the no-communication step time.
5. Written to ``harness.output_dir()``: ``bench_diloco.json/.md`` (rows, summary tables, notes) and
   ``bench_diloco.png`` (validation loss vs step of every run; time to target per link).

Run::

    python -m benchmarks.bench_diloco                      # the committed result's runs (see --help)
    python -m benchmarks.bench_diloco --steps 150 --methods none,diloco_q4 --skip-speed   # short profile
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import bench_convergence as conv
from benchmarks import netlab
from benchmarks.harness import Row, output_dir, progress, write_results

__all__ = ["DILOCO_METHODS", "main"]

NAME = "bench_diloco"
DILOCO_METHODS = (
    "diloco", "diloco_q4", "diloco_q4_h15", "diloco_h25", "diloco_q4_h25", "diloco_avg", "diloco_m09",
    "diloco_lr1", "streaming_q4",
)  # fmt: skip
SPEED_METHODS = ("none", "diloco", "diloco_q4", "streaming_q4")
LINKS = ("57mbit", "10mbit")
WORLD = 2


def _loss_runs(train_lm: Any, jobs: Sequence[tuple[str, conv._Settings]], parallel: int) -> dict:
    """``{steps: {method: the loss run's result dict, or its status}}``, ``parallel`` runs at a time (the
    longest first, so that they end together)."""

    def one(job: tuple[str, conv._Settings]) -> tuple[str, conv._Settings, Any]:
        method, settings = job
        begin = time.monotonic()
        run = conv._loss_run(train_lm, method, settings, {})
        progress(f"[{NAME}] {method} {settings.steps} steps: {run.status} ({time.monotonic() - begin:.0f} s)")
        return method, settings, run.result if run.status == "ok" else run.status

    found: dict[int, dict[str, Any]] = {settings.steps: {} for _, settings in jobs}
    ordered = sorted(jobs, key=lambda job: -job[1].steps)
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        for method, settings, result in pool.map(one, ordered):
            found[settings.steps][method] = result
    return found


def _speed(train_lm: Any, methods: Sequence[str], links: Sequence[str], settings: conv._Settings) -> dict:
    """``{link: {method: {"s_per_step", "blocked_per_step"}}}`` plus ``{"loopback": {"noop": ...}}``: the
    mean step time and the seconds per step rank 0 waited for DiLoCo's syncs; a failed run: None."""
    found: dict[str, dict[str, dict[str, float] | None]] = {}

    def time_on(link: netlab.Link | None, name: str, method: str, port: int) -> dict[str, float] | None:
        phase = conv._phases(train_lm, method, settings.steps)[-1]
        tag = f"time-{name}-{method}"
        measured, status, crashed = conv._time_phase(method, phase, link, settings, tag, port)
        shown = f"{measured['seconds_per_step']:.3f} s/step" if measured else status
        progress(f"[{NAME}] {name} {method}: {shown}")
        if measured is None:
            return None
        result = json.loads((settings.work / f"{tag}{'-again' if crashed else ''}.json").read_text())
        stats = result.get("hook_stats") or {}
        blocked = float(stats["blocked_s"]) / float(stats["inner_steps"]) if "blocked_s" in stats else 0.0
        return {"s_per_step": float(measured["seconds_per_step"]), "blocked_per_step": blocked}

    found["loopback"] = {"noop": time_on(None, "loopback", "noop", conv._free_port())}
    for number, rate in enumerate(links):
        with netlab.Link(rate=rate) as link:
            found[rate] = {m: time_on(link, rate, m, 29700 + 10 * number + i) for i, m in enumerate(methods)}
    return found


def _steps_to(result: dict[str, Any], target: float) -> float | None:
    timing = {"phases": [{"first": 1, "last": result["val_steps"][-1], "seconds_per_step": 1.0}]}
    return conv._time_to_loss(result["val_steps"], result["val_losses"], timing, target)[1]


def _traffic(result: dict[str, Any], parameters: int) -> tuple[float, float]:
    """(bytes per rank per step, dense's over it)."""
    dense = 2 * (WORLD - 1) * 4 * parameters / WORLD
    stats = result.get("hook_stats") or {}
    if "bytes_sent" not in stats:
        return dense, 1.0
    per_step = float(stats["bytes_sent"]) / max(1.0, float(stats["inner_steps"]))
    return per_step, dense / per_step if per_step else math.inf


def _summary(runs: dict[str, dict[str, Any]], speed: dict, steps: int) -> tuple[list[Row], str, list[str]]:
    """Harness rows, the Markdown summary of one run length, and its notes."""
    rows: list[Row] = []
    dense = runs.get("none")
    dense_loss = dense["val_losses"][-1] if isinstance(dense, dict) else None
    target = dense_loss * conv.TARGET_SLACK if dense_loss is not None else None
    links = [k for k in speed if k != "loopback"]
    noop = (speed.get("loopback", {}).get("noop") or {}).get("s_per_step")
    head = ["method", "options", "val loss", "vs dense", "bytes/step/rank", "fewer bytes", "wait/sync s",
            "steps to target", *(f"time to target {link}" for link in links), "compute-only limit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, result in runs.items():
        case = f"{steps} steps"
        if not isinstance(result, dict):
            lines.append(f"| {method} | - | {result} |" + " - |" * (len(head) - 3))
            continue
        loss = result["val_losses"][-1]
        gap = None if dense_loss is None else 100.0 * (loss / dense_loss - 1.0)
        per_step, fewer = _traffic(result, result["parameters"])
        stats = result.get("hook_stats") or {}
        wait = float(stats["blocked_s"]) / float(stats["syncs"]) if stats.get("syncs") else None
        reach = _steps_to(result, target) if target is not None else None
        rows.append(Row(case, method, "val_loss", loss, "nats/byte", None if gap is None else 1 + gap / 100,
                        "none loss", {"options": result["options"]}))  # fmt: skip
        rows.append(Row(case, method, "bytes_per_step", per_step, "bytes/rank", fewer, "fewer than dense"))
        cells = [method, json.dumps(result["options"]).replace("|", "/"), f"{loss:.4f}",
                 "-" if gap is None else f"{gap:+.2f}%", f"{per_step:,.0f}", f"{fewer:,.0f}x",
                 "-" if wait is None else f"{wait:.3f}",
                 "-" if reach is None else f"{reach:.0f}"]  # fmt: skip
        for link in links:
            seconds = (speed[link].get(method) or {}).get("s_per_step")
            ttt = None if reach is None or seconds is None else reach * seconds
            cells.append("-" if ttt is None else f"{ttt:.0f} s")
            if ttt is not None:
                rows.append(Row(f"{case}, {link}", method, "time_to_target", ttt, "s"))
        limit = None if reach is None or noop is None else reach * noop
        cells.append("-" if limit is None else f"{limit:.0f} s")
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if target is not None:
        notes.append(f"{steps} steps: target = dense's final val loss {dense_loss:.4f} x "
                     f"{conv.TARGET_SLACK} = {target:.4f}")  # fmt: skip
    for link in links:
        timed = {m: t for m, t in speed[link].items() if t is not None}
        shown = ", ".join(f"{m} {t['s_per_step']:.3f} (waiting {t['blocked_per_step']:.3f})"
                          for m, t in timed.items())  # fmt: skip
        notes.append(f"mean s/step on {link} over whole sync periods (of it, rank 0 waiting for syncs): "
                     f"{shown}")  # fmt: skip
        if timed.get("diloco_q4", {}).get("blocked_per_step") and "streaming_q4" in timed:
            hidden = 1.0 - timed["streaming_q4"]["blocked_per_step"] / timed["diloco_q4"]["blocked_per_step"]
            notes.append(f"{link}: streaming_q4 (5 fragments, 2 steps late) hides {100 * hidden:.0f}% "
                         "of diloco_q4's wait for the same bytes")
    if noop is not None:
        notes.append(f"no-communication step (noop, loopback): {noop:.3f} s")
    return rows, "\n".join(lines), notes


def _plot(curves: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    for label, result in curves.items():
        style = {"color": "black", "linewidth": 2.2} if label.startswith("none") else {"linewidth": 1.2}
        ax.plot(result["val_steps"], result["val_losses"], marker="o", markersize=2, label=label, **style)
    finals = [r["val_losses"][-1] for r in curves.values()]
    if finals:
        ax.set_ylim(min(finals) - 0.05, min(finals) + 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title("DiLoCo vs dense AdamW, 2 gloo ranks (examples/train_lm.py)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark, write ``bench_diloco.*`` to ``harness.output_dir()``; return the Markdown."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=conv.FULL_STEPS)
    parser.add_argument("--methods", default=",".join(("none", *DILOCO_METHODS)))
    parser.add_argument("--long-steps", type=int, default=1500, help="0: no long runs")
    parser.add_argument("--long-methods", default="none,diloco,diloco_q4")
    parser.add_argument("--parallel", type=int, default=1, help="loss runs at once (2 cores each)")
    parser.add_argument("--links", default=",".join(LINKS), help="netlab rates of the speed runs")
    parser.add_argument("--speed-methods", default=",".join(SPEED_METHODS))
    parser.add_argument("--timed-steps", type=int, default=20, help="whole sync periods, at least this many")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--speed-only", action="store_true", help="the speed runs into --work-dir, then stop")
    parser.add_argument("--reuse-speed", action="store_true", help="the speed runs kept in --work-dir")
    parser.add_argument("--loss-only", action="store_true",
                        help="train the loss runs into --work-dir and stop (e.g. on a machine of more cores; "
                             "assemble later with the same --work-dir)")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep (and reuse) each run's result")
    parser.add_argument("--note", action="append", default=[], help="a line for the notes (the conditions)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    train_lm = conv.load_example()
    work = args.work_dir or Path(output_dir()) / f"{NAME}-work"
    work.mkdir(parents=True, exist_ok=True)
    paths = train_lm.prepare_data(train_lm.default_data_dir())
    settings = conv._Settings(args.steps, 2, args.timed_steps, paths.train.parent, work, reuse=True)
    speed_file = work / "speed.json"
    speed: dict = json.loads(speed_file.read_text()) if args.reuse_speed else {}
    notes = []
    reason = netlab.unavailable_reason()
    if args.skip_speed or args.loss_only:
        notes.append("speed runs skipped (--skip-speed)")
    elif reason:
        notes.append(f"speed runs skipped: netlab unavailable ({reason})")
    elif not speed:
        speed = _speed(train_lm, args.speed_methods.split(","), args.links.split(","), settings)
        speed_file.write_text(json.dumps(speed))
    if args.speed_only:
        return ""
    jobs = [(method, settings) for method in args.methods.split(",")]
    if args.long_steps:
        long_settings = conv._Settings(args.long_steps, 2, args.timed_steps, paths.train.parent, work, True)
        jobs += [(method, long_settings) for method in args.long_methods.split(",")]
    found = _loss_runs(train_lm, jobs, args.parallel)
    runs, long_runs = found[args.steps], found.get(args.long_steps, {})
    if args.loss_only:
        return ""
    rows, table, more = _summary(runs, speed, args.steps)
    tables = [f"## {args.steps} steps\n\n{table}"]
    notes += more
    if long_runs:
        long_rows, long_table, long_notes = _summary(long_runs, speed, args.long_steps)
        rows += long_rows
        tables.append(f"## {args.long_steps} steps\n\n{long_table}")
        notes += long_notes
    notes += args.note
    notes.append(f"benchmark wall time: {time.monotonic() - started:.0f} s")
    text = write_results(NAME, rows, notes=notes)
    out = output_dir()
    text += "\n" + "\n\n".join(tables) + "\n"
    (out / f"{NAME}.md").write_text(text)
    curves = {m: r for m, r in runs.items() if isinstance(r, dict)}
    curves.update({f"{m} ({args.long_steps})": r for m, r in long_runs.items() if isinstance(r, dict)})
    (out / f"{NAME}.curves.json").write_text(json.dumps(curves))
    _plot(curves, out / f"{NAME}.png")
    print(text, file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
