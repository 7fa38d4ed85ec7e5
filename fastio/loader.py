"""``StreamLoader``: batches from memory-mapped shards, tar shards or any map-style Dataset, in a
deterministic, resumable, rank-split order; a drop-in where ``torch.utils.data.DataLoader`` is used.

How a batch is made:

1. The epoch's order comes from :mod:`fastio.pipeline.order` (seed, epoch, shuffle mode, world size, rank,
   and the resume position); it never depends on ``num_workers``, but for ``shuffle=True`` on a remote source
   whose cache cannot hold every shard: its window (of parts of shards, or of whole shards) leaves room for
   what worker processes hold (:meth:`fastio.pipeline.settings.OrderSettings.within`), which matters only for
   shards or parts small against a batch.
2. Batch ``i`` is gathered by its source (:mod:`fastio.sources`) into the output buffers of ring slot
   ``i % (num_workers + prefetch)``: fixed-size fields straight from the mmap by the native multi-threaded
   gather, GIL released.
3. ``num_workers`` workers fill slots ahead of the consumer (at most ``num_workers + prefetch`` batches in
   flight); ``num_workers=0`` gathers in the consumer's thread. Batches come out in order (``in_order=False``:
   as they are ready). Workers are threads for native gathering and processes (forked, or spawned by
   ``multiprocessing_context=``) for Python transforms (``WorkerOptions.mode``);
   processes write tensors into shared slot files in a temp dir (:mod:`fastio.workers`): nothing is pickled
   but a small description, and nothing depends on the size of ``/dev/shm``.
4. With ``transform``/``collate_fn``, or a ``Dataset`` source, samples go through the Python path:
   per-sample ``transform``, then ``collate_fn`` (default: :func:`fastio.assembly.collate.collate_samples`,
   which gives what ``default_collate`` gives, with lists for ragged fields) in the worker.
5. With ``device=`` (CUDA), the pinned batch is copied on a side stream; the consumer's stream waits on an
   event, so the copy overlaps the previous step's compute (with worker processes the consumer copies).

Buffer reuse (``BatchOptions(reuse_buffers=True)``, the default): a yielded batch's tensors are views of
reused buffers (or, with worker processes, of a shared slot file), and a buffer is refilled only when nothing
outside the loader still views it: a kept batch, a slice or a numpy view of it stays as it was, in every
worker mode, without ``.clone()`` (the loader then fills fresh memory instead). ``reuse_buffers=False``: fresh
memory for every batch.

Randomness in ``transform``: before each sample's call, torch's CPU generator, ``random`` and ``numpy.random``
are seeded from ``(seed, epoch, sample index)`` (:mod:`fastio.assembly.seeding`), so augmentations differ
across samples and epochs, do not depend on ``num_workers`` and repeat exactly on resume; with
``num_workers=0`` the consumer's own generator states are put back after each batch. Worker threads share
the global generators with the training thread, so there they are not reseeded: seed your own from
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

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from fastio.assembly.collate import collate_samples
from fastio.assembly.pack import Pack, TokenPacker
from fastio.mixing import Stream, as_streams, mixed_batches, open_streams
from fastio.options import (
    BatchOptions,
    MixingOptions,
    OpenOptions,
    OrderOptions,
    ReadOptions,
    RemoteOptions,
    WorkerOptions,
    grouped_options,
)
from fastio.pipeline.arguments import (
    collate_fn_argument,
    dataloader_worker_args,
    distributed_defaults,
    pinned,
    unbatched_collate,
)
from fastio.pipeline.batches import Batches, EpochOrders, SampleBatches
from fastio.pipeline.closing import Closing
from fastio.pipeline.sampled import (
    SamplerBatches,
    SamplerOrders,
    check_sampler_args,
    index_batches,
    index_sampler,
)
from fastio.pipeline.settings import AssemblySettings, OrderSettings, WorkerSettings, order_for_source
from fastio.pipeline.spawn import check_worker_processes
from fastio.registry import open_source
from fastio.sources import ReadPlan, StageTimes
from fastio.workers.batch_pass import BatchPass

__all__ = ["StreamLoader", "collate_samples"]


class StreamLoader(Closing):
    """Batches from a fastio shard directory, WebDataset tar shards, or a map-style Dataset.

    See the module docstring for how batches are made, buffer reuse and resume.

    Args:
        source: a shard directory (:class:`fastio.ShardWriter`), a tar path / glob / brace pattern
            (``"data/shard-{000000..000099}.tar"``) or list of them, a map-style ``Dataset``, a URL whose
            scheme has an opener, or a :class:`fastio.sources.Source`: whatever
            :func:`fastio.registry.open_source` opens (formats and schemes are registered there); or a list
            of :class:`fastio.Stream` (sources with weights), mixed in proportion (:mod:`fastio.mixing`,
            docs/loader.md "Mixing weighted streams").
        batch_size: samples per batch; None: samples one by one, as in DataLoader (``collate_fn``, default
            ``default_convert``, gets each sample alone).
        shuffle: ``False`` (the default, as in DataLoader: storage order), ``True`` (a full global
            permutation per epoch, as in DataLoader) or ``"shard"`` (shard-aware, for sources where random
            access is costly: shards, then blocks within a window, then samples; fewer distinct shards per
            batch, see :mod:`fastio.pipeline.order`). On sources that declare ``requires_shard_order``
            (remote stores), ``True`` is the full permutation where the cache holds every shard, else a
            sliding window of parts of shards where the source reads parts (``"parts"``, fastio shards and
            uncompressed tars, sidecar or not: ``stats()["shuffle_window_parts"]``), else of the shards the
            cache holds (``"window"``, ``stats()["shuffle_window_shards"]``).
        seed: with the epoch, the only source of randomness.
        num_workers: workers ahead of the consumer (0: batches are made in the consumer's thread).
        pin_memory: page-locked output buffers; default: False, as in DataLoader, but True with a CUDA
            ``device=`` (its side-stream copy overlaps compute only from pinned memory).
        drop_last: drop the last partial batch (and the tail that does not split evenly across ranks).
        transform: ``transform(sample) -> sample`` per sample (switches to the Python path).
        device: a CUDA device to copy batches to on a side stream.
        collate_fn: ``collate_fn(samples) -> batch`` (switches to the Python path).
        worker_init_fn: ``worker_init_fn(worker_id)`` runs first in each worker thread or process, as in
            DataLoader (after :func:`fastio.worker_info` is set there).
        sampler, batch_sampler, generator: as in DataLoader (:mod:`fastio.pipeline.sampled`): exactly the
            indices the sampler yields, batched as DataLoader batches them, or the batch sampler's batches;
            ``generator=`` with ``shuffle=True`` gives DataLoader's order for the same generator state.
            DataLoader's checks apply (``sampler`` excludes ``shuffle``; ``batch_sampler`` excludes
            ``batch_size``, ``shuffle``, ``sampler`` and ``drop_last``); a rank split given in ``order=``
            splits the sampler's sequence; with ``pack=`` the sampler orders the documents; refused with
            ``shuffle="shard"`` and sources read shard by shard. Resume re-runs the sampler and skips the
            batches handed over: exact only when the sampler repeats its order.
        persistent_workers: the same workers (threads or processes) serve every epoch (False: they close
            at each epoch's end, as in DataLoader).
        prefetch_factor: DataLoader's batches in flight per worker (instead of ``WorkerOptions.prefetch``).
        timeout: with workers, seconds to wait for a batch before :class:`fastio.WorkerTimeoutError`
            (0: no limit).
        multiprocessing_context: ``"fork"`` (default), ``"spawn"``, ``"forkserver"`` or a context: how
            worker processes start; spawned ones open the source anew (:mod:`fastio.pipeline.spawn`); not
            with ``pack=``, whose workers are threads.
        pin_memory_device: deprecated and ignored, with DataLoader's warning (use ``device=``).
        in_order: False: with workers, batches come as they are ready (``state_dict`` stays exact).
        pack: a :class:`fastio.Pack`: batches of fixed-length rows packed from a variable-length token
            field (shard directories), with document boundaries; see :mod:`fastio.assembly.pack`.
        read, remote, order, workers, batches, mixing: fastio's own options, one object per concern
            (:mod:`fastio.options`: :class:`fastio.ReadOptions`, :class:`fastio.RemoteOptions`,
            :class:`fastio.OrderOptions`, :class:`fastio.WorkerOptions`, :class:`fastio.BatchOptions`,
            :class:`fastio.MixingOptions`; the table in docs/loader.md). Their fields' old flat names
            (``cache_dir=``, ``worker_mode=``...) and ``collate=`` still work for one release, with a
            ``DeprecationWarning`` naming the new form.

    Returns batches: for shard and tar sources a dict field -> tensor ``[B, ...]`` (fixed shapes) or list
    (variable ones; tar sources add ``"__key__"``); for Dataset sources what ``collate_fn`` returns.

    Example::

        loader = fastio.StreamLoader("data/train", batch_size=256, shuffle=True, seed=0)
        for batch in loader:
            loss = model(batch["x"].float()).sum()
        state = loader.state_dict()          # later: loader.load_state_dict(state); next iter() resumes
    """

    def __init__(
        self,
        source: Any,
        batch_size: int | None = 1,
        shuffle: bool | str = False,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        drop_last: bool = False,
        *,
        transform: Callable[[Any], Any] | None = None,
        device: str | torch.device | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        sampler: Iterable[int] | None = None,
        batch_sampler: Iterable[list[int]] | None = None,
        generator: torch.Generator | None = None,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        timeout: float = 0,
        multiprocessing_context: Any = None,
        pin_memory_device: str = "",
        in_order: bool = True,
        pack: Pack | None = None,
        read: ReadOptions | None = None,
        remote: RemoteOptions | None = None,
        order: OrderOptions | None = None,
        workers: WorkerOptions | None = None,
        batches: BatchOptions | None = None,
        mixing: MixingOptions | None = None,
        **deprecated: Any,
    ) -> None:
        collate = collate_fn_argument(collate_fn, deprecated)
        # 1. What is asked, checked once and grouped by the part that uses it (fastio.pipeline.settings).
        groups = grouped_options(
            {"read": read, "remote": remote, "order": order, "workers": workers, "batches": batches,
             "mixing": mixing},
            deprecated,
        )  # fmt: skip
        read, remote, order_options = groups["read"], groups["remote"], groups["order"]
        worker_options, batch_options, mixing = groups["workers"], groups["batches"], groups["mixing"]
        prefetch, worker_mode, start_method = dataloader_worker_args(
            num_workers, worker_options.prefetch, prefetch_factor, persistent_workers,
            multiprocessing_context, worker_options.mode,
        )  # fmt: skip
        self.unbatched = batch_size is None  # DataLoader's batch_size=None: samples, not batches
        user_collate = collate
        if self.unbatched:
            if pack is not None:
                raise ValueError("batch_size=None with pack=: packed rows come in batches; give batch_size=")
            collate, batch_size = unbatched_collate(collate, drop_last, batch_sampler), 1
        progress = batch_options.progress
        assembly = AssemblySettings(batch_size, batch_options.stages, transform, collate)
        worker_settings = WorkerSettings(
            num_workers, prefetch, "thread", worker_options.threads, worker_init_fn, float(timeout),
            persistent_workers, start_method, in_order=bool(in_order),
        )  # fmt: skip
        ranks_given = order_options.rank is not None or order_options.world_size is not None
        rank, world_size = distributed_defaults(order_options.rank, order_options.world_size)
        order_settings = OrderSettings(
            seed, shuffle, order_options.shuffle_block, order_options.shuffle_window, rank, world_size,
            drop_last,
        )  # fmt: skip
        device = torch.device(device) if device is not None else None
        if device is not None and device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available")
        pin = pinned(pin_memory, pin_memory_device, device is not None and device.type == "cuda")
        # 2. The source, through the registry's tables (fastio.registry).
        options = OpenOptions.of(read, remote)
        streams = as_streams(source)
        if streams is None and mixing != MixingOptions():
            raise ValueError(
                "mixing= (mix, epoch_size) apply to a list of fastio.Stream sources (mixing them)"
            )
        if streams is None:
            opener = functools.partial(open_source, source, options)
        else:
            opener = functools.partial(open_streams, streams, functools.partial(open_source, options=options))
        self._source = opener()
        if streams is not None and self._source.requires_shard_order and order_settings.shuffle == "full":
            raise ValueError(
                f"shuffle=True (a full permutation of each stream) on {self._source.name}, which mixes a "
                "source read shard by shard: nearly every sample would come from another shard, each fetched "
                "whole; use shuffle='shard' (a shard-aware shuffle within each stream)"
            )
        sampled = check_sampler_args(
            shuffle=shuffle, batch_size=batch_size, drop_last=drop_last, sampler=sampler,
            batch_sampler=batch_sampler, generator=generator, ranks_given=ranks_given,
            packed=pack is not None, source=self._source,
        )  # fmt: skip
        if sampled and streams is not None:
            raise ValueError(
                "sampler=, batch_sampler= or generator= with a list of fastio.Stream: the mixed epoch is "
                "fastio's own order of the streams; use shuffle= and seed="
            )
        if sampled and not ranks_given:  # as in DataLoader, the sampler decides which indices a rank reads
            order_settings = dataclasses.replace(order_settings, rank=0, world_size=1)
        python_path = transform is not None or user_collate is not None or self._source.per_sample
        if worker_mode == "auto":
            worker_mode = "process" if python_path else "thread"
        worker_settings = dataclasses.replace(worker_settings, mode=worker_mode)
        if worker_settings.processes:
            check_worker_processes(self._source, start_method, persistent_workers)
        if start_method != "fork":
            worker_settings = dataclasses.replace(worker_settings, opener=opener)
        reuse = batch_options.reuse_buffers
        assembly = dataclasses.replace(
            assembly, python_path=python_path or self.unbatched, pin=pin, reuse_buffers=reuse, device=device
        )
        # shuffle=True on a source read shard by shard: a window of what its cache holds
        # (fastio.pipeline.settings).
        slots, processes = worker_settings.slots, worker_settings.processes
        reach = ReadPlan(batch_size, slots, processes, world_size > 1).reach(world_size)
        plain = streams is None and pack is None and not sampled
        order_settings, self._parts = order_for_source(
            order_settings, self._source, reach, plain, order_options.shuffle_parts
        )
        self.order, self.workers, self.assembly = order_settings, worker_settings, assembly
        # 3. How epochs are cut into batches, chosen once (fastio.pipeline.batches): samples, or packed rows.
        self.pack = pack
        self.sampler, self.batch_sampler, self.generator = sampler, batch_sampler, generator
        self._batches = self._choose_batches(streams, mixing, sampled and bool(shuffle), sampled, progress)
        self.progress = progress
        self.epoch = 0
        self._resume: tuple[int, int, list[int]] | None = None  # (epoch, start, batches ahead) for iter()
        self._current: BatchPass | None = None

    def _choose_batches(
        self,
        streams: list[Stream] | None,
        mixing: MixingOptions,
        shuffled: bool,
        sampled: bool,
        progress: bool,
    ) -> Batches:
        """How this loader's epochs are cut into batches: a sampler's, mixed streams', packed rows or
        samples of fastio's order (:class:`fastio.pipeline.batches.Batches`)."""
        source, order, workers, assembly = self._source, self.order, self.workers, self.assembly
        if sampled and self.pack is not None:
            documents = SamplerOrders(
                index_sampler(source.num_samples, shuffled, self.sampler, self.generator)
            )
            return TokenPacker(source, self.pack, documents, order=order, workers=workers, assembly=assembly,
                               identity=documents.identity())  # fmt: skip
        if sampled:
            index_sampler_batches = index_batches(
                source.num_samples, assembly.batch_size, shuffled, order.drop_last,
                self.sampler, self.batch_sampler, self.generator, (order.rank, order.world_size),
            )  # fmt: skip
            return SamplerBatches(source, index_sampler_batches, self.generator, order.seed, workers,
                                  assembly, progress, order.world_size)  # fmt: skip
        if streams is not None:
            return mixed_batches(
                source, streams, mix=mixing.mix, epoch_size=mixing.epoch_size, pack=self.pack, order=order,
                workers=workers, assembly=assembly, progress=progress,
            )  # fmt: skip
        orders = EpochOrders(source.shard_sizes, order)
        if self.pack is None:
            return SampleBatches(source, orders, order, workers, assembly, progress)
        return TokenPacker(source, self.pack, orders, order=order, workers=workers, assembly=assembly)

    # -- what was asked, read from the settings it was grouped into (fastio.pipeline.settings) ------------
    batch_size = property(
        lambda self: None if self.unbatched else self.assembly.batch_size,
        doc="Samples (packed: rows) per batch; None: samples one by one (DataLoader's batch_size=None).",
    )
    stages = property(lambda self: self.assembly.stages, doc="The batch stages, in order.")
    transform = property(lambda self: self.assembly.transform, doc="The per-sample transform, or None.")
    collate = property(lambda self: self.assembly.collate, doc="The collate function, or None.")
    reuse_buffers = property(lambda self: self.assembly.reuse_buffers, doc="Reuse unviewed buffers.")
    device = property(lambda self: self.assembly.device, doc="Where batches are copied, or None.")
    shuffle = property(lambda self: self.order.shuffle, doc='"none", "full", "shard", "window" or "parts".')
    shuffle_block = property(lambda self: self.order.shuffle_block, doc="Block of the shard shuffle.")
    shuffle_window = property(lambda self: self.order.shuffle_window, doc="Window of the shard shuffle.")
    seed = property(lambda self: self.order.seed, doc="With the epoch, the only source of randomness.")
    drop_last = property(lambda self: self.order.drop_last, doc="Drop the last partial batch.")
    rank = property(lambda self: self.order.rank, doc="This rank.")
    world_size = property(lambda self: self.order.world_size, doc="Ranks sharing the epoch.")
    num_workers = property(lambda self: self.workers.num_workers, doc="Workers ahead of the consumer.")
    prefetch = property(lambda self: self.workers.prefetch, doc="Batches in flight beyond the workers.")
    worker_mode = property(lambda self: self.workers.mode, doc='"thread" or "process".')
    threads = property(lambda self: self.workers.threads, doc="Threads per native gather, or None.")
    worker_init_fn = property(lambda self: self.workers.init_fn, doc="Run first in each worker, or None.")
    persistent_workers = property(lambda self: self.workers.persistent, doc="Workers serve every epoch.")
    in_order = property(lambda self: self.workers.in_order, doc="Batches are handed out in order.")

    @property
    def num_samples(self) -> int:
        """Samples in the source (every rank's share together)."""
        return self._source.num_samples

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
        return self._batches.num_batches(self.epoch)

    def __iter__(self) -> Iterator[Any]:
        if self._current is not None:
            self._current.close()
        start, ahead = 0, []
        if self._resume is not None and self._resume[0] == self.epoch:
            start, ahead = self._resume[1], self._resume[2]
        self._resume = None
        skip = {"skip": ahead} if ahead else {}  # batches handed over out of order before the state was saved
        self._current = self._batches.iterate(self.epoch, start, **skip)
        return self._current

    # -- resume --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank is in the epoch: enough to resume exactly, on any ``num_workers`` or world size.

        Counts batches handed to the consumer (not those prefetched). Reports the pending resume point after
        :meth:`load_state_dict`, else the current (or last) iteration, else the start of ``self.epoch``.

        Example::

            torch.save(loader.state_dict(), "loader.pt")
        """
        if self._resume is not None:
            epoch, start, done, ahead = *self._resume[:2], 0, self._resume[2]
        elif self._current is not None:
            epoch, start, (done, ahead) = self._current.epoch, self._current.start, self._current.position()
        else:
            epoch, start, done, ahead = self.epoch, 0, 0, []
        state = self._batches.state_dict(epoch, start, done)
        if ahead:  # in_order=False: batches handed over beyond the first ``done``, counted from there
            state["batches_ahead"] = [n - done for n in ahead]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` at the next ``iter()``.

        An iteration already running is left alone (it is not restarted and does not jump); a warning says
        so. The seed, shuffle settings and dataset size must match, else ``ValueError``.

        Example::

            loader.load_state_dict(torch.load("loader.pt"))
            for batch in loader:   # continues the saved epoch
                ...
        """
        epoch, start = self._batches.resume_point(state)
        ahead = [int(n) for n in state.get("batches_ahead", [])]
        layout = {"batch_size": self.assembly.batch_size, "world_size": self.order.world_size}
        differs = [key for key, mine in layout.items() if state.get(key, mine) != mine]
        if ahead and differs:
            raise ValueError(
                f"state_dict has batches handed over out of order (in_order=False) and another {differs[0]} "
                f"({state[differs[0]]} against {layout[differs[0]]}): it resumes exactly only with the same "
                "batch_size and world_size"
            )
        self._warn_if_running()
        self.epoch = epoch
        self._resume = (epoch, start, ahead)

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
        ``shuffle_mode`` and ``shuffle_window_shards`` say which order was chosen and how many shards it mixes
        at once (``shuffle=True`` on a cache-limited remote source: ``"parts"``, with
        ``shuffle_window_parts`` parts open at once, each shard cut into ``shuffle_parts`` parts of at most
        ``part_samples`` samples; or ``"window"`` and the shards the cache holds, for sources that read whole
        shards only).

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
        out["shuffle_mode"] = self.order.shuffle
        parts = self._parts
        out["shuffle_window_shards"] = self.order.window_shards(
            len(self._source.shard_sizes) if parts is None else parts.shards
        )
        if parts is not None:
            out.update(shuffle_window_parts=self.order.shuffle_window, shuffle_parts=parts.parts,
                       part_samples=parts.part_samples)  # fmt: skip
        source = self._source.stats()
        if source:
            out["source"] = source
            out["network_wait_s"] = source.get("network_wait_s", 0.0)
        return out
