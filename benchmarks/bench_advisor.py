"""The advisor's predicted step time beside the measured one: 2 ranks on loopback, on 1 Gbit/s and 100 Mbit/s
links, and 2 nodes x 2 ranks joined by 1 Gbit/s, flat and two-level.

The question: can ``python -m fastcomm.advise`` be trusted where this machine cannot measure (64 GPUs, NVLink,
25 Gbit/s)? It is checked here, where it can be: each prediction within 25% of the measurement.

1. Measured: bench_hooks's own runs (:func:`benchmarks.hooks_runs.run_config`: the 25.2M-parameter MLP,
   fresh gloo ranks with one thread each, the slower rank's median step) of dense allreduce and every
   fastcomm hook, on each network; on the two-node network flat (``node_size=1``) and two-level
   (``node_size=2``) sign and 8-bit quantization. Each rank also holds a second copy of the model with the
   no-op hook and times one step of it before each timed step (``paired_floor``): the compute floor under
   the same load as the step beside it, on a machine whose load changes (other work on the same cores).
2. Predicted: :func:`fastcomm.advise.predict` with what a user would give it, each measured separately
   and none fitted to a step time:

   - ``step_compute``: the floor timed beside the configuration's steps (forward, backward and optimizer,
     nothing sent);
   - the link: ``1gbit`` and ``100mbit`` parsed as the CLI parses them (Ethernet payload rate); loopback is
     a :class:`~fastcomm.advise.Link` fitted to gloo allreduce timed between two local processes
     (:mod:`fastcomm.advise.calibrate`), which does not overlap compute (its copies run on the computing
     cores); the two-node network's inside-node link is that loopback;
   - kernel rates measured in this process with one thread (each rank has one) on 16M elements (the hooks'
     working set, past an L3 slice), halved where 4 ranks share
     2 cores, as is the loopback's bandwidth there.
3. Rows: one per bench_hooks configuration (its name), ``method`` the advisor's row that prices it (named
   by :func:`fastcomm.compress.registry.label`), ``value`` the measured step, ``predicted_s`` beside it,
   ``error`` = predicted / measured - 1; auto's row says what it chose, by the same names.
   Where a row is off by more than 25% the notes say so and which part of the prediction is off, from the
   hook's own ``compress_s`` counter.

Run::

    python -m benchmarks.bench_advisor                       # all networks (root for the shaped ones)
    python -m benchmarks.bench_advisor --networks loopback   # no root needed, about 2 minutes
    python -m benchmarks.bench_advisor --networks loopback --name bench_advisor_16cores   # another machine
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import hooks_jobs, hooks_runs, netlab
from benchmarks.common import free_port
from benchmarks.harness import Row, output_dir, progress, write_results
from fastcomm.advise import KernelRates, Link, measure_rates, parse_link, predict
from fastcomm.advise.calibrate import fit_link, measure_allreduce
from fastcomm.compress.registry import label

__all__ = ["NETWORKS", "main", "plot"]

NETWORKS = ("loopback", "1gbit", "100mbit", "nodes")
TOLERANCE = 0.25
# bench_hooks's configuration -> the advisor's method (named by its compressor's label) and schedule
_METHODS = {
    "allreduce": ("allreduce", "flat"),
    "bf16_cast": (label("cast", dtype=torch.bfloat16), "flat"),
    "topk_0.01": (label("topk", ratio=0.01), "flat"),
    "quant8": (label("quantize", bits=8), "flat"),
    "quant4": (label("quantize", bits=4), "flat"),
    "sign": (label("sign"), "flat"),
    "powersgd_r4": (label("powersgd", rank=hooks_jobs.POWERSGD_RANK), "flat"),
    "sign_hier": (label("sign"), "two-level"),
    "quant8_hier": (label("quantize", bits=8), "two-level"),
}
_TWO_RANKS = [c for c in hooks_jobs.CONFIGS if c.name in _METHODS]
# "auto" runs beside them on the 2-rank networks: measured, not predicted (it is one of the others, chosen)
_AUTO = [c for c in hooks_jobs.CONFIGS if c.name == "auto"]
_AT_PARITY = ("bf16_cast", "quant8", "quant4")
_NODES = [c for c in hooks_jobs.NODE_CONFIGS if c.name in _METHODS]
_SHAPES = [
    shape
    for fan_in, fan_out in zip(hooks_jobs.LAYERS[:-1], hooks_jobs.LAYERS[1:], strict=True)
    for shape in ((fan_out, fan_in), (fan_out,))
]
_FIT_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 23, 1 << 26)
# kernel rates at the size of the hooks' work (a 25 MB bucket and its residual, codes and output), past a
# 32 MB L3 slice: at 4M elements 8-bit quantization ran 1.5x faster here, in cache
_RATE_NUMEL = 1 << 24


def _measure(
    network: str, configs: Sequence[hooks_jobs.Config], settings: Any, link: netlab.Link | None
) -> dict[str, Any]:
    """Each configuration's outcome (bench_hooks's runner) and the load average when it started."""
    outcomes: dict[str, Any] = {}
    for index, config in enumerate(configs):
        port = 29500 + index if link is not None else free_port()
        load = os.getloadavg()[0]
        outcome = hooks_runs.run_config(config, link, port, settings)
        outcomes[config.name] = (outcome, load)
        shown = f"{outcome.step_seconds:.3f} s/step" if outcome.status == "ok" else outcome.status
        progress(f"[bench_advisor] {network:8s} {config.name:12s} {shown} (load {load:.1f})")
    return outcomes


def _rows(
    network: str,
    outcomes: dict[str, Any],
    predict_kwargs: dict[str, Any],
    timed_steps: int,
) -> list[Row]:
    """One row per configuration: measured step, the compute floor timed beside it, the prediction made
    from that floor, the error, and the prediction's parts."""
    rows = []
    for name, (outcome, load) in outcomes.items():
        if name == "auto":
            rows.append(_auto_row(network, outcome, load))
        if name not in _METHODS:
            continue
        extra: dict[str, Any] = {"status": outcome.status, "load_1m": round(load, 1)}
        floor = outcome.floor_seconds if outcome.status == "ok" else None
        if floor is None:
            rows.append(Row(network, name, "step_time", math.nan, "s", extra=extra))
            continue
        predicted = {(p.method, p.schedule): p for p in predict(step_compute=floor, **predict_kwargs)}
        guess = predicted[_METHODS[name]]
        measured = outcome.step_seconds
        assert guess.step_s is not None
        error = guess.step_s / measured - 1
        extra.update(
            {
                "method": guess.method,
                "floor_s": round(floor, 3),
                "predicted_s": round(guess.step_s, 3),
                "error": f"{error:+.0%}",
                "within_25%": "yes" if abs(error) <= TOLERANCE else "NO",
                "pred_compress_s": round(guess.codec_s, 3),
                "pred_comm_shown_s": round(guess.exposed_s, 3),
                "reason": guess.reason,
            }
        )
        if outcome.stats and "compress_seconds" in outcome.stats:
            extra["measured_compress_s"] = round(outcome.stats["compress_seconds"] / timed_steps, 3)
        if guess.vs_flat:
            extra["pred_vs_flat"] = round(guess.vs_flat, 2)
        rows.append(Row(network, name, "step_time", measured, "s", extra=extra))
    flat_times = {r.backend: r.value for r in rows}
    for row in rows:
        flat = flat_times.get(row.backend.removesuffix("_hier")) if row.backend.endswith("_hier") else None
        if flat and flat == flat and row.value == row.value:  # NaN: a crashed run
            row.extra["measured_vs_flat"] = round(flat / row.value, 2)
    return rows


def _auto_row(network: str, outcome: Any, load: float) -> Row:
    """auto's measured step, and what it chose: per method the bucket sizes, whether its trial reverted,
    the trial's medians."""
    extra: dict[str, Any] = {"status": outcome.status, "load_1m": round(load, 1)}
    stats = outcome.stats or {}
    chose = [f"{k[5:-8]} x{int(v)}" for k, v in stats.items() if k.startswith("auto_") and
             k.endswith("_buckets") and v]  # fmt: skip
    if chose:
        extra["reason"] = f"chose {', '.join(chose)} bucket sizes"
    if stats.get("auto_trial_chosen_step_s"):
        verdict = "reverted to dense" if stats.get("auto_reverted") else "kept"
        extra["reason"] += (f"; trial {stats['auto_trial_chosen_step_s']:.3f} s vs dense "
                            f"{stats['auto_trial_dense_step_s']:.3f} s per step: {verdict}")  # fmt: skip
    if outcome.floor_seconds is not None:
        extra["floor_s"] = round(outcome.floor_seconds, 3)
    return Row(network, "auto", "step_time", outcome.step_seconds, "s", extra=extra)


def _auto_notes(rows: Sequence[Row]) -> list[str]:
    """The issue's targets for auto, per network: on loopback <= 1.03x dense allreduce; on the shaped links
    within 5% of the fastest hook at loss parity (bf16 cast, 8-bit, 4-bit)."""
    notes = []
    for network in dict.fromkeys(r.case for r in rows):
        times = {r.backend: r.value for r in rows if r.case == network and r.value == r.value}
        if "auto" not in times or network == "nodes":
            continue
        if network == "loopback":
            if "allreduce" in times:
                value = times["auto"] / times["allreduce"]
                notes.append(f"{network}: auto <= 1.03x allreduce: {'MET' if value <= 1.03 else 'MISSED'} "
                             f"(auto {times['auto']:.3f} s / allreduce {times['allreduce']:.3f} s = "
                             f"{value:.2f}x)")  # fmt: skip
            continue
        parity = [name for name in _AT_PARITY if name in times]
        if parity:
            best = min(parity, key=lambda name: times[name])
            value = times["auto"] / times[best]
            notes.append(f"{network}: auto within 5% of the best hook at loss parity: "
                         f"{'MET' if value <= 1.05 else 'MISSED'} (auto {times['auto']:.3f} s / {best} "
                         f"{times[best]:.3f} s = {value:.2f}x)")  # fmt: skip
    return notes


def _off_notes(rows: Sequence[Row]) -> list[str]:
    """For each row beyond the tolerance: which part of the prediction is off, in numbers."""
    notes = []
    for row in rows:
        if row.extra.get("within_25%") != "NO":
            continue
        compute = row.extra["floor_s"]
        predicted_codec, measured_codec = row.extra["pred_compress_s"], row.extra.get("measured_compress_s")
        rest = row.value - compute - (measured_codec or 0.0)
        parts = f"predicted compression {predicted_codec:.3f} s"
        if measured_codec is not None:
            parts += f" (the hook counted {measured_codec:.3f} s)"
        parts += (
            f", communication shown {row.extra['pred_comm_shown_s']:.3f} s (measured step - floor - counted "
            f"compression: {rest:.3f} s), load {row.extra['load_1m']}"
        )
        notes.append(
            f"OFF BY MORE THAN 25%: {row.case} {row.backend}: predicted {row.extra['predicted_s']:.3f} s, "
            f"measured {row.value:.3f} s ({row.extra['error']}): {parts}"
        )
    return notes


def _loopback_link(oversubscription: float) -> tuple[Link, str]:
    times = measure_allreduce(_FIT_SIZES, world_size=2, repeat=15, best=True)
    link = fit_link(times, 2, overlaps_compute=False, name="loopback")
    note = (
        f"loopback link: gloo allreduce between 2 local processes, fastest of 15 at "
        f"{', '.join(f'{n / 1e6:g}' for n in _FIT_SIZES)} MB, fitted: alpha {link.alpha_s * 1e6:.0f} us, "
        f"{link.bandwidth_Bps / 1e6:.0f} MB/s, not overlapping compute"
    )
    if oversubscription > 1:
        link = Link(link.alpha_s, link.bandwidth_Bps / oversubscription, False, "loopback shared")
    return link, note


def _settings(args: argparse.Namespace) -> Any:
    return hooks_runs.Settings(
        warmup=args.warmup, steps=args.steps, timeout_s=args.timeout, paired_floor=True
    )


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", default=",".join(NETWORKS), help=f"comma-separated, of {NETWORKS}")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds per configuration")
    parser.add_argument(
        "--name", default="bench_advisor", help="the results' file name (another machine's run keeps its own)"
    )
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the output folder's JSON")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads((output_dir() / f"{args.name}.json").read_text()), output_dir() / f"{args.name}.png")
        return "replotted"
    networks = [n for n in args.networks.split(",") if n]
    unknown = sorted(set(networks) - set(NETWORKS))
    if unknown:
        parser.error(f"unknown networks {unknown}; known: {NETWORKS}")
    cores = os.cpu_count() or 1
    rates = measure_rates("cpu", numel=_RATE_NUMEL, threads=1)
    loopback, loopback_note = _loopback_link(1.0)
    notes = [
        "model: MLP 1024-4096-4096-1024, 25.18M fp32 parameters; DDP's 25 MB buckets; "
        f"{args.warmup} warm-up + {args.steps} timed steps per configuration, slower rank's median",
        f"kernel rates: measured here with 1 thread on {_RATE_NUMEL >> 20}M elements, e.g. quantize8 "
        f"{rates.rates['quantize8'] / 1e9:.2f}, sign_compress {rates.rates['sign_compress'] / 1e9:.2f} GB/s "
        "of fp32 input",
        loopback_note,
        "advisor inputs: step_compute = floor_s, the no-op step timed beside each step of the row (their "
        "median); links as the CLI parses them (1gbit -> 119.5 MB/s of TCP payload), loopback fitted; "
        "nothing fitted to a step time",
        f"error = predicted / measured - 1; within_25% marks |error| <= {TOLERANCE:.0%}",
    ]
    rows: list[Row] = []
    base = {"params": hooks_runs.num_params(), "rates": rates, "shapes": _SHAPES}
    settings = _settings(args)
    reason = netlab.unavailable_reason()
    for network in networks:
        started = time.perf_counter()
        if network == "loopback":
            outcomes = _measure(network, _TWO_RANKS + _AUTO, settings, None)
            kwargs = {**base, "gpus": 2, "gpus_per_node": 2, "link": loopback, "intra": loopback}
        elif reason is not None:
            notes.append(f"{network}: skipped, {reason}")
            progress(f"[bench_advisor] skip {network}: {reason}")
            continue
        elif network == "nodes":
            share = max(1.0, 4 / cores)  # 4 ranks on this many cores: CPU-bound parts at 1/share speed
            shared_loopback, _ = _loopback_link(share) if share > 1 else (loopback, "")
            with netlab.Nodes(ranks_per_node=2, rate="1gbit") as nodes:
                outcomes = _measure(network, _NODES, settings, nodes)
            kwargs = {
                **base,
                "gpus": 4,
                "gpus_per_node": 2,
                "link": parse_link("1gbit", loopback.alpha_s),
                "intra": shared_loopback,
                "rates": _shared(rates, share),
            }
            notes.append(
                f"nodes: 2 nodes x 2 ranks (netlab.Nodes, tbf 1gbit between them, loopback inside); 4 ranks "
                f"on {cores} cores: kernel rates and the loopback's bandwidth divided by {share:g}"
            )
        else:
            with netlab.Link(rate=network) as link:
                throughput = netlab.measure_throughput(link, nbytes=(64 if network == "1gbit" else 16) << 20)
                outcomes = _measure(network, _TWO_RANKS + _AUTO, settings, link)
            kwargs = {
                **base,
                "gpus": 2,
                "gpus_per_node": 1,
                "link": parse_link(network, loopback.alpha_s),
                "intra": loopback,
            }
            notes.append(
                f"{network}: veth between two namespaces, tbf {network}, TCP measured {throughput:.1f} MB/s"
            )
        rows += _rows(network, outcomes, kwargs, args.steps)
        progress(f"[bench_advisor] {network} done in {time.perf_counter() - started:.0f} s")
    notes += _summary(rows) + _auto_notes(rows) + _off_notes(rows)
    table = write_results(args.name, rows, notes=notes, plot_metric="step_time")
    plot(json.loads((output_dir() / f"{args.name}.json").read_text()), output_dir() / f"{args.name}.png")
    return table


def _shared(rates: KernelRates, share: float) -> KernelRates:
    return rates.scaled(1 / share) if share > 1 else rates


def _summary(rows: Sequence[Row]) -> list[str]:
    checked = [r for r in rows if "within_25%" in r.extra]
    within = [r for r in checked if r.extra["within_25%"] == "yes"]
    notes = [f"{len(within)} of {len(checked)} predictions within {TOLERANCE:.0%} of the measurement"]
    for row in rows:
        if "measured_vs_flat" in row.extra and "pred_vs_flat" in row.extra:
            notes.append(
                f"{row.case}: {row.backend} vs flat: predicted {row.extra['pred_vs_flat']:.2f}x, measured "
                f"{row.extra['measured_vs_flat']:.2f}x"
            )
    return notes


def plot(payload: dict[str, Any], path: Path) -> None:
    """Predicted against measured step time, one point per configuration and network, with the 25% band.

    Example::

        plot(json.loads(Path("benchmarks/results/bench_advisor.json").read_text()), Path("bench_advisor.png"))
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [
        r
        for r in payload["rows"]
        if r["extra"].get("predicted_s") and r["value"] is not None and r["value"] > 0
    ]
    if not points:
        return
    cpus = payload.get("machine", {}).get("cpus", "?")
    fig, ax = plt.subplots(figsize=(7.5, 6.5))
    top = max(max(r["value"], r["extra"]["predicted_s"]) for r in points) * 1.3
    low = min(min(r["value"], r["extra"]["predicted_s"]) for r in points) / 1.3
    line = [low, top]
    ax.plot(line, line, color="#333333", linewidth=1.0, label="predicted = measured")
    ax.fill_between(
        line,
        [v * (1 - TOLERANCE) for v in line],
        [v * (1 + TOLERANCE) for v in line],
        color="#55a868",
        alpha=0.15,
        label=f"within {TOLERANCE:.0%}",
    )
    colours = dict(zip(NETWORKS, ("#4c72b0", "#dd8452", "#c44e52", "#8172b3"), strict=True))
    for network in dict.fromkeys(r["case"] for r in points):
        mine = [r for r in points if r["case"] == network]
        ax.scatter(
            [r["value"] for r in mine],
            [r["extra"]["predicted_s"] for r in mine],
            s=36,
            color=colours.get(network, "#777777"),
            label=network,
            zorder=3,
        )
        for r in mine:
            ax.annotate(
                r["backend"],
                (r["value"], r["extra"]["predicted_s"]),
                fontsize=7,
                xytext=(4, 3),
                textcoords="offset points",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, top)
    ax.set_ylim(low, top)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s), fastcomm.advise")
    ax.set_title(f"advisor vs measurement: 25.2M-parameter MLP, gloo ranks on {cpus} CPU cores", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(color="#dddddd", linewidth=0.6, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    print(main())
