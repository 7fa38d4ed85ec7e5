"""The settings a :class:`fastio.StreamLoader` groups its keyword arguments into, each handed whole to the
part that uses it: which samples each rank reads in which order (:class:`OrderSettings`, for
:mod:`fastio.pipeline.order`), who makes batches and how far ahead (:class:`WorkerSettings`, for
:mod:`fastio.workers`), and how one batch is made (:class:`AssemblySettings`, for
:mod:`fastio.assembly.producer` and :mod:`fastio.assembly.pack`). Checked once, when the loader is built.

Example::

    order = OrderSettings(seed=0, shuffle="shard", rank=0, world_size=2)
    workers = WorkerSettings(num_workers=2, prefetch=2, mode="thread")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastio.assembly.stages import BatchStage
from fastio.pipeline.order import normalize_shuffle, window_within
from fastio.sources.base import ShardParts, Source

__all__ = ["AssemblySettings", "OrderSettings", "WorkerSettings", "order_for_source"]


@dataclasses.dataclass(frozen=True)
class OrderSettings:
    """Which samples each rank reads, in which order: the epoch's order
    (:func:`fastio.pipeline.order.epoch_order`) split across ranks.

    Attributes:
        seed: with the epoch, the only source of randomness.
        shuffle: ``"none"``, ``"full"``, ``"shard"``, ``"window"`` or ``"parts"`` (``True``/``False`` are
            turned into these; :meth:`within` makes ``"full"`` a ``"window"`` where the source cannot hold
            every shard, :meth:`in_parts` a ``"parts"`` where it reads parts of shards instead).
        shuffle_block, shuffle_window: block size and window (shards, or parts) of the shard-aware shuffles.
        shuffle_parts: ``"parts"``: the parts each shard is split into (else 1).
        rank, world_size: this rank and the number of ranks.
        drop_last: drop the last partial batch (and the tail that does not split evenly across ranks).

    Example::

        OrderSettings(seed=3, shuffle=True).shuffle == "full"
    """

    seed: int = 0
    shuffle: bool | str = "none"
    shuffle_block: int = 256
    shuffle_window: int = 4
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    shuffle_parts: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "shuffle", normalize_shuffle(self.shuffle))
        object.__setattr__(self, "seed", int(self.seed))
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={self.rank}, world_size={self.world_size}"
            )

    def within(self, shards_held: int | None, shard_sizes: Sequence[int], reach: int = 0) -> OrderSettings:
        """These settings for a source read shard by shard that holds ``shards_held`` shards at once (its
        cache's room; None: every shard): ``shuffle=True`` stays the full permutation where every shard fits,
        else becomes the sliding window (``"window"``, :mod:`fastio.pipeline.order`) of the shards it holds,
        less what the ``reach`` samples read around each point hold
        (:func:`fastio.pipeline.order.window_within`).

        Example::

            OrderSettings(shuffle=True).within(4, [1000] * 16, reach=64).shuffle_window == 4
        """
        if self.shuffle != "full" or shards_held is None or shards_held >= len(shard_sizes):
            return self
        window = window_within(max(1, int(shards_held)), shard_sizes, reach)
        return dataclasses.replace(self, shuffle="window", shuffle_window=window)

    def in_parts(self, split: ShardParts) -> OrderSettings:
        """These settings for a source that split its shards into parts (``split``, from
        :meth:`fastio.sources.Source.split_shards`): the sliding window of ``split.window`` parts.

        Example::

            OrderSettings(shuffle=True).in_parts(ShardParts(8, 31, 64, 16)).shuffle == "parts"
        """
        return dataclasses.replace(
            self, shuffle="parts", shuffle_window=split.window, shuffle_parts=split.parts
        )

    def window_shards(self, num_shards: int) -> int:
        """Shards the order mixes at once: every shard (full), the window (shard, window), or one (none);
        ``"parts"``: the shards a window of that many parts can draw from, at most.

        Example::

            OrderSettings(shuffle="shard", shuffle_window=3).window_shards(16) == 3
        """
        return {"full": num_shards, "none": 1}.get(self.shuffle, min(self.shuffle_window, num_shards))

    def identity(self) -> dict[str, Any]:
        """What a state dict records so that a resume with another order is refused.

        Example::

            OrderSettings(seed=1).identity()["seed"] == 1
        """
        parts = {"shuffle_parts": self.shuffle_parts} if self.shuffle == "parts" else {}
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_block": self.shuffle_block,
            "shuffle_window": self.shuffle_window,
            **parts,
        }


def order_for_source(
    order: OrderSettings, source: Source, reach: int, plain: bool, parts: int | None = None
) -> tuple[OrderSettings, ShardParts | None]:
    """``order`` for ``source``, and how it split its shards (None: whole shards). On a source read shard by
    shard (``requires_shard_order``), ``shuffle=True`` in a ``plain`` loader (one source, not packed, no
    sampler) asks it for parts of shards (:meth:`fastio.sources.Source.split_shards`, with ``reach``), else
    becomes the window of whole shards (:meth:`OrderSettings.within`); ``shuffle="parts"`` names the split
    (``parts`` per shard) and its window (``shuffle_window``), to resume a state dict saved under another
    world size or cache. Anything else is as asked, on whole shards.

    Example::

        order, split = order_for_source(OrderSettings(shuffle=True), source, reach=64, plain=True)
    """
    if (parts is not None) != (order.shuffle == "parts"):
        got = f"shuffle={order.shuffle!r}, shuffle_parts={parts!r}"
        raise ValueError(f"shuffle_parts= goes with shuffle='parts' and only with it (got {got})")
    split_shards = getattr(source, "split_shards", None) if source.requires_shard_order else None
    if order.shuffle == "parts":
        split = split_shards(reach, parts) if split_shards is not None and plain else None
        if split is None:
            raise ValueError(
                f"shuffle='parts' on {source.name}: only a remote source that reads parts of shards (fastio "
                "shards, uncompressed tars), alone and not packed, has them; use shuffle=True"
            )
        return order.in_parts(dataclasses.replace(split, window=order.shuffle_window)), split
    if not source.requires_shard_order:
        return order, None
    asked = reach if order.shuffle == "full" and plain else None
    split = None if split_shards is None else split_shards(asked)
    if split is not None:
        return order.in_parts(split), split
    return order.within(source.shards_held(), source.shard_sizes, reach), None


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """Who makes batches and how far ahead (:mod:`fastio.workers`).

    Attributes:
        num_workers: workers ahead of the consumer (0: batches are made in the consumer's thread).
        prefetch: extra batches in flight beyond ``num_workers``.
        mode: ``"thread"`` or ``"process"`` (started by ``start_method``; batches come through slot files).
        threads: threads per native gather (None: CPUs / max(1, num_workers), at most 8).
        init_fn: ``init_fn(worker_id)``, run first in each worker (DataLoader's ``worker_init_fn``).
        timeout: with workers, the most seconds the consumer waits for a batch before
            :class:`fastio.errors.WorkerTimeoutError` (0: no limit), DataLoader's ``timeout``.
        persistent: the workers (threads or processes) serve every epoch instead of closing at its end
            (DataLoader's ``persistent_workers``); ``init_fn`` runs once per worker.
        start_method: how worker processes start (DataLoader's ``multiprocessing_context``): ``"fork"``
            (they inherit the source), ``"spawn"`` or ``"forkserver"`` (each opens it anew with ``opener``).
        opener: ``opener() -> Source``, picklable: what a spawned worker process opens (the loader's
            ``source`` through :func:`fastio.registry.open_source`); None with ``"fork"``.
        in_order: hand batches out in order (DataLoader's ``in_order``); False: whichever of the batches in
            flight is ready first.

    Example::

        WorkerSettings(num_workers=2, prefetch=2, mode="process").slots == 4
    """

    num_workers: int = 0
    prefetch: int = 2
    mode: str = "thread"
    threads: int | None = None
    init_fn: Callable[[int], None] | None = None
    timeout: float = 0.0
    persistent: bool = False
    start_method: str = "fork"
    opener: Callable[[], Source] | None = None
    in_order: bool = True

    def __post_init__(self) -> None:
        if self.timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {self.prefetch}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.mode not in ("thread", "process"):
            raise ValueError(f"worker mode must be 'thread' or 'process', got {self.mode!r}")

    @property
    def slots(self) -> int:
        """Batches in flight at once: ``num_workers + prefetch`` with workers, else the one being made."""
        return self.num_workers + self.prefetch if self.num_workers else 1

    @property
    def processes(self) -> bool:
        """True when batches are made in worker processes."""
        return self.num_workers > 0 and self.mode == "process"


@dataclasses.dataclass(frozen=True)
class AssemblySettings:
    """How one batch is made (:mod:`fastio.assembly`: the producer of sample batches, or packed rows).

    Attributes:
        batch_size: samples (packed: rows) per batch.
        stages: :class:`fastio.assembly.stages.BatchStage` steps run on each gathered batch, in order.
        transform, collate: the Python path's per-sample ``transform`` and ``collate``.
        python_path: samples go through ``transform`` and ``collate`` (either given, or a per-sample
            source).
        pin: page-locked output buffers.
        reuse_buffers: refill output buffers that nothing outside the loader still views.
        device: copy batches there (CUDA: on a side stream), or None.

    Example::

        AssemblySettings(batch_size=256, pin=False)
    """

    batch_size: int = 1
    stages: Sequence[BatchStage] = ()
    transform: Callable[[Any], Any] | None = None
    collate: Callable[[list[Any]], Any] | None = None
    python_path: bool = False
    pin: bool = False
    reuse_buffers: bool = True
    device: torch.device | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        object.__setattr__(self, "batch_size", int(self.batch_size))
        object.__setattr__(self, "stages", tuple(self.stages))
        for stage in self.stages:
            if not isinstance(stage, BatchStage):
                raise TypeError(
                    f"stages: {type(stage).__name__} is not a fastio.assembly.stages.BatchStage "
                    "(needs output_specs() and __call__(batch, out, ctx))"
                )
