"""The DDP hook step on a shaped 1 Gbit/s link, one code tree against another, in one run.

The question: did a change to the library (a refactor, say) cost the hooks' step time where it matters, on a
slow link? Each round runs every tree once, in turn (A B A B ...), each in fresh processes with ``PYTHONPATH``
and the working directory set to the tree: that tree's own ``python -m benchmarks.bench_hooks --network netlab
--configs ...`` (2 gloo ranks, the 25.2M-parameter MLP, 2 warm-up + 5 timed steps, the slower rank's median
step; see :mod:`benchmarks.bench_hooks`). Per tree and configuration: the median over rounds of the step
time, of ``x_noop_floor`` (this step / the same run's no-op hook step, the compute floor) and, for the
fastcomm hooks, of ``speedup_vs_fp16`` (torch's fp16 hook's step / this step), each ratio taken inside one
run of one tree. ``ratio`` is this tree's step / the first tree's, round by round, then the median.

Needs root and ``ip`` (:mod:`benchmarks.netlab`), as bench_hooks' netlab network does. Each tree needs its
own native modules (``fastcomm/_C*.so``, ``fastio/_C*.so``) built from its own ``csrc/`` (another tree's
copy is right only where ``git diff A B -- csrc setup.py`` is empty), and the machine as quiet as can be
had: the ratios compare the seconds of separate runs.

Example::

    git worktree add --detach /tmp/base 6b4c53f
    (cd /tmp/base && python setup.py build_ext --inplace)  # the python of the venv that runs the benchmark
    python -m benchmarks.bench_hook_versions --tree base=/tmp/base --tree new=. --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import Row, progress, write_results

__all__ = ["main"]

CONFIGS = ("noop", "torch_fp16", "topk_0.01", "quant8")
FP16 = "torch_fp16"


def _one_run(root: Path, configs: tuple[str, ...], out: Path, timeout_s: float) -> dict[str, float]:
    """One tree's bench_hooks on netlab: configuration -> step seconds (NaN where it did not run)."""
    env = dict(os.environ, PYTHONPATH=str(root), FASTLIB_BENCH_OUTPUT=str(out), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_hooks", "--network", "netlab",
         "--configs", ",".join(configs)],
        cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"bench_hooks in {root} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = json.loads((out / "bench_hooks.json").read_text())["rows"]
    return {
        row["backend"]: float("nan") if row["value"] is None else row["value"]
        for row in rows
        if row["case"] == "netlab"
    }


def _commit(root: Path) -> str:
    """The tree's commit (``+dirty`` with uncommitted changes), so a result names what it measured."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True)  # fmt: skip
    return (head.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, help="name=path of a source tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="bench_hooks configurations (noop and torch_fp16 are always added: the ratios use them)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per tree per round")
    args = parser.parse_args(argv)
    trees = {name: Path(path).resolve() for name, path in (spec.split("=", 1) for spec in args.tree)}
    configs = tuple(dict.fromkeys(("noop", FP16, *args.configs.split(","))))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, root in trees.items():
                out = Path(tmp) / f"{name}-{r}"
                out.mkdir()
                runs[name].append(_one_run(root, configs, out, args.timeout))
                steps = ", ".join(f"{c} {s:.3f} s" for c, s in runs[name][-1].items())
                progress(f"round {r} {name}: {steps}")
    first = next(iter(trees))
    rows = []
    for config in configs:
        for name in trees:
            steps = [run[config] for run in runs[name]]
            extra = {
                "per_round_s": [round(s, 4) for s in steps],
                "x_noop_floor": round(_median([run[config] / run["noop"] for run in runs[name]]), 3),
            }
            if config not in ("noop", FP16):
                extra["speedup_vs_fp16"] = round(_median([run[FP16] / run[config] for run in runs[name]]), 3)
            ratios = [run[config] / base[config] for run, base in zip(runs[name], runs[first], strict=True)]
            rows.append(Row(
                "netlab_1gbit", f"{name}:{config}", "step_time", _median(steps), "s",
                None if name == first else _median(ratios),
                None if name == first else f"{first} (step / its step)",
                extra,
            ))  # fmt: skip
    notes = [
        "2 gloo ranks on a veth pair shaped to 1 Gbit/s (benchmarks.netlab), MLP 1024-4096-4096-1024 (25.2M "
        "parameters), batch 64, SGD; bench_hooks' settings (2 warm-up + 5 timed steps, slower rank's median)",
        f"{args.rounds} rounds, trees in turn; every value is the median over rounds; ratios are taken "
        "inside one run of one tree, then the median over rounds",
        "trees: " + ", ".join(f"{name}={root} (commit {_commit(root)})" for name, root in trees.items()),
        f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
    ]
    return write_results("bench_hook_versions", rows, notes=notes, plot_metric="step_time")


if __name__ == "__main__":
    print(main())
