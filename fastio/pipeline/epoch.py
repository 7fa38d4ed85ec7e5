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
from typing import Any

import numpy as np
import torch

from fastio._native import default_threads
from fastio.assembly.producer import BatchProducer
from fastio.assembly.structure import map_tensors
from fastio.pipeline.order import num_batches
from fastio.pipeline.settings import AssemblySettings, WorkerSettings
from fastio.sources import ReadPlan, Source, shard_read_order
from fastio.workers.batch_pass import BatchPass
from fastio.workers.processes import KeptProcesses, ProcessPipeline
from fastio.workers.threads import ThreadPipeline

__all__ = ["EpochPass"]


class EpochPass(BatchPass):
    """One pass over (the rest of) an epoch for this rank: ``indices`` are the samples it reads, from sample
    ``start`` of the epoch's rank-split order on; what ``iter(StreamLoader)`` returns. With ``bounds`` (a
    sampler's batches) batch ``j`` is ``indices[bounds[j]:bounds[j + 1]]``. With ``kept`` (persistent workers)
    the worker processes of the last pass make this one's batches too, and are left running at its end."""

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
        kept: KeptProcesses | None = None,
    ) -> None:
        device = assembly.device
        self.source, self.epoch, self.start, self.device = source, epoch, start, device
        if bounds is None:
            self.begin_pass(num_batches(len(indices), assembly.batch_size, drop_last))
        else:
            self.begin_pass(len(bounds) - 1)
        n, slots, processes = workers.num_workers, workers.slots, workers.processes
        source.plan_reads(ReadPlan(assembly.batch_size, slots, processes, world_size > 1))
        # Before any fetch and before worker processes fork: they inherit what prepare() set up.
        source.prepare(shard_read_order(source.shard_sizes, indices), epoch, indices)
        self.producer = BatchProducer(
            source,
            assembly,
            epoch=epoch,
            indices=indices,
            seed=seed,
            slots=1 if processes else slots,
            threads=workers.threads or max(1, default_threads() // max(1, n)),
            mode="process" if processes else "thread" if n else "main",
            num_workers=n,
            worker_init_fn=workers.init_fn,
            bounds=bounds,
        )
        self.copy_in_consumer = processes and device is not None and device.type == "cuda"
        self.times = self.producer.times
        self.pipeline: ThreadPipeline | ProcessPipeline | None = None
        start_worker = self.producer.start_worker
        self.kept = kept if processes else None
        if self.kept is not None:
            self.pipeline = self.kept.take((epoch, indices, bounds), self.n_batches, self.times)
        if processes and self.pipeline is None:
            self.pipeline = ProcessPipeline(
                self.producer,
                self.n_batches,
                n,
                slots,
                self.times,
                start_worker,
                assembly.reuse_buffers,
                workers.timeout,
            )
            if self.kept is not None:
                self.kept.keep(self.pipeline)
        elif n and not processes:
            self.pipeline = ThreadPipeline(
                self.producer, self.n_batches, n, slots, start_worker, workers.timeout
            )
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
        if self.kept is not None and self.pipeline is self.kept.pipeline:
            self.pipeline = None  # its processes serve the next pass (persistent_workers=True)
        super().close()
        if not finished and self.bar is not None:
            self.bar.close()


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
