"""How fast ``StreamLoader`` reads Parquet (:mod:`fastio.format.parquet`) against ``pyarrow``'s own
``ParquetFile.iter_batches`` over the same files, and against Hugging Face ``datasets``' streaming
``IterableDataset`` in a ``DataLoader``.

1. Data (in a temp dir, removed at the end): a Hub-style folder of ``--files`` files
   (``data/train-0000k-of-0000n.parquet``, snappy, row groups of ``--row-group`` rows), each row a
   ``label`` (int64), a ``score`` (float32), an ``emb`` (32 float32, a fixed-size list) and ``input_ids``
   (int32 tokens, 16 to ``2 * --tokens - 16`` of them, random: they do not compress).
2. Rows/s: ``label``, ``score`` and ``emb`` of every row in batches of ``--batch-size``, as torch tensors,
   in file order (``shuffle=False``), each run a fresh loader (nothing decoded before), the median of
   ``--repeats`` runs after a warm-up read (the files are in the page cache for every contender):

   * ``iter_batches``: ``ParquetFile(f).iter_batches(batch_size, columns)`` file after file, each record
     batch turned into the same tensors (``torch.from_numpy`` of its columns: zero-copy); and the same
     without the tensors (Arrow record batches only, the floor of any reader over these files);
   * fastio: ``StreamLoader(parquet_source(folder, columns), batch_size)`` with ``num_workers`` 0, 1, 2, 4
     (threads), and with ``shuffle=True`` (every row group decoded once: the set fits the memory budget);
   * ``datasets``: ``load_dataset("parquet", data_files, streaming=True).with_format("torch")`` in a
     ``DataLoader`` (``num_workers`` 0 and 2), over the first ``--hf-rows`` rows (it is slow).
3. Packed tokens/s: ``input_ids`` packed into ``[8, --seq-len]`` rows, no eos, no document ids, counting the
   tokens of the full rows: fastio's ``pack=`` (a fresh loader per run over an empty cache: the one-time
   decode of the column into memory included, and the token files a background thread writes meanwhile
   for the next loader; a fresh loader over the token files an earlier one kept; a later epoch of one
   loader), against ``iter_batches`` with a minimal packer (concatenate each
   record batch's flat tokens, cut rows from a running buffer), and ``datasets`` with the same packer.

Bars (the issue's): fastio >= 0.9x ``iter_batches`` (with tensors) with 1 worker and scaling with workers;
>= 3x ``datasets``. The Python packages' versions are in the notes.

Run::

    python -m benchmarks.bench_parquet            # short profile: ~1 minute on 2 cores
    python -m benchmarks.bench_parquet --full     # 8x the rows
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import fastio
from benchmarks.harness import Row, progress, write_results
from fastio.format.parquet.opening import parquet_source

__all__ = ["main"]

NUMERIC = ["label", "score", "emb"]
EMB = 32
PACK_BATCH = 8


def _write(folder: Path, files: int, rows: int, row_group: int, tokens: int) -> list[str]:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    paths = []
    for f in range(files):
        lengths = rng.integers(16, 2 * tokens - 16, rows)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ids = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
        table = pa.table({
            "label": np.arange(f * rows, (f + 1) * rows, dtype=np.int64),
            "score": rng.random(rows, dtype=np.float32),
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(rows * EMB, dtype=np.float32)), EMB),
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
        })  # fmt: skip
        path = folder / f"train-{f:05d}-of-{files:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group)
        paths.append(str(path))
    return paths


def _tensors(batch: pa.RecordBatch) -> dict[str, torch.Tensor]:
    """A record batch's numeric columns as the tensors fastio gives (zero-copy where Arrow allows)."""
    out = {}
    for name in NUMERIC:
        column = batch.column(name)
        if pa.types.is_fixed_size_list(column.type):
            values = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), -1)
        else:
            values = column.to_numpy(zero_copy_only=False)
        out[name] = torch.from_numpy(values if values.flags.writeable else values.copy())
    return out


def _iter_batches(paths: Sequence[str], batch_size: int, columns: list[str]) -> Iterator[pa.RecordBatch]:
    for path in paths:
        yield from pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=columns)


class _Packer:
    """The minimal packer of the baselines: flat tokens appended, ``[8, L]`` rows cut from the front."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len, self.pending, self.tokens = seq_len, np.zeros(0, np.int32), 0

    def add(self, flat: np.ndarray) -> Iterator[torch.Tensor]:
        self.pending = np.concatenate([self.pending, flat])
        size = PACK_BATCH * self.seq_len
        while len(self.pending) >= size:
            block, self.pending = self.pending[:size], self.pending[size:]
            self.tokens += size
            yield torch.from_numpy(block.reshape(PACK_BATCH, self.seq_len))


@dataclasses.dataclass
class _Measured:
    """One contender over the rounds: medians of its rate and of its per-round ratio to the baseline, in
    wall time and in this process's CPU time (every thread of it; steadier than wall time on a loaded
    machine, blind to parallelism), and what one run counted."""

    rate: float
    ratio: float
    cpu_rate: float
    cpu_ratio: float
    count: int

    def extra(self, unit: str) -> dict[str, Any]:
        return {f"{unit}_per_cpu_s": round(self.cpu_rate), "cpu_ratio": round(self.cpu_ratio, 2)}


def _rounds(runs: dict[str, Callable[[], int]], baseline: str, rounds: int) -> dict[str, _Measured]:
    """Every run ``rounds`` times, round after round, the order rotated each round: a shared machine's load
    drifts, and a round's ratios compare runs made seconds apart."""
    names = list(runs)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    counts: dict[str, int] = {}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            counts[name] = runs[name]()
            wall[name].append(counts[name] / (time.perf_counter() - start))
            cpu[name].append(counts[name] / max(time.process_time() - start_cpu, 1e-9))

    def ratio(rates: dict[str, list[float]], name: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[name], rates[baseline], strict=True))

    return {
        n: _Measured(
            statistics.median(wall[n]), ratio(wall, n), statistics.median(cpu[n]), ratio(cpu, n), counts[n]
        )
        for n in names
    }


def _later_epochs(loader: fastio.StreamLoader, field: str) -> Callable[[], int]:
    """Runs of the next epochs of one loader (its first read before the rounds): what it keeps between
    epochs (decoded row groups within ``memory_limit``, packing's token files) is not made again."""
    epoch = [0]
    sum(b[field].numel() for b in loader)

    def run() -> int:
        epoch[0] += 1
        loader.set_epoch(epoch[0])
        return sum(len(b[field]) if field != "tokens" else b[field].numel() for b in loader)

    return run


def _hf_rate(
    stream: Any, batch_size: int, limit: int, consume: Callable[[Any], int], collate: Any = None
) -> tuple[float, float, int]:
    """(units/s after the first batch, seconds to the first batch, units) of a DataLoader over ``stream``;
    ``consume(batch)`` returns the units (rows, tokens) a batch adds, until ``limit``."""
    loader = torch.utils.data.DataLoader(stream, batch_size=batch_size, collate_fn=collate)
    start, first, count, after_first = time.perf_counter(), 0.0, 0, 0
    for batch in loader:
        count += consume(batch)
        if not first:
            first, after_first = time.perf_counter(), count
        if count >= limit:
            break
    return (count - after_first) / (time.perf_counter() - first), first - start, count


def _hf_stream(paths: Sequence[str], columns: list[str]) -> Any:
    import datasets

    stream = datasets.load_dataset("parquet", data_files=list(paths), split="train", streaming=True)
    return stream.select_columns(columns)


def _rows(paths: list[str], folder: Path, args: argparse.Namespace, total: int) -> list[Row]:
    batch = args.batch_size

    def arrow_only() -> int:
        return sum(b.num_rows for b in _iter_batches(paths, batch, NUMERIC))

    def with_tensors() -> int:
        return sum(len(_tensors(b)["label"]) for b in _iter_batches(paths, batch, NUMERIC))

    def fastio_run(workers: int, shuffle: bool) -> Callable[[], int]:
        def run() -> int:
            source = parquet_source(folder, columns=NUMERIC)
            loader = fastio.StreamLoader(
                source, batch_size=batch, num_workers=workers, shuffle=shuffle, seed=0
            )
            return sum(len(b["label"]) for b in loader)

        return run

    base = "pyarrow iter_batches + tensors"
    runs = {base: with_tensors, "pyarrow iter_batches (Arrow only)": arrow_only}
    runs.update({f"fastio num_workers={w}": fastio_run(w, False) for w in args.workers})
    runs[f"fastio shuffle=True num_workers={max(args.workers)}"] = fastio_run(max(args.workers), True)
    runs["fastio num_workers=0, a later epoch (row groups kept decoded)"] = _later_epochs(
        fastio.StreamLoader(parquet_source(folder, columns=NUMERIC), batch_size=batch), "label"
    )
    arrow_only()  # the files into the page cache
    measured = _rounds(runs, base, args.repeats)
    rows = []
    for name, m in measured.items():
        assert m.count == total, (name, m.count, total)
        vs = None if name == base else base
        rows.append(
            Row("rows", name, "rows_per_s", m.rate, "rows/s", m.ratio if vs else None, vs, m.extra("rows"))
        )
        progress(f"{name}: {m.rate:,.0f} rows/s ({m.ratio:.2f}x; CPU time {m.cpu_ratio:.2f}x)")
    return rows + _hf_rows(paths, args, measured[base].rate)


def _hf_rows(paths: list[str], args: argparse.Namespace, base: float) -> list[Row]:
    try:
        import datasets
    except ImportError as exc:
        why = {"why": str(exc)}
        return [Row("rows", "datasets (not installed)", "rows_per_s", float("nan"), "rows/s", extra=why)]
    rows = []
    slow = max(args.hf_rows // 5, 8 * args.batch_size)  # with_format("torch"): a tensor per row and column
    for label, fmt, limit in (
        ("default format", None, args.hf_rows),
        ("with_format('torch')", "torch", slow),
    ):
        stream = _hf_stream(paths, NUMERIC)
        stream = stream.with_format(fmt) if fmt else stream
        rate, first_s, count = _hf_rate(stream, args.batch_size, limit, lambda b: len(b["label"]))
        name = f"datasets {datasets.__version__} streaming, {label}, DataLoader"
        extra = {"rows_timed": count, "first_batch_s": round(first_s, 2)}
        rows.append(
            Row(
                "rows",
                name,
                "rows_per_s",
                rate,
                "rows/s",
                rate / base,
                "iter_batches + tensors (median)",
                extra,
            )
        )
        progress(f"{name}: {rate:,.0f} rows/s after the first batch")
    return rows


def _tokens(paths: list[str], folder: Path, args: argparse.Namespace) -> list[Row]:
    seq_len = args.seq_len

    def baseline() -> int:
        packer = _Packer(seq_len)
        for b in _iter_batches(paths, 1024, ["input_ids"]):
            for _ in packer.add(b.column(0).flatten().to_numpy()):
                pass
        return packer.tokens

    pack = fastio.Pack("input_ids", seq_len=seq_len, document_ids=False)

    def fastio_run(workers: int, cache: Path | None) -> Callable[[], int]:
        """A fresh loader; ``cache``: its $FASTIO_CACHE (None: an empty one per run, the column decoded)."""

        def run() -> int:
            os.environ["FASTIO_CACHE"] = str(cache or tempfile.mkdtemp(dir=folder.parent))
            source = parquet_source(folder, columns=["input_ids"])
            loader = fastio.StreamLoader(source, batch_size=PACK_BATCH, num_workers=workers, pack=pack)
            return sum(b["tokens"].numel() for b in loader)

        return run

    base = "pyarrow iter_batches + minimal packer"
    runs = {base: baseline, **{f"fastio pack= num_workers={w}": fastio_run(w, None) for w in (0, 1, 2)}}
    kept = folder.parent / "kept-cache"
    fastio_run(0, kept)()  # the token files, kept for the next loaders
    runs["fastio pack= num_workers=0, a new loader (token files kept by an earlier one)"] = fastio_run(
        0, kept
    )
    later = fastio.StreamLoader(
        parquet_source(folder, columns=["input_ids"]), batch_size=PACK_BATCH, pack=pack
    )
    runs["fastio pack= num_workers=0, a later epoch"] = _later_epochs(later, "tokens")
    measured = _rounds(runs, base, args.repeats)
    rows = []
    for name, m in measured.items():
        vs = None if name == base else base
        extra = {"tokens": m.count, **m.extra("tokens")}
        rows.append(
            Row("packed tokens", name, "tokens_per_s", m.rate, "tokens/s", m.ratio if vs else None, vs, extra)
        )
        progress(f"{name}: {m.rate:,.0f} tokens/s ({m.ratio:.2f}x; CPU time {m.cpu_ratio:.2f}x)")
    try:
        import datasets
    except ImportError:
        return rows
    packer = _Packer(seq_len)

    def consume(samples: list[dict[str, Any]]) -> int:
        before = packer.tokens
        for _ in packer.add(np.concatenate([np.asarray(s["input_ids"], np.int32) for s in samples])):
            pass
        return packer.tokens - before

    limit = args.hf_rows * args.tokens
    stream = _hf_stream(paths, ["input_ids"])
    rate, first_s, _ = _hf_rate(stream, 64, limit, consume, collate=lambda samples: samples)
    name = f"datasets {datasets.__version__} streaming + minimal packer, DataLoader"
    extra = {"first_batch_s": round(first_s, 2)}
    rows.append(
        Row("packed tokens", name, "tokens_per_s", rate, "tokens/s", rate / measured[base].rate, base, extra)
    )
    return rows


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark, write ``bench_parquet.*`` to ``harness.output_dir()``; the table.

    Example::

        print(main(["--rows", "20000", "--repeats", "1"]))
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4, help="Parquet files (default 4)")
    parser.add_argument("--rows", type=int, default=50_000, help="rows per file (default 50,000)")
    parser.add_argument("--row-group", type=int, default=10_000, help="rows per row group (default 10,000)")
    parser.add_argument("--tokens", type=int, default=128, help="mean tokens per row (default 128)")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per batch (default 256)")
    parser.add_argument("--seq-len", type=int, default=2048, help="packed row length (default 2048)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4], help="fastio num_workers")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration, median (default 3)")
    parser.add_argument(
        "--hf-rows", type=int, default=20_000, help="rows datasets is timed on (default 20,000)"
    )
    parser.add_argument("--full", action="store_true", help="8x the rows per file")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.full:
        args.rows *= 8
    load_at_start = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="bench_parquet-"))
    try:
        folder = root / "data"
        paths = _write(folder, args.files, args.rows, args.row_group, args.tokens)
        size_mb = sum(Path(p).stat().st_size for p in paths) / 1e6
        progress(f"wrote {args.files} files, {size_mb:.0f} MB")
        rows = _rows(paths, folder, args, args.files * args.rows) + _tokens(paths, folder, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    notes = _notes(rows, args, size_mb, load_at_start)
    table = write_results("bench_parquet", rows, notes=notes, plot_metric="rows_per_s")
    print(table)
    return table


def _notes(rows: list[Row], args: argparse.Namespace, size_mb: float, load_at_start: float) -> list[str]:
    def row(prefix: str) -> Row:
        return next(r for r in rows if r.backend.startswith(prefix))

    fastio_rows = [r for r in rows if r.backend.startswith("fastio num_workers") and "later" not in r.backend]
    scaling = ", ".join(
        f"{r.backend.split('=')[1]}: {r.ratio:.2f}x (CPU time {r.extra['cpu_ratio']:.2f}x)"
        for r in fastio_rows
    )
    hf = [
        r
        for r in rows
        if r.backend.startswith("datasets") and r.metric == "rows_per_s" and r.value == r.value
    ]
    packed = [r for r in rows if r.backend.startswith("fastio pack=")]
    packed_first = [r for r in packed if "later" not in r.backend and "kept" not in r.backend]
    kept = [r for r in packed if "kept by" in r.backend]
    later = [r for r in rows if "later" in r.backend]
    notes = [
        f"rows/s, fastio against iter_batches + tensors by num_workers (bar >= 0.9x with 1 worker, scaling "
        f"with workers): {scaling}; packed tokens/s: "
        + ", ".join(f"{r.backend.split('=', 1)[1]}: {r.ratio:.2f}x" for r in packed_first)
        + f" (CPU time {packed_first[0].extra['cpu_ratio']:.2f}x; first epochs, fresh loaders: the one-time "
        "decode of the column into memory included, and the kept token files that a background thread writes "
        "meanwhile for the next loader, waited for at the pass's end); "
        + "".join(
            f"a new loader over kept token files {r.ratio:.2f}x (CPU {r.extra['cpu_ratio']:.2f}x); "
            for r in kept
        )
        + "later epochs of one loader: "
        + ", ".join(f"{r.case} {r.ratio:.2f}x (CPU {r.extra['cpu_ratio']:.2f}x)" for r in later),
    ]
    if hf:
        best, hf_best = max(r.value for r in fastio_rows), max(hf, key=lambda r: r.value)
        notes.append(
            "against datasets streaming in a DataLoader (bar >= 3x): best fastio "
            f"{best / hf_best.value:.0f}x its best ({hf_best.backend}; timed after its first batch, its "
            "start not counted)"
        )
    else:
        notes.append(f"datasets: {row('datasets').extra.get('why', 'not measured')}")
    return [
        *notes,
        f"{args.files} files x {args.rows:,} rows ({size_mb:.0f} MB, snappy), row groups of "
        f"{args.row_group:,}; "
        f"batches of {args.batch_size}; {args.repeats} rounds of every contender (order rotated), medians of "
        "rates and of per-round ratios; each fastio run a fresh loader (decoding included)",
        f"pyarrow {pa.__version__}, torch {torch.__version__}; load average (1 min) {load_at_start:.1f} at "
        f"the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs: on a machine shared that "
        "much, wall-time rates drift with the load and the CPU-time ratios (this process's threads) are the "
        "steadier comparison",
    ]


if __name__ == "__main__":
    main()
