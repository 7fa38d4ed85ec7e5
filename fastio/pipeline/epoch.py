"""One epoch pass of :class:`fastio.StreamLoader`: the source prepared for the pass's reads, a
:class:`fastio.assembly.producer.BatchProducer` run by worker threads, worker processes or the consumer,
batches handed over in order (waiting on their copy to the device), and the progress bar.

Example::

    epoch = EpochPass(source, indices, epoch=0, start=0, seed=0, drop_last=False, world_size=1,
                      workers=WorkerSettings(num_workers=2), assembly=AssemblySettings(batch_size=8))
    for batch in epoch:
        ...
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fastio._native import default_threads
from fastio.assembly.producer import BatchProducer
from fastio.assembly.structure import map_tensors
from fastio.pipeline.order import num_batches
from fastio.pipeline.settings import AssemblySettings, WorkerSettings
from fastio.pipeline.spawn import SpawnedProducer
from fastio.sources import ReadPlan, Source, shard_read_order
from fastio.workers.batch_pass import BatchPass
from fastio.workers.info import PassInfo
from fastio.workers.kept import KeptWorkers
from fastio.workers.processes import ProcessPipeline
from fastio.workers.threads import ThreadPipeline

__all__ = ["EpochPass"]


class EpochPass(BatchPass):
    """One pass over (the rest of) an epoch for this rank: ``indices`` are the samples it reads, from sample
    ``start`` of the epoch's rank-split order on; what ``iter(StreamLoader)`` returns. With ``bounds`` (a
    sampler's batches) batch ``j`` is ``indices[bounds[j]:bounds[j + 1]]``. ``skip``: numbers of the pass's
    batches handed over before (out of order, ``in_order=False``), left out. With ``kept`` (persistent
    workers) the workers of the last pass make this one's batches too, and are left running at its end."""

    def __init__(
        self,
        source: Source,
        indices: np.ndarray,
        epoch: int,
        start: int,
        *,
        seed: int,
        drop_last: bool,
        world_size: int,
        workers: WorkerSettings,
        assembly: AssemblySettings,
        progress: bool = False,
        bounds: np.ndarray | None = None,
        kept: KeptWorkers | None = None,
        skip: Sequence[int] = (),
    ) -> None:
        device = assembly.device
        self.source, self.epoch, self.start, self.device = source, epoch, start, device
        self.in_order = workers.in_order
        total = (
            num_batches(len(indices), assembly.batch_size, drop_last) if bounds is None else len(bounds) - 1
        )
        numbers = [j for j in range(total) if j not in set(skip)]
        if skip:
            indices, bounds = _without(indices, bounds, numbers, assembly.batch_size)
        self.begin_pass(len(numbers), numbers)
        n, slots, processes = workers.num_workers, workers.slots, workers.processes
        source.plan_reads(ReadPlan(assembly.batch_size, slots, processes, world_size > 1))
        # Before any fetch and before worker processes fork: they inherit what prepare() set up.
        source.prepare(shard_read_order(source.shard_sizes, indices), epoch, indices)
        mode = "process" if processes else "thread" if n else "main"
        producer_args = dict(
            epoch=epoch, indices=indices, seed=seed, slots=1 if processes else slots,
            threads=workers.threads or max(1, default_threads() // max(1, n)), mode=mode, num_workers=n,
            worker_init_fn=workers.init_fn, bounds=bounds,
        )  # fmt: skip
        self.producer = BatchProducer(source, assembly, **producer_args)
        self.copy_in_consumer = processes and device is not None and device.type == "cuda"
        self.times = self.producer.times
        self.pipeline: ThreadPipeline | ProcessPipeline | None = None
        self.kept = kept if n else None
        if self.kept is not None:
            update = (epoch, indices, bounds) if processes else (self.producer, PassInfo(n, seed, epoch))
            self.pipeline = self.kept.take(update, self.n_batches, self.times)
        if processes and self.pipeline is None:
            spawned = workers.start_method != "fork"
            self.pipeline = ProcessPipeline(
                self.producer, self.n_batches, n, slots, self.times, self.producer.start_worker,
                assembly.reuse_buffers, workers.timeout, start_method=workers.start_method,
                factory=SpawnedProducer(workers.opener, source, assembly, producer_args) if spawned else None,
            )  # fmt: skip
        elif n and self.pipeline is None:
            self.pipeline = ThreadPipeline(
                self.producer, self.n_batches, n, slots, self.producer.start_worker, workers.timeout,
                persistent=self.kept is not None,
            )  # fmt: skip
        if self.kept is not None and self.kept.pipeline is None:
            self.kept.keep(self.pipeline)
        self.bar = None
        if progress:
            try:
                from tqdm import tqdm
            except ImportError as exc:
                raise ImportError(
                    'StreamLoader(progress=True) needs tqdm: pip install "fastcomm[progress]" (or tqdm)'
                ) from exc

            self.bar = tqdm(total=self.n_batches, desc=f"epoch {epoch}", unit="batch")

    # -- consuming -----------------------------------------------------------------------------------------
    def __next__(self) -> Any:
        batch, size = self.take()
        if self.copy_in_consumer:
            start = time.perf_counter()
            batch = map_tensors(batch, lambda t: t.to(self.device))
            self.times.add("host_to_device", time.perf_counter() - start)
        elif self.producer.stream is not None:
            batch, event = batch
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            map_tensors(batch, lambda t: (t.record_stream(current), t)[1])
        self.count(size)
        if self.bar is not None:
            self.bar.update(1)
            if self.yielded % _PROGRESS_EVERY == 1:
                note = _source_note(self.source.stats())
                if note:
                    self.bar.set_postfix_str(note, refresh=False)
        return batch

    def close(self) -> None:
        finished = self.finished
        super().close()
        if not finished and self.bar is not None:
            self.bar.close()


def _without(
    indices: np.ndarray, bounds: np.ndarray | None, numbers: list[int], batch_size: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """``indices`` (and ``bounds``) of only the batches ``numbers``: batch ``j`` is ``indices[j * batch_size:
    (j + 1) * batch_size]``, or ``indices[bounds[j]:bounds[j + 1]]``. Every batch but the last is full, so
    the batches kept stay runs of ``batch_size`` where no ``bounds`` were given."""
    edges = bounds if bounds is not None else np.arange(0, len(indices) + batch_size, batch_size)
    edges = np.minimum(edges, len(indices))
    parts = [indices[edges[j] : edges[j + 1]] for j in numbers]
    kept = np.concatenate([*parts, indices[:0]]).astype(np.int64)
    if bounds is None:
        return kept, None
    return kept, np.concatenate([[0], np.cumsum([len(p) for p in parts], dtype=np.int64)]).astype(np.int64)


_PROGRESS_EVERY = 10  # batches between updates of the source's part of the progress bar


def _source_note(stats: dict[str, Any]) -> str:
    """The progress bar's note on a source's counters: bytes downloaded and cache use, where it has them."""
    parts = []
    if "downloaded_bytes" in stats:
        parts.append(f"{stats['downloaded_bytes'] / 1e6:.0f} MB down")
    if "cache_bytes" in stats:
        limit = stats.get("cache_limit")
        parts.append(
            f"cache {stats['cache_bytes'] / 1e6:.0f}/{'-' if limit is None else f'{limit / 1e6:.0f}'} MB"
        )
    if "network_wait_s" in stats:
        parts.append(f"net wait {stats['network_wait_s']:.1f} s")
    return ", ".join(parts)
