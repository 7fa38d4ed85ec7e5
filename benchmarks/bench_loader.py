"""Loader throughput on built-in synthetic data, every contender on the same bytes, in one run.

Cases (sizes are flags; defaults fit ~4 minutes on 2 shared cores and ~5 GB of /tmp):

* ``fixed``: ``--samples`` (1M) samples of 3x32x32 uint8 + int64 label in one fastio shard. Contenders:
  numpy memmap random batch gather over the shard's bytes (the limit), ``DataLoader`` over a map-style Dataset
  on the same memmap (workers 0 and 2, default collate, random sampler), ``StreamLoader`` (shard-aware and
  full shuffle, workers 0 and 2; 3 epochs with the process's resident memory after each).
* ``variable``: ``--var-samples`` int32 token sequences of 64-2048 tokens. Memmap per-sample slicing,
  ``DataLoader`` (list collate) and ``StreamLoader``.
* ``tar``: the first ``--tar-samples`` samples of ``fixed`` written by ``webdataset.ShardWriter``
  (``x.npy`` + ``cls``), read by ``webdataset.WebLoader`` (workers 0 and 2) and by ``StreamLoader``.
* ``packing``: ``--pack-docs`` (40,000) int32 token documents of lognormal lengths (mean ~500, about 20M
  tokens), packed into ``[--pack-batch, 1025]`` rows (``seq_len=1024``, ``shift=True``, document ids).
  Contenders, in tokens/s: a numpy memmap copy of the token bytes in storage order (the limit); the raw
  read of the same tokens (``StreamLoader`` over the same set without ``pack``, ``--batch`` documents per
  batch as a list of tensors: what a packer written by hand starts from, and the baseline of the ratio);
  a hand-written 12-line packer (``torch.cat`` + ``unfold``) over that raw loader; ``StreamLoader(pack=...)``
  (workers 0 and 2). Target: packed >= 0.7x the raw read.
* ``mixing``: the cost of weighted streams: three fastio shard directories of ``--mix-samples`` / 3 samples
  each (``fixed``'s sample layout), mixed at weights 0.5/0.3/0.2 (``fastio.Stream``), against one directory
  of ``--mix-samples`` samples, both full shuffle, workers 0 and 2, timed in alternation epoch by epoch
  (who goes first alternates too); the ratio is the median of the ``--mix-epochs`` per-epoch ratios, each
  of two neighbouring epochs, so a load that drifts over the run cancels; ``cpu_ratio``: the same with the
  process's CPU seconds per epoch (one stream's over the mix's), which other users' load on the host moves
  less than wall time. Target: mixed >= 0.9x one stream.
* Peers in ``fixed``, on the same memmap, 2 threads each (:mod:`benchmarks.peers`): ``torchdata.nodes``
  (``ParallelMapper`` per sample + ``Batcher`` + ``default_collate``, and a batch gather: indices batched,
  then one ``np.take`` per batch) and SPDL's ``PipelineBuilder`` (the same two shapes), taking turns with
  a ``StreamLoader`` row measured the same way, ``--peer-seconds`` per round. A peer that does not
  import gets a row without a value whose ``status`` says why.
* Mosaic Streaming / LitData rows appear only when those optional packages import (install them with
  ``pip install --no-deps``); otherwise a note says they were skipped.

Every number but packing's is samples/s over whole batches of ``--batch`` (256) samples; MB/s counts
payload bytes. ``--cases packing`` (say) reruns some cases and keeps the other cases' rows and notes from the
committed results (``benchmarks/results``).

The pieces: the data in :mod:`benchmarks.bench_loader_data`, how each contender is timed in
:mod:`benchmarks.bench_loader_timing`, the cases in :mod:`benchmarks.bench_loader_cases` and
:mod:`benchmarks.bench_loader_packing`.

Example::

    python -m benchmarks.bench_loader --samples 200000      # a quicker run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.bench_loader_cases import (
    bench_fixed,
    bench_mixing,
    bench_tar,
    bench_variable,
    peer_notes,
)
from benchmarks.bench_loader_data import (
    IMAGE_BYTES,
    IMAGE_SHAPE,
    PACK_MEAN_TOKENS,
    write_fixed,
    write_packing,
    write_tar,
    write_variable,
)
from benchmarks.bench_loader_packing import bench_packing
from benchmarks.harness import Row, write_results

__all__ = ["CASES", "main"]

CASES = ("fixed", "variable", "tar", "packing", "mixing")


def _optional_contenders(notes: list[str]) -> None:
    for module, label in (("streaming", "Mosaic Streaming"), ("litdata", "LitData")):
        try:
            __import__(module)
        except ImportError:
            notes.append(
                f"{label}: not installed (optional `compare` extra, install with --no-deps); skipped"
            )
        else:
            notes.append(f"{label}: installed but not benchmarked in this version of bench_loader")


# -- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> str:
    """Run every case and write ``bench_loader.{json,md,png}`` (``harness.output_dir()``); the Markdown.

    Example::

        print(main(["--samples", "100000", "--var-samples", "20000", "--tar-samples", "10000"]))
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--var-samples", type=int, default=100_000)
    parser.add_argument("--tar-samples", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--dataloader-samples", type=int, default=100_000, help="samples timed per DataLoader run"
    )
    parser.add_argument(
        "--webloader-samples", type=int, default=20_000, help="samples timed per WebLoader run"
    )
    parser.add_argument(
        "--peer-seconds", type=float, default=2.0, help="seconds (or an epoch) timed per peer round"
    )
    parser.add_argument("--pack-docs", type=int, default=40_000, help="token documents of the packing case")
    parser.add_argument("--pack-batch", type=int, default=32, help="rows per packed batch")
    parser.add_argument(
        "--mix-samples", type=int, default=120_000, help="samples of the mixing case, all streams together"
    )
    parser.add_argument("--mix-epochs", type=int, default=7, help="timed epoch pairs of the mixing case")
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated cases to run; the others' rows are kept"
    )
    args = parser.parse_args(argv)
    cases = set(args.cases.split(","))
    if not cases <= set(CASES):
        parser.error(f"--cases: unknown {sorted(cases - set(CASES))}; choose from {CASES}")

    import fastio

    rows: list[Row] = []
    notes = [
        f"fastio backend: {fastio.backend()}",
        f"batch size {args.batch}; {os.cpu_count()} CPU cores",
    ]
    root = Path(tempfile.mkdtemp(prefix="bench_loader_"))
    try:
        if cases & {"fixed", "tar"}:
            t0 = time.perf_counter()
            fixed_dir = write_fixed(root, args.samples)
        if "fixed" in cases:
            gigabytes = args.samples * (IMAGE_BYTES + 8) / 1e9
            notes.append(
                f"fixed: {args.samples:,} samples of {IMAGE_SHAPE} uint8 + int64 label = "
                f"{gigabytes:.2f} GB, written in {time.perf_counter() - t0:.0f} s"
            )
            rows += bench_fixed(fixed_dir, args, notes)
            notes += peer_notes(rows)
        if "variable" in cases:
            t0 = time.perf_counter()
            var_dir = write_variable(root, args.var_samples)
            notes.append(
                f"variable: {args.var_samples:,} int32 sequences of 64-2048 tokens "
                f"({sum(f.stat().st_size for f in var_dir.iterdir()) / 1e9:.2f} GB), "
                f"written in {time.perf_counter() - t0:.0f} s"
            )
            rows += bench_variable(var_dir, args)
        if "tar" in cases:
            t0 = time.perf_counter()
            pattern = write_tar(root, fixed_dir, min(args.tar_samples, args.samples), per_shard=10_000)
            notes.append(
                f"tar: first {min(args.tar_samples, args.samples):,} samples of `fixed` as "
                "webdataset.ShardWriter "
                f"shards of 10,000 (x.npy + cls), written in {time.perf_counter() - t0:.0f} s"
            )
            rows += bench_tar(pattern, args, notes)
        if "packing" in cases:
            t0 = time.perf_counter()
            pack_dir = write_packing(root, args.pack_docs)
            notes.append(
                f"packing: {args.pack_docs:,} int32 documents of lognormal lengths (mean "
                f"~{PACK_MEAN_TOKENS} tokens, 4 shards), written in {time.perf_counter() - t0:.0f} s"
            )
            rows += bench_packing(pack_dir, args, notes)
        if "mixing" in cases:
            rows += bench_mixing(root, args, notes)
        notes.append(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        if cases == set(CASES):
            _optional_contenders(notes)
        else:
            rows, notes = _keep_other_cases(rows, notes, cases)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return write_results("bench_loader", rows, notes=notes, plot_metric="samples/s")


def _keep_other_cases(rows: list[Row], notes: list[str], cases: set[str]) -> tuple[list[Row], list[str]]:
    """This run's rows and notes, plus the other cases' rows and notes from the existing results."""
    from benchmarks.harness import RESULTS_DIR

    path = RESULTS_DIR / "bench_loader.json"
    if not path.exists():
        return rows, notes
    previous = json.loads(path.read_text())
    old = [Row(**r) for r in previous["rows"] if r["case"] not in cases]
    merged = [r for case in CASES for r in (rows if case in cases else old) if r.case == case]
    fresh = {n.split(":")[0] for n in notes}
    kept = [n for n in previous.get("notes", []) if n.split(":")[0] not in fresh]
    return merged, notes + kept


if __name__ == "__main__":
    print(main())
