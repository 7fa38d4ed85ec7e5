"""``StreamLoader``: batches from memory-mapped shards, tar shards or any map-style Dataset, in a
deterministic, resumable, rank-split order; a drop-in where ``torch.utils.data.DataLoader`` is used.

How a batch is made:

1. The epoch's order comes from :mod:`fastio.order` (seed, epoch, shuffle mode, world size, rank, and the
   resume position); it never depends on ``num_workers``.
2. Batch ``i`` is gathered by its source (:mod:`fastio.sources`) into the output buffers of ring slot
   ``i % (num_workers + prefetch)``: fixed-size fields straight from the mmap by the native multi-threaded
   gather, GIL released.
3. ``num_workers`` workers fill slots ahead of the consumer (at most ``num_workers + prefetch`` batches in
   flight); ``num_workers=0`` gathers in the consumer's thread. Batches always come out in order. Workers
   are threads for native gathering and forked processes for Python transforms (``worker_mode``); processes
   write tensors into shared slot files in a temp dir (:mod:`fastio.workers`): nothing is pickled but a
   small description, and nothing depends on the size of ``/dev/shm``.
4. With ``transform``/``collate``, or a ``Dataset`` source, samples go through the Python path: per-sample
   ``transform``, then ``collate`` (default: :func:`fastio.collate.collate_samples`, which gives what
   ``default_collate`` gives, with lists for ragged fields) in the worker.
5. With ``device=`` (CUDA), the pinned batch is copied on a side stream; the consumer's stream waits on an
   event, so the copy overlaps the previous step's compute (with worker processes the consumer copies).

Buffer reuse (``reuse_buffers=True``, the default): a yielded batch's tensors are views of reused buffers
(or, with worker processes, of a shared slot file), and a buffer is refilled only when nothing outside the
loader still views it: a kept batch, a slice or a numpy view of it stays as it was, in every worker mode,
without ``.clone()`` (the loader then fills fresh memory instead). ``reuse_buffers=False``: fresh memory for
every batch.

Randomness in ``transform``: before each sample's call, torch's CPU generator, ``random`` and ``numpy.random``
are seeded from ``(seed, epoch, sample index)`` (:mod:`fastio.seeding`), so augmentations differ across
samples and epochs, do not depend on ``num_workers`` and repeat exactly on resume; with ``num_workers=0`` the
consumer's own generator states are put back after each batch. Worker threads share the global generators
with the training thread, so there they are not reseeded: seed your own from
``fastio.worker_info().sample_seed``.

Resume: ``state_dict()`` says how far the epoch went; ``load_state_dict()`` takes effect at the next
``iter()`` (never the running one: an iteration in progress is not restarted or altered), and continues
with exactly the batches that would have come, for any ``num_workers``; with another world size or batch
size it splits the remainder of the epoch, losing nothing and repeating nothing beyond the padding that
``DistributedSampler`` also adds. ``set_epoch(e)`` with a different epoch drops a pending resume point.

Example::

    loader = fastio.StreamLoader("data/train", batch_size=256, shuffle=True, seed=0, num_workers=2)
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:
            x, y = batch["x"], batch["y"]
    print(loader.stats())
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastio.collate import collate_samples
from fastio.epoch import EpochPass
from fastio.order import advance, epoch_order, normalize_shuffle, num_batches, rank_indices
from fastio.pack import Pack, PackedEpoch, TokenPacker
from fastio.registry import OpenOptions, open_source
from fastio.sources import StageTimes
from fastio.stages import BatchStage

__all__ = ["StreamLoader", "collate_samples"]

_STATE_FORMAT = "fastio.StreamLoader"
_STATE_VERSION = 1


def _distributed_defaults(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return int(rank), int(world_size)


class StreamLoader:
    """Batches from a fastio shard directory, WebDataset tar shards, or a map-style Dataset.

    See the module docstring for how batches are made, buffer reuse and resume.

    Args:
        source: a shard directory (:class:`fastio.ShardWriter`), a tar path / glob / brace pattern
            (``"data/shard-{000000..000099}.tar"``) or list of them, a map-style ``Dataset``, a URL whose
            scheme has an opener, or a :class:`fastio.sources.Source`: whatever
            :func:`fastio.registry.open_source` opens (formats and schemes are registered there).
        batch_size: samples per batch.
        shuffle: ``False`` (the default, as in DataLoader: storage order), ``True`` (a full global
            permutation per epoch, as in DataLoader) or ``"shard"`` (shard-aware, for sources where random
            access is costly: shards, then blocks within a window, then samples; fewer distinct shards per
            batch, see :mod:`fastio.order`). Sources that declare ``requires_shard_order`` (remote
            stores) refuse ``True``.
        seed: with the epoch, the only source of randomness.
        num_workers: gathering threads ahead of the consumer (0: gather in the consumer's thread).
        pin_memory: page-locked output buffers; default: when CUDA is available.
        drop_last: drop the last partial batch (and the tail that does not split evenly across ranks).
        prefetch: extra batches in flight beyond ``num_workers``.
        transform: ``transform(sample) -> sample`` per sample (switches to the Python path).
        collate: ``collate(samples) -> batch`` (switches to the Python path); ``collate_fn=`` is accepted
            too, as DataLoader names it.
        worker_init_fn: ``worker_init_fn(worker_id)`` runs first in each worker thread or process, as in
            DataLoader (after :func:`fastio.worker_info` is set there).
        rank, world_size: override what ``torch.distributed`` says.
        device: a CUDA device to copy batches to on a side stream.
        decode: tar sources: None, ``"pil"`` (images via Pillow) or ``decode(field, bytes) -> value``.
        verify: shard checksums: None (lazily, once per process per shard), True (all at open), False.
        tar_strict: tar shards must end with an end-of-archive marker; a zeroed header followed by more
            members, concatenated archives or a file cut at a block boundary raise
            :class:`fastio.CorruptShardError` saying where. ``False`` serves the members before the damage.
        progress: show a tqdm progress bar per epoch.
        reuse_buffers: reuse output buffers that nothing outside still views (see the module docstring).
        threads: threads per native gather (default: CPUs / max(1, num_workers), at most 8).
        worker_mode: ``"thread"``, ``"process"`` (forked, batches handed over through slot files, see
            :mod:`fastio.workers`) or ``"auto"``: processes when Python code runs per sample (``transform``,
            ``collate`` or a Dataset source), threads otherwise.
        shuffle_block, shuffle_window: block size and window of the shard-aware shuffle.
        stages: :class:`fastio.stages.BatchStage` steps run on each gathered batch, in order, before
            ``transform`` (the image pipeline is one): they write into reused fixed-shape buffers.
        pack: a :class:`fastio.Pack`: batches of fixed-length rows packed from a variable-length token
            field (shard directories), with document boundaries; see :mod:`fastio.pack`.
        cache_dir, cache_limit: sources that bring shards local (remote stores, compressed tars): where
            they keep them and the most bytes kept (``"50GB"`` or an int).
        storage_options: keyword arguments of the storage client (fsspec's ``storage_options``).

    Returns batches: for shard and tar sources a dict field -> tensor ``[B, ...]`` (fixed shapes) or list
    (variable ones; tar sources add ``"__key__"``); for Dataset sources what ``collate`` returns.

    Example::

        loader = fastio.StreamLoader("data/train", batch_size=256, shuffle=True, seed=0)
        for batch in loader:
            loss = model(batch["x"].float()).sum()
        state = loader.state_dict()          # later: loader.load_state_dict(state); next iter() resumes
    """

    def __init__(
        self,
        source: Any,
        batch_size: int = 1,
        shuffle: bool | str = False,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        drop_last: bool = False,
        prefetch: int = 2,
        transform: Callable[[Any], Any] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        device: str | torch.device | None = None,
        decode: Callable[[str, bytes], Any] | str | None = None,
        verify: bool | None = None,
        tar_strict: bool = True,
        progress: bool = False,
        reuse_buffers: bool = True,
        worker_mode: str = "auto",
        threads: int | None = None,
        shuffle_block: int = 256,
        shuffle_window: int = 4,
        stages: Sequence[BatchStage] = (),
        pack: Pack | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if collate_fn is not None:
            if collate is not None:
                raise ValueError("pass collate= or DataLoader's name for it, collate_fn=, not both")
            collate = collate_fn
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.shuffle = normalize_shuffle(shuffle)
        self.batch_size, self.seed, self.num_workers, self.prefetch = (
            int(batch_size),
            int(seed),
            num_workers,
            prefetch,
        )
        self.drop_last, self.transform, self.collate = drop_last, transform, collate
        self.worker_init_fn = worker_init_fn
        self.rank, self.world_size = _distributed_defaults(rank, world_size)
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available")
        self._pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.progress, self.reuse_buffers, self.threads = progress, reuse_buffers, threads
        if worker_mode not in ("auto", "thread", "process"):
            raise ValueError(f"worker_mode must be 'auto', 'thread' or 'process', got {worker_mode!r}")
        self.shuffle_block, self.shuffle_window = shuffle_block, shuffle_window
        self.stages = list(stages)
        for stage in self.stages:
            if not isinstance(stage, BatchStage):
                raise TypeError(
                    f"stages: {type(stage).__name__} is not a fastio.stages.BatchStage "
                    "(needs output_specs() and __call__(batch, out, ctx))"
                )
        self._source = open_source(
            source,
            OpenOptions(
                decode=decode,
                verify=verify,
                tar_strict=tar_strict,
                cache_dir=None if cache_dir is None else str(cache_dir),
                cache_limit=cache_limit,
                storage_options=storage_options,
            ),
        )
        if self._source.requires_shard_order and self.shuffle == "full":
            raise ValueError(
                f"shuffle=True (a full permutation) on {self._source.name}, a source read shard by shard: "
                "nearly every sample would come from another shard, each fetched whole; use shuffle='shard' "
                "(a shard-aware shuffle: shards, then blocks within a window of shards, then samples)"
            )
        self._python_path = transform is not None or collate is not None or self._source.per_sample
        if worker_mode == "auto":
            worker_mode = "process" if self._python_path else "thread"
        self.worker_mode = worker_mode
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, start) for the next iter()
        self._current: EpochPass | PackedEpoch | None = None
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._order_lock = threading.Lock()
        self.pack, self._packer = pack, None
        if pack is not None:
            self._packer = TokenPacker(
                self._source,
                pack,
                self._order,
                batch_size=self.batch_size,
                world_size=self.world_size,
                rank=self.rank,
                drop_last=self.drop_last,
                settings={
                    "seed": self.seed,
                    "shuffle": self.shuffle,
                    "shuffle_block": self.shuffle_block,
                    "shuffle_window": self.shuffle_window,
                },
            )
            if transform is not None or collate is not None or self.stages or self.worker_mode == "process":
                raise ValueError(
                    "pack= makes batches of packed rows itself: it takes no transform, collate, stages or "
                    "worker_mode='process' (its workers are threads)"
                )

    # -- the order -----------------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Samples in the source (every rank's share together)."""
        return self._source.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        with self._order_lock:
            if self._order_cache is None or self._order_cache[0] != epoch:
                order = epoch_order(
                    self._source.shard_sizes,
                    self.seed,
                    epoch,
                    self.shuffle,
                    self.shuffle_block,
                    self.shuffle_window,
                )
                self._order_cache = (epoch, order)
            return self._order_cache[1]

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next ``iter()``; drops a pending resume of another epoch.

        Example::

            loader.set_epoch(5)
        """
        epoch = int(epoch)
        if epoch != self.epoch:
            self._resume = None
            self._current = None
        self.epoch = epoch

    def __len__(self) -> int:
        if self._packer is not None:
            return self._packer.num_batches(self.epoch)
        per_rank = (
            -(-self.num_samples // self.world_size)
            if not self.drop_last
            else self.num_samples // self.world_size
        )
        return num_batches(per_rank, self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[Any]:
        if self._current is not None:
            self._current.close()
        start = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start = self._resume[1]
        self._resume = None
        if self._packer is not None:
            self._current = self._packer.iterate(
                self.epoch,
                start,
                num_workers=self.num_workers,
                prefetch=self.prefetch,
                threads=self.threads,
                pin=self._pin,
                reuse_buffers=self.reuse_buffers,
                device=self.device,
            )
        else:
            order = self._order(self.epoch)
            indices = rank_indices(order, start, self.world_size, self.rank, self.drop_last)
            self._current = EpochPass(
                self._source,
                indices,
                self.epoch,
                start,
                batch_size=self.batch_size,
                drop_last=self.drop_last,
                num_workers=self.num_workers,
                prefetch=self.prefetch,
                worker_mode=self.worker_mode,
                world_size=self.world_size,
                threads=self.threads,
                device=self.device,
                reuse_buffers=self.reuse_buffers,
                progress=self.progress,
                seed=self.seed,
                pin=self._pin,
                transform=self.transform,
                collate=self.collate,
                python_path=self._python_path,
                worker_init_fn=self.worker_init_fn,
                stages=self.stages,
            )
        return self._current

    # -- resume --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank is in the epoch: enough to resume exactly, on any ``num_workers`` or world size.

        Counts batches handed to the consumer (not those prefetched). Reports the pending resume point after
        :meth:`load_state_dict`, else the current (or last) iteration, else the start of ``self.epoch``.

        Example::

            torch.save(loader.state_dict(), "loader.pt")
        """
        if self._packer is not None:  # rows of the packed stream (fastio.pack), not samples
            if self._resume is not None:
                return self._packer.state_dict(*self._resume)
            if self._current is not None:
                return self._packer.state_dict(self._current.epoch, self._current.rows_consumed)
            return self._packer.state_dict(self.epoch, 0)
        if self._resume is not None:
            epoch, start, yielded, world = self._resume[0], self._resume[1], 0, self.world_size
        elif self._current is not None:
            epoch, start, yielded, world = (
                self._current.epoch,
                self._current.start,
                self._current.yielded,
                (self.world_size),
            )
        else:
            epoch, start, yielded, world = self.epoch, 0, 0, self.world_size
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_block": self.shuffle_block,
            "shuffle_window": self.shuffle_window,
            "num_samples": self.num_samples,
            "epoch": epoch,
            "start": start,
            "batches_yielded": yielded,
            "batch_size": self.batch_size,
            "world_size": world,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` at the next ``iter()``.

        An iteration already running is left alone (it is not restarted and does not jump); a warning says
        so. The seed, shuffle settings and dataset size must match, else ``ValueError``.

        Example::

            loader.load_state_dict(torch.load("loader.pt"))
            for batch in loader:   # continues the saved epoch
                ...
        """
        if self._packer is not None:
            self._warn_if_running()
            self.epoch, row = self._packer.resume_point(state)
            self._resume = (self.epoch, row)
            return
        if state.get("format") != _STATE_FORMAT or state.get("version") != _STATE_VERSION:
            raise ValueError(f"not a {_STATE_FORMAT} v{_STATE_VERSION} state dict")
        for key, mine in (
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("shuffle_block", self.shuffle_block),
            ("shuffle_window", self.shuffle_window),
            ("num_samples", self.num_samples),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"state_dict {key}={state[key]!r} but this loader has {key}={mine!r}; "
                    "the epoch order would differ"
                )
        self._warn_if_running()
        old_per_rank = len(
            rank_indices(np.arange(self.num_samples), state["start"], state["world_size"], 0, False)
        )
        consumed = min(state["batches_yielded"] * state["batch_size"], old_per_rank)
        start = advance(state["start"], state["world_size"], consumed, self.num_samples)
        self.epoch = int(state["epoch"])
        self._resume = (self.epoch, start)

    def _warn_if_running(self) -> None:
        if self._current is not None and not self._current.finished and self._current.yielded:
            warnings.warn(
                "load_state_dict during an iteration: the running iteration continues unchanged; "
                "the loaded position applies at the next iter()",
                stacklevel=3,
            )

    # -- statistics ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Throughput and where the time went, for the current (or last) iteration.

        ``samples_per_s`` and ``mb_per_s`` (bytes gathered) over the consumer's wall time; ``stage_s``:
        seconds in read, decode_transform, collate and host_to_device (summed over worker threads;
        host_to_device is the time to issue the copies); ``wait_share``: the share of the consumer's time
        spent waiting for a batch (near 1: input-bound; near 0: the input keeps up); ``input_bound``:
        ``wait_share >= 0.5``. Sources with counters of their own (:meth:`fastio.sources.Source.stats`: a
        remote source's downloads and cache) add them as ``source``, and ``network_wait_s``: seconds its
        fetches waited for shards to become local (not part of ``stage_s["read"]``, which is the gather).

        Example::

            s = loader.stats(); print(f"{s['samples_per_s']:.0f} samples/s, waiting {s['wait_share']:.0%}")
        """
        if self._current is None:
            out = {
                "epoch": self.epoch,
                "batches": 0,
                "samples": 0,
                "elapsed_s": 0.0,
                "samples_per_s": 0.0,
                "mb_per_s": 0.0,
                "stage_s": dict.fromkeys(StageTimes.STAGES, 0.0),
                "wait_s": 0.0,
                "wait_share": 0.0,
                "input_bound": False,
            }
        else:
            out = self._current.stats()
        source = self._source.stats()
        if source:
            out["source"] = source
            out["network_wait_s"] = source.get("network_wait_s", 0.0)
        return out
