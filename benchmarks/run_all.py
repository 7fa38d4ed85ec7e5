"""`make bench`: every benchmark on built-in synthetic data, one after another, each printing its table.

1. Where results go: a new run folder, ``benchmarks/runs/<UTC time>/`` (git-ignored), or
   ``$FASTLIB_BENCH_OUTPUT`` when set; the committed ``benchmarks/results/`` only with ``--update-results``
   (``make bench UPDATE_RESULTS=1``). The folder is named before the first benchmark and after the last.
2. What needs root: the shaped links of :mod:`benchmarks.netlab` need root, ``ip`` and ``tc``. Where they
   are missing, each benchmark that uses them prints one ``skip ...`` line and runs without those parts
   (or, for one that has no other part, not at all), rather than failing.
3. One benchmark failing does not stop the others; the exit status is 1 if any failed.

Example::

    python -m benchmarks.run_all                     # -> benchmarks/runs/20250101-120000Z/
    python -m benchmarks.run_all --update-results    # -> benchmarks/results/
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

from benchmarks import harness, netlab

__all__ = ["SUITE", "Benchmark", "Step", "choose_output", "main", "plan"]


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One benchmark of the suite: its module under ``benchmarks/``, and what of it needs netlab.

    Attributes:
        name: the module, e.g. ``"bench_hooks"``.
        netlab_part: what of it runs on netlab's shaped links (None: nothing does).
        without_netlab: the arguments that run the rest; None when nothing is left.
    """

    name: str
    netlab_part: str | None = None
    without_netlab: tuple[str, ...] | None = ()


SUITE = (
    Benchmark("bench_kernels"),
    Benchmark("bench_loader"),
    Benchmark("bench_images"),
    Benchmark("bench_hooks", "netlab and nodes networks (1gbit links)", ("--network", "loopback")),
    Benchmark("bench_convergence", "speed runs (shaped links)", ("--skip-speed",)),
    Benchmark("bench_remote", "entirely (HTTP behind a 1gbit link)", None),
)


@dataclasses.dataclass(frozen=True)
class Step:
    """What :func:`main` does with one benchmark: ``main(argv)`` (not run when ``argv`` is None), after
    printing ``skip`` when there is one."""

    name: str
    argv: list[str] | None
    skip: str | None = None


def plan(suite: Sequence[Benchmark], netlab_unavailable: str | None) -> list[Step]:
    """Each benchmark's step; where netlab is unavailable (``netlab.unavailable_reason()``), those that use
    it leave it out and say so in one line.

    Example::

        steps = plan(SUITE, "netlab needs root to create network namespaces")
    """
    steps = []
    for bench in suite:
        if bench.netlab_part is None or netlab_unavailable is None:
            steps.append(Step(bench.name, []))
            continue
        argv = None if bench.without_netlab is None else list(bench.without_netlab)
        steps.append(Step(bench.name, argv, f"skip {bench.name} {bench.netlab_part}: {netlab_unavailable}"))
    return steps


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
        "--update-results",
        action="store_true",
        help=f"write the committed {harness.RESULTS_DIR} (default: a new folder under {harness.RUNS_DIR})",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    out = choose_output(args.update_results, os.environ, time.gmtime())
    os.environ[harness.OUTPUT_ENV] = str(out)  # what harness.output_dir() reads, here and in child processes
    print(f"Results go to {out}", flush=True)
    failed = []
    for step in plan(SUITE, netlab.unavailable_reason()):
        if step.skip:
            print(step.skip, flush=True)
        if step.argv is None:
            continue
        start = time.perf_counter()
        print(f"\n===== benchmarks/{step.name}.py {' '.join(step.argv)} =====", flush=True)
        try:
            print(importlib.import_module(f"benchmarks.{step.name}").main(step.argv))
        except Exception as exc:  # one benchmark failing must not hide the others' numbers
            failed.append(step.name)
            print(f"{step.name} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"({step.name} took {time.perf_counter() - start:.0f} s)", flush=True)
    print(f"\nResults: {out}/*.json, *.md, *.png")
    if not args.update_results:
        print(f"(left as they were: {harness.RESULTS_DIR}; make bench UPDATE_RESULTS=1 updates them)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
