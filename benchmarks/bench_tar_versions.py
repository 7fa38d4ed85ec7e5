"""WebDataset tars read in place by ``StreamLoader``, one code tree against another, in one run.

The question: did reading tars get slower between two commits, and where? ``--samples`` (20,000) samples of
a 3x32x32 uint8 ``x.npy`` + ``cls`` label in tars of 5,000 (``tarfile``, USTAR), each tree reading its own
copy (the sidecar index a tree writes is its own). Each round runs every tree once, in turn (A B A B ...),
in a fresh process with ``PYTHONPATH`` set to the tree: open a ``StreamLoader(batch_size=256,
num_workers=0)``, ``--epochs`` epochs (the first a warm-up), then a fresh loader's open and first epoch.
Per tree: the median over rounds of the median epoch's samples/s (wall), of the best epoch's, of
samples per CPU second (``time.process_time``: less moved by other jobs on shared cores than the wall
clock), of the open's CPU milliseconds, and of open + one epoch. Ratios are to the first tree, round by
round, then the median.

Example::

    git worktree add --detach /tmp/old 1a1bfc3   # build its fastio._C there: setup.py build_ext --inplace
    python -m benchmarks.bench_tar_versions --tree old=/tmp/old --tree new=.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.harness import Row, write_results

__all__ = ["main"]

PER_SHARD = 5_000
BATCH = 256
METRICS = {  # key -> (metric, unit)
    "steady": ("median epoch", "samples/s"),
    "best": ("best epoch", "samples/s"),
    "cpu": ("median epoch per CPU second", "samples/s"),
    "open_plus_epoch": ("open + first epoch", "samples/s"),
    "open_cpu_ms": ("open, CPU", "ms"),
}


def _write_tars(folder: Path, samples: int) -> str:
    import numpy as np

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    shards = -(-samples // PER_SHARD)
    for s in range(shards):
        with tarfile.open(folder / f"shard-{s:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(s * PER_SHARD, min(samples, (s + 1) * PER_SHARD)):
                buf = io.BytesIO()
                np.save(buf, rng.integers(0, 256, (3, 32, 32), dtype=np.uint8))
                for name, data in (
                    (f"s{i:08d}.x.npy", buf.getvalue()),
                    (f"s{i:08d}.cls", b"%d" % (i % 1000)),
                ):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime = len(data), 1_700_000_000
                    tar.addfile(info, io.BytesIO(data))
    return f"shard-{{000000..{shards - 1:06d}}}.tar"


def _child(pattern: str, epochs: int) -> dict[str, float]:
    """One tree's measurement, in the process the driver started with that tree on ``PYTHONPATH``."""
    import torch

    torch.set_num_threads(1)
    import fastio

    cpu0 = time.process_time()
    loader = fastio.StreamLoader(pattern, batch_size=BATCH, num_workers=0)
    open_cpu = time.process_time() - cpu0
    wall, cpu = [], []
    for _ in range(epochs):
        start, cpu0, seen = time.perf_counter(), time.process_time(), 0
        for batch in loader:
            seen += len(batch["cls"])
        wall.append(seen / (time.perf_counter() - start))
        cpu.append(seen / (time.process_time() - cpu0))
    start = time.perf_counter()
    seen = sum(len(batch["cls"]) for batch in fastio.StreamLoader(pattern, batch_size=BATCH, num_workers=0))
    return {
        "steady": statistics.median(wall[1:]),
        "best": max(wall[1:]),
        "cpu": statistics.median(cpu[1:]),
        "open_plus_epoch": seen / (time.perf_counter() - start),
        "open_cpu_ms": open_cpu * 1e3,
    }


# The child runs with only the measured tree on its path (an old tree has a benchmarks package of its own).
_CHILD_CODE = (
    f"import json, statistics, sys, time\nBATCH = {BATCH}\n"
    + inspect.getsource(_child)
    + "print(json.dumps(_child(sys.argv[1], int(sys.argv[2]))))\n"
)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, help="name=path of a source tree")
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    trees = dict(spec.split("=", 1) for spec in args.tree)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        pattern = _write_tars(Path(tmp) / "src", args.samples)
        for name in trees:
            shutil.copytree(Path(tmp) / "src", Path(tmp) / name)
        for r in range(args.rounds):
            for name, root in trees.items():
                root = str(Path(root).resolve())
                out = subprocess.run(
                    [sys.executable, "-c", _CHILD_CODE, str(Path(tmp) / name / pattern), str(args.epochs)],
                    env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"),
                    capture_output=True, text=True, cwd=tmp,
                )  # fmt: skip
                if out.returncode:
                    raise SystemExit(f"{name} ({root}) failed:\n{out.stderr}")
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    first = next(iter(trees))
    rows = []
    for key, (metric, unit) in METRICS.items():
        for name in trees:
            ratios = [run[key] / base[key] for run, base in zip(runs[name], runs[first], strict=True)]
            rows.append(
                Row(
                    key,
                    name,
                    metric,
                    statistics.median(run[key] for run in runs[name]),
                    unit,
                    None if name == first else statistics.median(ratios),
                    None if name == first else first,
                    {"per_round": [round(run[key], 2) for run in runs[name]]},
                )
            )
    notes = [
        f"{args.samples:,} samples of (3, 32, 32) uint8 x.npy + cls in tars of {PER_SHARD:,}; batch {BATCH}, "
        f"num_workers=0; {args.rounds} rounds, trees in turn; {args.epochs} epochs per run (first a warm-up)",
        "trees: " + ", ".join(f"{name}={root}" for name, root in trees.items()),
        f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
    ]
    return write_results("bench_tar_versions", rows, notes=notes, plot_metric="samples/s")


if __name__ == "__main__":
    print(main())
