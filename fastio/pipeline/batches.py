"""What a :class:`fastio.StreamLoader`'s batches are, chosen once when it is built: :class:`SampleBatches`
(batches of the source's samples in the epoch's rank-split order, each made by
:class:`fastio.assembly.producer.BatchProducer`: gather, stages, ``transform``/``collate``, copy to the
device) or, with ``pack=``, :class:`fastio.assembly.pack.TokenPacker` (fixed-length rows packed from a token
field). Both meet :class:`Batches`: how many batches an epoch has, a pass over (the rest of) an epoch, and
the state dict that resumes one. The loader holds one and never asks which.

Example::

    batches = SampleBatches(source, EpochOrders(source.shard_sizes, order), order, workers, assembly)
    for batch in batches.iterate(epoch=0, start=0):
        ...
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from fastio.pipeline.epoch import EpochPass
from fastio.pipeline.order import epoch_order, num_batches, rank_indices, resume_start
from fastio.pipeline.settings import AssemblySettings, OrderSettings, WorkerSettings
from fastio.sources import Source
from fastio.workers.batch_pass import BatchPass
from fastio.workers.kept import KeptWorkers

__all__ = ["STATE_FORMAT", "STATE_VERSION", "Batches", "EpochOrders", "SampleBatches"]

STATE_FORMAT = "fastio.StreamLoader"  # a sample loader's state dict, whichever Batches made it
STATE_VERSION = 1


class Batches(Protocol):
    """How a loader's epochs are cut into batches: what :class:`fastio.StreamLoader` delegates to.

    ``start`` counts the epoch's units (samples of the global order, or packed rows) before the pass;
    ``yielded`` the batches a pass has handed over since.
    """

    def num_batches(self, epoch: int) -> int:
        """Batches this rank yields in ``epoch`` (every rank yields as many)."""
        ...

    def iterate(self, epoch: int, start: int) -> BatchPass:
        """A pass over ``epoch`` from ``start`` on: what ``iter(loader)`` returns. Batches whose passes hand
        batches out of order (``in_order=False``) take ``skip=``: the pass's batches handed over before."""
        ...

    def state_dict(self, epoch: int, start: int, yielded: int) -> dict[str, Any]:
        """The state that resumes right after ``yielded`` batches of the pass from ``start``."""
        ...

    def resume_point(self, state: dict[str, Any]) -> tuple[int, int]:
        """``(epoch, start)`` of :meth:`state_dict`'s ``state``, after checking it describes these batches."""
        ...


class EpochOrders:
    """The global order of each epoch (:func:`fastio.pipeline.order.epoch_order`), kept for the latest epoch
    asked; thread-safe.

    Example::

        orders = EpochOrders([13, 7], OrderSettings(seed=0, shuffle=True))
        assert sorted(orders(2).tolist()) == list(range(20))
    """

    def __init__(self, shard_sizes: Sequence[int], order: OrderSettings) -> None:
        self.shard_sizes, self.settings = shard_sizes, order
        self._cache: tuple[int, np.ndarray] | None = None
        self._lock = threading.Lock()

    def __call__(self, epoch: int) -> np.ndarray:
        with self._lock:
            if self._cache is None or self._cache[0] != epoch:
                s = self.settings
                block, window = s.shuffle_block, s.shuffle_window
                self._cache = (epoch, epoch_order(self.shard_sizes, s.seed, epoch, s.shuffle, block, window))
            return self._cache[1]


class SampleBatches:
    """Batches of ``batch_size`` samples of the epoch's order, rank ``rank``'s share
    (:mod:`fastio.pipeline.order`), each made by a :class:`fastio.assembly.producer.BatchProducer` in an
    :class:`fastio.pipeline.epoch.EpochPass`.

    What an epoch's order is comes from four methods a subclass may replace (a mixed loader's
    :class:`fastio.mixing.batches.StreamBatches` does): :meth:`epoch_size`, :meth:`epoch_ids`,
    :meth:`identity` and :meth:`check_kind`; the rank split, the passes and the resume arithmetic are shared.

    Example::

        batches = SampleBatches(source, orders, OrderSettings(), WorkerSettings(), AssemblySettings(8))
        assert len(list(batches.iterate(0, 0))) == batches.num_batches(0)
    """

    KIND: str | None = None  # the state dict's "order": None (absent) for fastio's order of one source
    MISMATCH = "the epoch order would differ"

    def __init__(
        self,
        source: Source,
        orders: Any,
        order: OrderSettings,
        workers: WorkerSettings,
        assembly: AssemblySettings,
        progress: bool = False,
    ) -> None:
        self.source, self.orders, self.order = source, orders, order
        self.workers, self.assembly, self.progress = workers, assembly, progress
        self.kept = KeptWorkers() if workers.persistent else None

    def epoch_size(self) -> int:
        """Samples in an epoch's global order (before the rank split)."""
        return self.source.num_samples

    def epoch_ids(self, epoch: int, start: int) -> np.ndarray:
        """The global order of ``epoch`` (the pass from ``start`` on reads its rank's share of the rest)."""
        return self.orders(epoch)

    def identity(self) -> dict[str, Any]:
        """What a state dict must match for its order to be this loader's."""
        return {**self.order.identity(), "num_samples": self.source.num_samples}

    def check_kind(self, state: dict[str, Any]) -> None:
        """Refuse a state dict of another kind of order (``ValueError``)."""
        if state.get("order") == "sampler":
            raise ValueError(
                "state_dict comes from a loader whose order came from sampler=, batch_sampler= or "
                "generator=; this loader uses fastio's own order (seed=, shuffle=)"
            )
        if state.get("order") is not None:
            raise ValueError(
                f"state_dict comes from a loader whose order is {state['order']!r} (a list of fastio.Stream "
                "mixes streams); this loader reads one source"
            )

    def num_batches(self, epoch: int) -> int:
        n, world = self.epoch_size(), self.order.world_size
        per_rank = n // world if self.order.drop_last else -(-n // world)
        return num_batches(per_rank, self.assembly.batch_size, self.order.drop_last)

    def iterate(self, epoch: int, start: int, skip: Sequence[int] = ()) -> EpochPass:
        o = self.order
        indices = rank_indices(self.epoch_ids(epoch, start), start, o.world_size, o.rank, o.drop_last)
        return EpochPass(
            self.source,
            indices,
            epoch,
            start,
            seed=o.seed,
            drop_last=o.drop_last,
            world_size=o.world_size,
            workers=self.workers,
            assembly=self.assembly,
            progress=self.progress,
            kept=self.kept,
            skip=skip,
        )

    def state_dict(self, epoch: int, start: int, yielded: int) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            **({} if self.KIND is None else {"order": self.KIND}),
            **self.identity(),
            "epoch": epoch,
            "start": start,
            "batches_yielded": yielded,
            "batch_size": self.assembly.batch_size,
            "world_size": self.order.world_size,
            "rank": self.order.rank,
        }

    def resume_point(self, state: dict[str, Any]) -> tuple[int, int]:
        """Where ``state`` left the epoch's order; another world size or batch size splits the remainder.
        What :meth:`identity` names (the seed, shuffle settings, dataset size...) must match, else
        ``ValueError`` naming the first that differs."""
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a {STATE_FORMAT} v{STATE_VERSION} state dict")
        self.check_kind(state)
        for key, mine in self.identity().items():
            if state.get(key) != mine:
                raise ValueError(
                    f"state_dict {key}={state.get(key)!r} but this loader has {key}={mine!r}; {self.MISMATCH}"
                )
        yielded, size = state["batches_yielded"], state["batch_size"]
        start = resume_start(self.epoch_size(), state["start"], state["world_size"], yielded, size)
        return int(state["epoch"]), start
