"""How one batch of an epoch pass is made, wherever it runs (the consumer's thread, a worker thread, a
worker process): the source's gather into reused buffers, batch stages, the Python path (``transform``
per sample, then ``collate``), the copy to the device, and the seeding of user code around them.

Example::

    producer = BatchProducer(source, AssemblySettings(batch_size=8), epoch=0, indices=order, seed=0, slots=1,
                             threads=2, mode="main", num_workers=0, worker_init_fn=None)
    batch, size = producer(0)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastio.assembly.collate import collate_samples
from fastio.assembly.seeding import (
    STREAM_COLLATE,
    STREAM_FETCH,
    STREAM_TRANSFORM,
    STREAM_WORKER,
    global_rngs_kept,
    sample_seeds,
    seed_global_rngs,
)
from fastio.assembly.stages import StageContext
from fastio.assembly.structure import map_tensors
from fastio.pipeline.settings import AssemblySettings
from fastio.sources import BatchBuffers, BufferPool, Source, StageTimes
from fastio.workers.info import WorkerInfo, set_worker_info, worker_info

__all__ = ["BatchProducer"]


def _split_batch(batch: dict[str, Any], size: int) -> list[dict[str, Any]]:
    return [{k: v[i] for k, v in batch.items()} for i in range(size)]


class BatchProducer:
    """Makes batch ``job`` of one epoch pass; called by worker threads, worker processes or the consumer.

    ``mode`` says where it runs: ``"main"`` (the consumer's thread, ``num_workers=0``), ``"thread"`` or
    ``"process"``. Randomness of the user's Python code (see :mod:`fastio.assembly.seeding`):

    1. Before each sample's ``transform``, torch's default CPU generator, ``random`` and ``numpy.random`` are
       seeded from ``sample_seeds(seed, epoch, sample index, STREAM_TRANSFORM)``; before a Dataset's
       ``__getitem__``s and before ``collate``, from one seed per batch (its first sample's,
       ``STREAM_FETCH`` / ``STREAM_COLLATE``). The same sample draws the same numbers for any
       ``num_workers`` and on resume.
    2. ``"main"``: the consumer's own global states are put back after each batch, so its training
       randomness (dropout, its own shuffles) is what it would be without the loader.
    3. ``"thread"``: the global generators are shared with the training thread, so they are not reseeded
       (reseeding them would change the trainer's draws, and its draws would change the transforms');
       transforms that must reproduce seed their own generator from ``fastio.worker_info().sample_seed``.

    ``bounds`` (a batch sampler's batches, :mod:`fastio.pipeline.sampled`): batch ``j`` is
    ``indices[bounds[j]:bounds[j + 1]]`` instead of the ``j``-th run of ``batch_size``.

    Holds no reference to the iterator, so an abandoned iterator is collected and stops its workers."""

    def __init__(
        self,
        source: Source,
        assembly: AssemblySettings,
        *,
        epoch: int,
        indices: np.ndarray,
        seed: int,
        slots: int,
        threads: int,
        mode: str,
        num_workers: int,
        worker_init_fn: Callable[[int], None] | None,
        bounds: np.ndarray | None = None,
    ):
        # In forked worker processes CUDA is off limits (no pinned buffers, no copies): the consumer copies.
        cuda_allowed = mode != "process"
        self.mode, self.num_workers = mode, num_workers
        self.source, self.batch_size = source, assembly.batch_size
        self.pin = assembly.pin and cuda_allowed
        self.transform, self.collate = assembly.transform, assembly.collate
        self.python_path = assembly.python_path
        self.worker_init_fn = worker_init_fn
        self.indices, self.threads, self.bounds = indices, threads, bounds
        self.seed, self.epoch, self.stages = seed, epoch, assembly.stages
        self.times = StageTimes()
        self.specs = self.source.fixed_specs()
        self.stage_specs = [stage.output_specs() for stage in self.stages]
        for specs in self.stage_specs:
            self.specs.update(specs)
        # The slots in flight, the batch the consumer holds while asking for the next, and one spare.
        keep = slots + 2 if assembly.reuse_buffers else 0
        self.pool = BufferPool(self.specs, self.batch_size, self.pin, keep)
        device = assembly.device
        cuda = device is not None and device.type == "cuda"
        self.device = device if cuda and cuda_allowed else None
        self.stream = torch.cuda.Stream(self.device) if self.device is not None else None

    def start_worker(self, worker_id: int) -> None:
        """First thing in each worker thread or process: what ``fastio.worker_info()`` (and, in processes,
        ``torch.utils.data.get_worker_info()``) answer there."""
        set_worker_info(WorkerInfo(worker_id, self.num_workers, self.seed, self.epoch))
        if self.mode == "process":
            seed = int(sample_seeds(self.seed, self.epoch, np.array([worker_id]), STREAM_WORKER)[0])
            dataset = getattr(self.source, "dataset", self.source)
            torch.utils.data._utils.worker._worker_info = torch.utils.data._utils.worker.WorkerInfo(
                id=worker_id, num_workers=self.num_workers, seed=seed, dataset=dataset
            )
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)

    def retarget(self, update: tuple[int, np.ndarray, np.ndarray | None]) -> None:
        """Make the batches of another pass, ``update = (epoch, indices, bounds)``: what a kept worker process
        (``persistent_workers=True``) does between epochs."""
        self.epoch, self.indices, self.bounds = update
        info = worker_info()
        if info is not None:
            set_worker_info(WorkerInfo(info.id, info.num_workers, self.seed, self.epoch))

    def __call__(self, job: int) -> tuple[Any, int]:
        if self.mode != "main" or not self.python_path:  # no user code runs in the consumer's thread
            return self._make(job)
        previous = set_worker_info(WorkerInfo(0, 0, self.seed, self.epoch))
        try:
            with global_rngs_kept():
                return self._make(job)
        finally:
            set_worker_info(previous)

    def _make(self, job: int) -> tuple[Any, int]:
        if self.bounds is None:
            indices = self.indices[job * self.batch_size : (job + 1) * self.batch_size]
        else:  # a sampler's batches: batch ``job`` is ``indices[bounds[job]:bounds[job + 1]]``
            indices = self.indices[self.bounds[job] : self.bounds[job + 1]]
        buffers = self.pool.acquire()
        try:
            if buffers.event is not None:
                buffers.event.synchronize()  # the set's last copy to the device must finish first
            self._reseed(indices, STREAM_FETCH)
            batch = self.source.fetch(indices, buffers, self.threads, self.times)
            if self.stages:
                batch = self._run_stages(batch, indices, buffers)
            if self.python_path:
                start = time.perf_counter()
                samples = batch if self.source.per_sample else _split_batch(batch, len(indices))
                if self.transform is not None:
                    samples = self._transform(samples, indices)
                collated = time.perf_counter()
                self.times.add("decode_transform", collated - start)
                self._reseed(indices, STREAM_COLLATE)
                batch = (self.collate or collate_samples)(samples)
                self.times.add("collate", time.perf_counter() - collated)
            if self.stream is not None:
                batch = self._to_device(batch, buffers)
            return batch, len(indices)
        finally:
            self.pool.release(buffers)

    def _reseed(self, indices: np.ndarray, stream: int) -> None:
        """One seed per batch (from its first sample) for user code outside ``transform``."""
        if self.python_path and self.mode != "thread" and len(indices):
            seed_global_rngs(int(sample_seeds(self.seed, self.epoch, indices[:1], stream)[0]))

    def _transform(self, samples: list[Any], indices: np.ndarray) -> list[Any]:
        seeds = sample_seeds(self.seed, self.epoch, indices, STREAM_TRANSFORM).tolist()
        info = worker_info()
        out = []
        try:
            for sample, seed in zip(samples, seeds, strict=True):
                set_worker_info(WorkerInfo(info.id, info.num_workers, info.seed, info.epoch, seed))
                if self.mode != "thread":
                    seed_global_rngs(seed)
                out.append(self.transform(sample))
        finally:
            set_worker_info(info)
        return out

    def _run_stages(self, batch: Any, indices: np.ndarray, buffers: BatchBuffers) -> Any:
        start = time.perf_counter()
        ctx = StageContext(self.seed, self.epoch, indices, self.threads)
        for stage, specs in zip(self.stages, self.stage_specs, strict=True):
            out = {name: buffers.fixed(name, len(indices)) for name in specs}
            batch = stage(batch, out, ctx)
        self.times.add("decode_transform", time.perf_counter() - start)
        return batch

    def _to_device(self, batch: Any, buffers: BatchBuffers) -> tuple[Any, Any]:
        start = time.perf_counter()
        with torch.cuda.stream(self.stream):
            moved = map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self.stream)
        buffers.event = event
        self.times.add("host_to_device", time.perf_counter() - start)
        return moved, event
