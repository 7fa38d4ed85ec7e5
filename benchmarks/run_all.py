"""`make bench`: every benchmark on built-in synthetic data, one after another, each printing its table.

1. How much: by default the short profile, each benchmark with the arguments of :attr:`Benchmark.short`
   (smaller data, fewer steps, fewer rows, but every kind of claim still measured; under 20 minutes on 2
   cores as root, see :func:`short_minutes`), bench_convergence's result naming the committed full one to
   compare with. ``--full`` (``make bench FULL=1``) runs every benchmark with its own defaults (about
   2 h, 1.5 of them bench_convergence). ``--update-results`` implies ``--full``: the committed results
   are full runs. While a benchmark runs, a line comes at least every :data:`harness.HEARTBEAT_S` seconds.
2. Where results go: a new run folder, ``benchmarks/runs/<UTC time>/`` (git-ignored), or
   ``$FASTLIB_BENCH_OUTPUT`` when set; the committed ``benchmarks/results/`` only with ``--update-results``
   (``make bench UPDATE_RESULTS=1``). The folder is named before the first benchmark and after the last.
3. What needs root: the shaped links of :mod:`benchmarks.netlab` need root, ``ip`` and ``tc``. Where they
   are missing, each benchmark that uses them prints one ``skip ...`` line and runs without those parts
   (or, for one that has no other part, not at all), rather than failing.
4. One benchmark failing does not stop the others; the exit status is 1 if any failed.
5. At the end, :mod:`benchmarks.guard` compares each headline figure of this run with the committed results
   (read before the run; the short profile with ``benchmarks/results/short/``, a quiet short-profile run's
   JSON, so that like is compared with like: :func:`benchmarks.guard.baseline`) and prints and writes
   ``guard.md`` / ``guard.json`` into the run folder: a drop of
   more than 10% is flagged, and each figure says whether it is a same-run ratio (evidence) or an absolute
   figure across runs (a hint). Flags do not change the exit status.

Example::

    python -m benchmarks.run_all                     # short profile -> benchmarks/runs/20250101-120000Z/
    python -m benchmarks.run_all --full              # every benchmark in full (about 2 h)
    python -m benchmarks.run_all --update-results    # in full -> benchmarks/results/
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks import guard, harness, netlab

__all__ = ["SUITE", "Benchmark", "Step", "choose_output", "main", "plan", "short_minutes"]


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One benchmark of the suite: its module under ``benchmarks/``, its short profile, and what of it
    needs netlab.

    Attributes:
        name: the module, e.g. ``"bench_hooks"``.
        short: the arguments of the default (short) profile, with the minutes they take on 2 cores as
            root in ``minutes`` (estimated from the committed results' timings); ``--full`` passes none.
        minutes: the short profile's estimated wall time with netlab, and without it.
        netlab_part: what of it runs on netlab's shaped links (None: nothing does).
        without_netlab: the arguments that run the rest, overriding ``short``'s options of the same name;
            None when nothing is left.
    """

    name: str
    short: tuple[str, ...] = ()
    minutes: tuple[float, float] = (0.0, 0.0)
    netlab_part: str | None = None
    without_netlab: tuple[str, ...] | None = ()


# Short-profile estimates (2 cores, as root / without root), from the committed results and the code. Measured
# end to end on a quiet host (2026-12-05, as root, a fresh clone's .venv): 590 s in all (kernels to shuffle
# 1.8 min, hooks 2.3, convergence 4.2, fsdp 0.5, remote at 0.25 GB 0.9), so these err on the long side.
# kernels: the 25M default (100 MB, past the caches; 3 repeats, ~25 s): at 5M memcpy ran in cache at 104 GB/s
#   on 2026-12-07 (15 GB/s on 12-05), so every "x memcpy" ratio moved 2.5x with the host, not the code.
# loader: 1/5 of every data set; writing the 3 GB `fixed` set alone took 19 s in full. With the peers it
#   took 34 s, and 39 s without them, at a load of 3-5 on 2 cores; they take 5 contenders x 3 rounds x
#   <= 0.5 s (--peer-seconds) plus one warm-up epoch of 200,000 samples.
# images: --quick is 1,000 JPEGs and 640 timed samples per run, 2 rounds (1/5 of the full run), 6 contenders
#   per mode with the peers: 35 s with them, 66 s without them at a load of 3-5 (the load dominates).
# shuffle: 16 small shards over HTTP on 127.0.0.1, 4 cache sizes x 3 orders: ~50 s for the full run's 3 epochs
#   (parts of shards are many small range requests), 1 epoch here (128 batches per configuration).
# hooks: 2 + 2 steps per configuration, 10 configurations per network at ~13 s each (process start,
#   model build, 4 steps of 0.3-1 s); left out: torch_powersgd_r4, which fails over gloo (its one-bucket
#   twin runs), and the nodes network (4 min, its own bench_hooks_nodes.*).
# convergence: 3 methods x 250 steps on loopback at ~0.33 s/step + ~20 s of start and evaluation (~1.75 min
#   each; none and cadam took 69 s and 116 s at a load of 3-4, cadam +0.48% of dense's loss), then 9 speed
#   runs of 8 steps (~21 s each) on the shaped and 1gbit links; the full run is 18 methods x 500 steps
#   (~1.8 h).
# loader: the mixing case (3 streams against one, 2 worker settings) adds ~30 s.
# remote: 0.5 GB of each shard kind (1/2), one run per configuration (of 2): ~1/4 of its ~5 min (at 0.25 GB
#   epoch 1 read 0.67x the link rate against 0.93x in full: the open and the ramp-up weigh more).
# fsdp: 2 launches of 2 ranks (~7 s of start each on idle cores, 20-27 s under a load of ~30): 40 loss
#   steps x 2 methods of a 39k-parameter MLP, then 3 methods x 3 steps of a 6.3M-parameter MLP on the
#   1 Gbit/s link (or loopback without root) in 2 layouts (FSDP2's defaults, and bf16 compute weights
#   kept unsharded from forward to backward: a launch each); measured 48 s at a load of ~10 with 1 layout.
#   With root, one launch of 4 ranks on netlab.Nodes: HSDP dense and q8, 3 steps each of the same MLP
#   (3 methods of a 1M-parameter one took 20 s at a load of ~9): ~0.4 min more. The memory part (a fresh
#   launch per method) and the LM part (7 min per method) run in the full profile only.
SUITE = (
    Benchmark("bench_kernels", ("--repeat", "3"), (0.5, 0.5)),
    Benchmark(
        "bench_loader",
        (
            "--samples", "200000", "--var-samples", "20000", "--tar-samples", "20000",
            "--dataloader-samples", "20000", "--webloader-samples", "5000", "--peer-seconds", "0.5",
            "--pack-docs", "10000",
        ),
        (1.5, 1.5),
    ),
    Benchmark("bench_images", ("--quick",), (1.3, 1.3)),
    Benchmark("bench_shuffle", ("--epochs", "1"), (0.5, 0.5)),  # 29 CPU-s measured (0.4 was too low)
    Benchmark("bench_ft", (), (2.0, 2.0)),
    Benchmark("bench_parquet", ("--repeats", "2", "--hf-rows", "5000"), (1.5, 1.5)),
    # bench_diloco_seeds: dense and the defaults, 30 steps of a 137k-parameter LM each in one pair of ranks:
    # 18 CPU-s (21 with the noise row, left to the full profile: the same code as dense); the full profile:
    # about 70 runs of 250 steps, about 90 min of their own
    Benchmark("bench_diloco_seeds", ("--rows", "diloco_q4_defaults", "--seeds", "0", "--steps", "30",
                                     "--choice-rows", ""), (0.4, 0.4)),
    Benchmark(
        "bench_hooks",
        (
            "--quick", "--network", "both", "--configs",
            "allreduce,noop,torch_fp16,torch_powersgd_r4_1bucket,bf16_cast,topk_0.01,quant8,quant4,sign,"
            "powersgd_r4,auto",
        ),
        (3.5, 2.0),
        "netlab and nodes networks (1gbit links)",
        ("--network", "loopback"),
    ),
    Benchmark(
        "bench_convergence",
        ("--methods", "none,cadam,diloco_q4", "--steps", "250", "--warmup-steps", "2", "--timed-steps", "6"),
        (6.0, 4.0),
        "speed runs (shaped links)",
        ("--skip-speed",),
    ),
    Benchmark(
        "bench_fsdp",
        (
            "--parts", "loss,speed,hsdp", "--loss-steps", "40", "--loss-methods", "dense,q8",
            "--loss-layouts", "fp32", "--width", "1024", "--depth", "6", "--warmup", "1", "--timed", "2",
            "--speed-layouts", "fp32,bf16-keep", "--network", "1gbit", "--hsdp-methods", "dense,q8",
        ),
        (1.2, 0.6),
        "1gbit link and HSDP nodes",
        ("--network", "loopback"),
    ),
    Benchmark(
        "bench_remote",
        ("--gigabytes", "0.5", "--shard-mb", "32", "--probe-mb", "128", "--repeats", "1"),
        (1.5, 0.0),
        "entirely (HTTP behind a 1gbit link)",
        None,
    ),
)


@dataclasses.dataclass(frozen=True)
class Step:
    """What :func:`main` does with one benchmark: ``main(argv)`` (not run when ``argv`` is None), after
    printing ``skip`` when there is one."""

    name: str
    argv: list[str] | None
    skip: str | None = None


def _by_option(argv: Sequence[str]) -> dict[str, list[str]]:
    """``["--a", "1", "--b"]`` as ``{"--a": ["1"], "--b": []}``: each option with the values after it."""
    options: dict[str, list[str]] = {}
    for token in argv:
        if token.startswith("--"):
            options[token] = []
        else:
            options[next(reversed(options))].append(token)
    return options


def _merged(first: Sequence[str], then: Sequence[str]) -> list[str]:
    """``first``'s options with those of ``then`` added, an option in both taking ``then``'s values."""
    options = {**_by_option(first), **_by_option(then)}
    return [token for option, values in options.items() for token in (option, *values)]


def plan(suite: Sequence[Benchmark], netlab_unavailable: str | None, *, full: bool = False) -> list[Step]:
    """Each benchmark's step: its short-profile arguments, or none with ``full``; where netlab is
    unavailable (``netlab.unavailable_reason()``), those that use it leave it out and say so in one line.

    Example::

        steps = plan(SUITE, "netlab needs root to create network namespaces")
    """
    steps = []
    for bench in suite:
        short = [] if full else list(bench.short)
        if bench.netlab_part is None or netlab_unavailable is None:
            steps.append(Step(bench.name, short))
            continue
        argv = None if bench.without_netlab is None else _merged(short, bench.without_netlab)
        steps.append(Step(bench.name, argv, f"skip {bench.name} {bench.netlab_part}: {netlab_unavailable}"))
    return steps


def short_minutes(suite: Sequence[Benchmark], netlab_unavailable: str | None) -> float:
    """The short profile's estimated wall time in minutes on 2 cores, with netlab or without it."""
    return sum(b.minutes[0 if netlab_unavailable is None else 1] for b in suite)


def choose_output(update_results: bool, environ: Mapping[str, str], now: time.struct_time) -> Path:
    """The folder every benchmark of this run writes to: the committed results when ``update_results``,
    else ``$FASTLIB_BENCH_OUTPUT`` if set, else a new run folder named by ``now`` (UTC).

    Example::

        out = choose_output(False, os.environ, time.gmtime())   # benchmarks/runs/<UTC time>
    """
    if update_results:
        return harness.RESULTS_DIR
    chosen = environ.get(harness.OUTPUT_ENV)
    return Path(chosen).resolve() if chosen else harness.run_folder(now)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--full",
        action="store_true",
        help="every benchmark with its own defaults, about 2 h (default: the short profile, about 20 min)",
    )
    parser.add_argument(
        "--update-results",
        action="store_true",
        help=f"write the committed {harness.RESULTS_DIR}, in full (default: a new folder under "
        f"{harness.RUNS_DIR})",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    full = args.full or args.update_results
    out = choose_output(args.update_results, os.environ, time.gmtime())
    os.environ[harness.OUTPUT_ENV] = str(out)  # what harness.output_dir() reads, here and in child processes
    print(f"Results go to {out}", flush=True)
    netlab_unavailable = netlab.unavailable_reason()
    if full:
        print("Full profile: every benchmark with its own defaults (about 2 h on 2 cores)", flush=True)
    else:
        print(
            f"Short profile (about {short_minutes(SUITE, netlab_unavailable):.0f} min on 2 cores): fewer "
            f"rows and steps, smaller data; the full results are committed in {harness.RESULTS_DIR}; "
            "make bench FULL=1 runs everything (about 2 h)",
            flush=True,
        )
    against = guard.baseline(full)
    committed = guard.read_figures(guard.HEADLINES, against)  # before --update-results writes
    failed = []
    for step in plan(SUITE, netlab_unavailable, full=full):
        if step.skip:
            print(step.skip, flush=True)
        if step.argv is None:
            continue
        start = time.perf_counter()
        print(f"\n===== benchmarks/{step.name}.py {' '.join(step.argv)} =====", flush=True)
        try:
            with harness.heartbeat(step.name):
                print(importlib.import_module(f"benchmarks.{step.name}").main(step.argv))
        except Exception as exc:  # one benchmark failing must not hide the others' numbers
            failed.append(step.name)
            print(f"{step.name} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"({step.name} took {time.perf_counter() - start:.0f} s)", flush=True)
    checks = guard.compare(guard.HEADLINES, committed, guard.read_figures(guard.HEADLINES, out))
    print(f"\nGuard: headline figures against the committed {against} (also {out}/guard.md)")
    print(guard.write_report(checks, out, guard.results_commit(harness.RESULTS_DIR), against))
    print(f"\nResults: {out}/*.json, *.md, *.png")
    if not args.update_results:
        print(f"(left as they were: {harness.RESULTS_DIR}; make bench UPDATE_RESULTS=1 updates them)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
