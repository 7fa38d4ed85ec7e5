"""bench_loader's cases but packing: ``fixed`` (with the peers of :mod:`benchmarks.peers`), ``variable``,
``tar`` and ``mixing``; each returns its rows and adds its notes (see :mod:`benchmarks.bench_loader`).

Example::

    rows = bench_fixed(write_fixed(root, 200_000), args, notes)
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import peers
from benchmarks.bench_loader_data import (
    IMAGE_BYTES,
    IMAGE_SHAPE,
    MemmapImages,
    MemmapTokens,
    memmap_views,
    write_fixed,
)
from benchmarks.bench_loader_timing import (
    dataloader_rate,
    memmap_gather_rate,
    rate_row,
    rss_text,
    stream_epochs,
    timed_rate,
    webloader_rate,
)
from benchmarks.harness import Row

__all__ = [
    "IN_TURNS",
    "MIX_WEIGHTS",
    "PEER_LOADERS",
    "PEER_ROUNDS",
    "bench_fixed",
    "bench_mixing",
    "bench_tar",
    "bench_variable",
    "peer_notes",
    "peer_rows",
]

MIX_WEIGHTS = (0.5, 0.3, 0.2)


def bench_fixed(fixed_dir: Path, args: argparse.Namespace, notes: list[str]) -> list[Row]:
    x, y, n = memmap_views(fixed_dir)
    sample_bytes = IMAGE_BYTES + 8
    limit = memmap_gather_rate(x, args.batch, n)
    rows = [rate_row("fixed", "numpy memmap gather (limit)", limit, sample_bytes)]
    dl = {
        w: dataloader_rate(MemmapImages(x, y), args.batch, w, min(args.dataloader_samples, n)) for w in (0, 2)
    }
    best_w = max(dl, key=dl.get)
    for w, rate in dl.items():
        rows.append(rate_row("fixed", f"DataLoader workers={w}", rate, sample_bytes, ("memmap", limit)))
    best = (f"DataLoader w={best_w}", dl[best_w])
    rows += peer_rows(x, y, fixed_dir, args, limit)
    del x, y  # unmap the baselines' view, so the resident memory below is StreamLoader's alone
    gc.collect()
    for shuffle in ("shard", "full"):
        for workers in (0, 2):
            rate, rss, first = stream_epochs(
                str(fixed_dir), args.batch, args.epochs, shuffle=shuffle, num_workers=workers
            )
            label = f"StreamLoader shuffle={shuffle} workers={workers}"
            rows.append(
                rate_row(
                    "fixed",
                    label,
                    rate,
                    sample_bytes,
                    best,
                    vs_limit=f"{rate / limit:.2f}",
                    rss_anon_file_mb_per_epoch=rss_text(rss),
                )
            )
            notes.append(
                f"{label}: first (warm-up) epoch {first['samples_per_s']:,.0f} samples/s incl. lazy crc32 "
                f"of the shard; wait share {first['wait_share']:.0%}"
            )
    notes.append(
        "rss_anon_file_mb_per_epoch: the benchmark process's RssAnon+RssFile (MB) after each measured "
        "epoch; RssFile is the shared page cache of the mmap (bounded by the data size), RssAnon is what "
        "copying would grow"
    )
    return rows


PEER_LOADERS = {
    "torchdata.nodes ParallelMapper threads=2": ("torchdata.nodes", peers.torchdata_nodes_batches, False),
    "torchdata.nodes batch gather threads=2": ("torchdata.nodes", peers.torchdata_nodes_batches, True),
    "SPDL pipeline threads=2": ("spdl.pipeline", peers.spdl_batches, False),
    "SPDL batch gather threads=2": ("spdl.pipeline", peers.spdl_batches, True),
}


PEER_ROUNDS = 3
IN_TURNS = "StreamLoader shuffle=full workers=0, in turns with the peers"


def peer_rows(
    x: np.memmap, y: np.ndarray, fixed_dir: Path | None, args: argparse.Namespace, limit: float
) -> list[Row]:
    """The peers of :mod:`benchmarks.peers` over the same memmap (2 threads, random order) and, given
    ``fixed_dir``, ``StreamLoader`` over its shard, taking turns for :data:`PEER_ROUNDS` rounds of
    ``args.peer_seconds`` (or an epoch) each, best round kept: a load that comes and goes hits all of them
    alike, and a time rather than a sample count gives the fast and the slow the same window. StreamLoader
    runs in this process like the peers' threads (its native gather has its own), one loader after a
    warm-up epoch (its lazy checksums), a new epoch each round. A peer that cannot run here gets a row
    without a value whose ``status`` says why."""

    def gather(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(np.take(x, indices, axis=0)), torch.from_numpy(y[indices])

    stream: Any = None
    if fixed_dir is not None:
        import fastio

        stream = fastio.StreamLoader(str(fixed_dir), batch_size=args.batch, seed=0, shuffle="full")
        for _ in stream:  # the warm-up epoch
            pass

    dataset, rows, makers = MemmapImages(x, y), [], {}
    for label, (peer, batches, per_batch) in PEER_LOADERS.items():
        reason = peers.unavailable(peer)
        if reason is None:
            makers[label] = functools.partial(
                batches, dataset, args.batch, 2, 0, gather if per_batch else None
            )
        else:
            rows.append(Row("fixed", label, "samples/s", float("nan"), "samples/s", extra={"status": reason}))
    if stream is not None:
        makers[IN_TURNS] = lambda: stream

    def count(batch: Any) -> int:
        return len(batch["y"]) if isinstance(batch, dict) else len(batch[1])

    best = dict.fromkeys(makers, 0.0)
    for epoch in range(1, PEER_ROUNDS + 1):
        if stream is not None:
            stream.set_epoch(epoch)
        for label, make in makers.items():
            best[label] = max(best[label], timed_rate(make(), count, len(y), args.peer_seconds))
    for label, rate in best.items():
        rows.append(rate_row("fixed", label, rate, IMAGE_BYTES + 8, ("memmap", limit), status="ok"))
    return rows


def peer_notes(rows: list[Row]) -> list[str]:
    """The peers' versions, and StreamLoader's rate in turns with the peers over each peer's rate."""
    ours = {r.backend: r.value for r in rows if r.case == "fixed"}.get(IN_TURNS)
    installed = ", ".join(f"{k} {v}" for k, v in peers.versions().items())
    notes = [
        f"peers: {installed}, installed with --no-deps beside torch {torch.__version__}; each on 2 threads "
        f"and `{IN_TURNS}` take turns for {PEER_ROUNDS} rounds, best round kept"
    ]
    for row in rows:
        if row.case == "fixed" and row.backend in PEER_LOADERS:
            if row.value != row.value:
                notes.append(f"fixed: {row.backend}: no value ({row.extra['status']})")
            elif ours is not None:
                notes.append(
                    f"fixed: StreamLoader / {row.backend} = {ours / row.value:.2f}x (in turns, same run)"
                )
    return notes


def bench_variable(var_dir: Path, args: argparse.Namespace) -> list[Row]:
    from fastio.format.shards.reader import ShardSet

    reader = ShardSet(var_dir).readers[0]
    offsets, base = reader.variable_layout("tokens")
    payload = reader.file.array[base : base + int(offsets[-1])].view(np.int32)
    n = reader.num_samples
    sample_bytes = float(offsets[-1]) / n + 8
    rng = np.random.default_rng(0)
    order = rng.permutation(n).tolist()
    bounds = (offsets // 4).tolist()
    start = time.perf_counter()
    done = 0
    for b in range(0, n - args.batch + 1, args.batch):
        _ = [payload[bounds[i] : bounds[i + 1]].copy() for i in order[b : b + args.batch]]
        done += args.batch
    limit = done / (time.perf_counter() - start)
    rows = [rate_row("variable", "numpy memmap slices (limit)", limit, sample_bytes)]
    dl = {
        w: dataloader_rate(
            MemmapTokens(payload, offsets), args.batch, w, min(args.dataloader_samples, n), collate=list
        )
        for w in (0, 2)
    }
    best_w = max(dl, key=dl.get)
    for w, rate in dl.items():
        rows.append(rate_row("variable", f"DataLoader workers={w}", rate, sample_bytes, ("memmap", limit)))
    del reader, payload, offsets  # unmap the baselines' view (see bench_fixed)
    gc.collect()
    for workers in (0, 2):
        rate, rss, _ = stream_epochs(str(var_dir), args.batch, args.epochs, num_workers=workers)
        rows.append(
            rate_row(
                "variable",
                f"StreamLoader workers={workers}",
                rate,
                sample_bytes,
                (f"DataLoader w={best_w}", dl[best_w]),
                vs_limit=f"{rate / limit:.2f}",
                rss_anon_file_mb_per_epoch=rss_text(rss),
            )
        )
    return rows


def bench_tar(pattern: str, args: argparse.Namespace, notes: list[str]) -> list[Row]:
    import fastio
    from fastio.files.paths import expand_pattern

    sample_bytes = IMAGE_BYTES + 8
    wl = {w: webloader_rate(pattern, args.batch, w, args.webloader_samples) for w in (0, 2)}
    best_w = max(wl, key=wl.get)
    rows = [
        rate_row("tar", f"webdataset.WebLoader workers={w}", rate, sample_bytes) for w, rate in wl.items()
    ]
    start = time.perf_counter()
    for path in expand_pattern(pattern):
        fastio.index_tar(path)
    notes.append(
        f"tar: fastio.index_tar of every shard took {time.perf_counter() - start:.2f} s (once; sidecar .fidx)"
    )
    for workers in (0, 2):
        rate, rss, _ = stream_epochs(pattern, args.batch, args.epochs, num_workers=workers)
        rows.append(
            rate_row(
                "tar",
                f"StreamLoader (tar) workers={workers}",
                rate,
                sample_bytes,
                (f"WebLoader w={best_w}", wl[best_w]),
                rss_anon_file_mb_per_epoch=rss_text(rss),
            )
        )
    return rows


def bench_mixing(root: Path, args: argparse.Namespace, notes: list[str]) -> list[Row]:
    """Three weighted streams against one stream of the same total size, timed in alternation."""
    import fastio

    n = args.mix_samples
    t0 = time.perf_counter()
    one = str(write_fixed(root, n, "mix-one", seed=1))
    thirds = [n // 3 + (k < n % 3) for k in range(3)]
    parts = [str(write_fixed(root, size, f"mix-{k}", seed=2 + k)) for k, size in enumerate(thirds)]
    notes.append(
        f"mixing: one stream of {n:,} samples vs streams of {thirds} at weights {MIX_WEIGHTS} "
        f"(epoch_size {n:,}), {IMAGE_SHAPE} uint8 + int64 label, written in {time.perf_counter() - t0:.0f} s"
    )
    sample_bytes = IMAGE_BYTES + 8
    rows = []
    for workers in (0, 2):
        kwargs = {"batch_size": args.batch, "shuffle": True, "seed": 0, "num_workers": workers}
        loaders = {
            "one": fastio.StreamLoader(one, **kwargs),
            "mixed": fastio.StreamLoader(
                [fastio.Stream(p, w) for p, w in zip(parts, MIX_WEIGHTS, strict=True)], **kwargs
            ),
        }
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        cpu: dict[str, list[float]] = {name: [] for name in loaders}
        for epoch in range(args.mix_epochs + 1):  # epoch 0 warms the page cache and the lazy checksums
            for name in sorted(loaders, reverse=bool(epoch % 2)):
                loader = loaders[name]
                loader.set_epoch(epoch)
                started = time.process_time()
                for _ in loader:
                    pass
                if epoch:
                    rates[name].append(loader.stats()["samples_per_s"])
                    cpu[name].append(time.process_time() - started)
        base = float(np.median(rates["one"]))
        ratio = float(np.median(np.array(rates["mixed"]) / np.array(rates["one"])))
        cpu_ratio = float(np.median(np.array(cpu["one"]) / np.array(cpu["mixed"])))
        rows.append(rate_row("mixing", f"one stream workers={workers}", base, sample_bytes))
        mixed = rate_row(
            "mixing",
            f"3 streams {'/'.join(map(str, MIX_WEIGHTS))} workers={workers}",
            float(np.median(rates["mixed"])),
            sample_bytes,
            cpu_ratio=f"{cpu_ratio:.3f}",
            epochs=" / ".join(f"{r:,.0f}" for r in rates["mixed"]),
            one_stream_epochs=" / ".join(f"{r:,.0f}" for r in rates["one"]),
        )
        mixed.ratio, mixed.ratio_to = ratio, f"one stream workers={workers} (median of per-epoch ratios)"
        rows.append(mixed)
    return rows
