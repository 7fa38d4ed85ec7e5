"""A :class:`fastio.StreamLoader`'s batches when DataLoader's ``sampler=``, ``batch_sampler=`` or
``generator=`` is given: exactly the indices the (batch) sampler yields, in its batches, as
``torch.utils.data.DataLoader`` would give them.

1. :func:`check_sampler_args` applies DataLoader's own argument rules (and its messages), plus the ones that
   follow from fastio's sources: a source read shard by shard refuses a sampler, and so do the shard-aware
   shuffles (fastio's own order), saying what to use instead.
2. :func:`index_batches` builds the batch sampler as DataLoader does: ``batch_sampler`` itself, else
   ``BatchSampler(sampler, batch_size, drop_last)`` where ``sampler`` defaults to
   ``RandomSampler(generator=generator)`` with ``shuffle=True`` and ``SequentialSampler`` otherwise.
3. Each ``iter()`` first draws one int64 from ``generator`` (torch's global generator when None), as
   DataLoader's iterator draws its base seed, then runs the batch sampler to its end: so the same generator
   state (or ``torch.manual_seed``) gives DataLoader's order, and the generator is left as DataLoader leaves
   it.
4. Ranks: the sampler decides which indices this rank reads (a ``DistributedSampler``), as in DataLoader;
   a rank split given in :class:`fastio.OrderOptions` (``rank=``, ``world_size=``) splits the sampler's
   sequence instead (:class:`RankShare`), the same on every rank's sampler.
5. ``pack=``: the sampler orders the documents, packed into rows (:class:`SamplerOrders`).
6. Resume: :meth:`SamplerBatches.state_dict` counts the epoch's batches handed over; after
   ``load_state_dict`` the next ``iter()`` runs the sampler again and skips that many batches. That is exact
   only when the sampler repeats its order: a ``SequentialSampler``, a ``DistributedSampler`` after the
   same ``set_epoch``, or a random sampler whose generator state the user restored first.

Example::

    batches = SamplerBatches(source, index_batches(len(ds), 8, False, False, sampler, None, None),
                             None, 0, WorkerSettings(), AssemblySettings(8))
    for batch in batches.iterate(epoch=0, start=0):
        ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from fastio.pipeline.batches import STATE_FORMAT, STATE_VERSION
from fastio.pipeline.epoch import EpochPass
from fastio.pipeline.order import num_batches, rank_indices
from fastio.pipeline.settings import AssemblySettings, WorkerSettings
from fastio.sources import Source
from fastio.workers.kept import KeptWorkers

__all__ = [
    "RankShare",
    "SamplerBatches",
    "SamplerOrders",
    "check_sampler_args",
    "index_batches",
    "index_sampler",
]


def check_sampler_args(
    *,
    shuffle: bool | str,
    batch_size: int,
    drop_last: bool,
    sampler: Any,
    batch_sampler: Any,
    generator: torch.Generator | None,
    ranks_given: bool,
    packed: bool,
    source: Source,
) -> bool:
    """DataLoader's checks of ``sampler``/``batch_sampler``/``shuffle`` and fastio's own; True when the
    loader's batches come from a sampler (any of ``sampler``, ``batch_sampler``, ``generator`` given).

    Example::

        check_sampler_args(shuffle=False, batch_size=4, drop_last=False, sampler=None, batch_sampler=None,
                           generator=None, ranks_given=False, packed=False, source=source)  # False
    """
    if sampler is not None and shuffle:
        why = (
            f": shuffle={shuffle!r} is fastio's own order, drawn from seed=, and the sampler's indices are "
            "the sampler's order; pass one of the two"
            if isinstance(shuffle, str)
            else ""
        )
        raise ValueError(f"sampler option is mutually exclusive with shuffle{why}")
    if batch_sampler is not None and (batch_size != 1 or shuffle or sampler is not None or drop_last):
        raise ValueError(
            "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
        )
    if sampler is None and batch_sampler is None and generator is None:
        return False
    asked = (
        "sampler=" if sampler is not None else "batch_sampler=" if batch_sampler is not None else "generator="
    )
    if shuffle in ("shard", "window", "parts"):
        raise ValueError(
            f"{asked} with shuffle={shuffle!r}: the shard-aware shuffles are fastio's own order, drawn from "
            "seed=; use shuffle=True with generator= (DataLoader's RandomSampler) or shuffle='shard' with "
            "seed="
        )
    if packed and batch_sampler is not None:
        raise ValueError(
            "batch_sampler= with pack=: packed rows are cut from a stream of documents, not from batches of "
            "them; pass sampler= (the documents' order) with batch_size= (rows per batch)"
        )
    if source.requires_shard_order:
        raise ValueError(
            f"{asked} on {source.name}, a source read shard by shard: a sampler's indices would fetch a "
            "whole shard for nearly every sample; use shuffle='shard' with seed= (and OrderOptions(rank=, "
            "world_size=))"
        )
    if ranks_given and isinstance(sampler, DistributedSampler):
        raise ValueError(
            "sampler=DistributedSampler(...) with OrderOptions(rank=, world_size=): both split the indices "
            "across ranks; keep one (the DistributedSampler's num_replicas= and rank=, or OrderOptions)"
        )
    return True


def index_sampler(
    num_samples: int, shuffle: bool, sampler: Iterable[int] | None, generator: torch.Generator | None
) -> Iterable[int]:
    """The sampler DataLoader would use: ``sampler``, else ``RandomSampler(generator=)`` with ``shuffle``,
    else ``SequentialSampler``.

    Example::

        list(index_sampler(3, False, None, None)) == [0, 1, 2]
    """
    if sampler is not None:
        return sampler
    indices = range(num_samples)
    return RandomSampler(indices, generator=generator) if shuffle else SequentialSampler(indices)


def index_batches(
    num_samples: int,
    batch_size: int,
    shuffle: bool,
    drop_last: bool,
    sampler: Iterable[int] | None,
    batch_sampler: Iterable[list[int]] | None,
    generator: torch.Generator | None,
    ranks: tuple[int, int] = (0, 1),
) -> Iterable[list[int]]:
    """The batch sampler DataLoader would use for these arguments (see the module docstring, step 2); with
    ``ranks = (rank, world_size)``, rank ``rank``'s share of it (:class:`RankShare`).

    Example::

        list(index_batches(5, 2, False, False, None, None, None)) == [[0, 1], [2, 3], [4]]
    """
    if batch_sampler is None:
        batch_sampler = BatchSampler(
            index_sampler(num_samples, shuffle, sampler, generator),
            batch_size,
            drop_last,  # type: ignore[arg-type]
        )
    if ranks[1] == 1:
        return batch_sampler
    return RankShare(batch_sampler, ranks[0], ranks[1])


class RankShare:
    """Rank ``rank``'s share of a sampler's indices (``OrderOptions(rank=, world_size=)`` with a sampler):
    the sampler's sequence split as ``DistributedSampler`` splits a dataset (rank ``r`` takes positions
    ``r, r + W, ...``; ``drop_last=False`` pads by repeating the first, ``True`` cuts to equal counts), then
    batched as DataLoader batches it; a ``batch_sampler``'s batches are dealt the same way, whole. Every
    rank's sampler must yield the same sequence (seed its generator alike on every rank).

    Example::

        list(RankShare(BatchSampler(range(10), 2, False), rank=1, world_size=2)) == [[1, 3], [5, 7], [9]]
    """

    def __init__(self, batch_sampler: Any, rank: int, world_size: int) -> None:
        self.batch_sampler, self.rank, self.world_size = batch_sampler, rank, world_size

    def __iter__(self) -> Iterator[list[int]]:
        inner = self.batch_sampler
        if isinstance(inner, BatchSampler):  # split the samples, then batch them
            order = np.fromiter((int(i) for i in inner.sampler), dtype=np.int64)
            mine = rank_indices(order, 0, self.world_size, self.rank, inner.drop_last).tolist()
            size = inner.batch_size
            stop = len(mine) - len(mine) % size if inner.drop_last else len(mine)
            return iter([mine[i : i + size] for i in range(0, stop, size)])
        batches = [list(batch) for batch in inner]
        if not batches:
            return iter([])
        per_rank = -(-len(batches) // self.world_size)
        padded = batches + [
            batches[i % len(batches)] for i in range(per_rank * self.world_size - len(batches))
        ]
        return iter(padded[self.rank :: self.world_size])

    def __len__(self) -> int:
        inner = self.batch_sampler
        if isinstance(inner, BatchSampler):
            n, world = len(inner.sampler), self.world_size  # type: ignore[arg-type]
            per_rank = n // world if inner.drop_last else -(-n // world)
            return num_batches(per_rank, inner.batch_size, inner.drop_last)
        return -(-len(inner) // self.world_size)


class SamplerOrders:
    """``pack=`` with a sampler: the documents' order of an epoch is the sampler's indices (run once per epoch
    by the packer, which plans the epoch's rows from them); what :class:`fastio.assembly.pack.TokenPacker`
    takes as ``orders``.

    Example::

        orders = SamplerOrders(SequentialSampler(range(4))); orders(0).tolist() == [0, 1, 2, 3]
    """

    def __init__(self, sampler: Iterable[int]) -> None:
        self.sampler = sampler

    def __call__(self, epoch: int) -> np.ndarray:
        return np.fromiter((int(i) for i in self.sampler), dtype=np.int64)

    def identity(self) -> dict[str, Any]:
        """What a packed state dict records of the order: that a sampler gave it, and which."""
        return {"order": "sampler", "sampler": type(self.sampler).__name__}


class SamplerBatches:
    """Batches of exactly the indices a batch sampler yields (see the module docstring); a
    :class:`fastio.pipeline.batches.Batches`.

    Example::

        batches = SamplerBatches(source, BatchSampler(sampler, 8, False), None, 0, WorkerSettings(),
                                 AssemblySettings(8))
        assert len(list(batches.iterate(0, 0))) == batches.num_batches(0)
    """

    def __init__(
        self,
        source: Source,
        batch_sampler: Iterable[list[int]],
        generator: torch.Generator | None,
        seed: int,
        workers: WorkerSettings,
        assembly: AssemblySettings,
        progress: bool = False,
        world_size: int = 1,
    ) -> None:
        self.source, self.batch_sampler, self.generator, self.seed = source, batch_sampler, generator, seed
        self.world_size = world_size
        self.workers, self.assembly, self.progress = workers, assembly, progress
        self.kept = KeptWorkers() if workers.persistent else None
        self._base_seed_drawn = False

    def num_batches(self, epoch: int) -> int:
        if not hasattr(self.batch_sampler, "__len__"):
            raise TypeError(f"len(): {type(self.batch_sampler).__name__} has no __len__")
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def iterate(self, epoch: int, start: int, skip: Sequence[int] = ()) -> EpochPass:
        # DataLoader's iterator draws its base seed before the sampler's first draw (with persistent
        # workers only when it is first made): so must we.
        if self.kept is None or not self._base_seed_drawn:
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            self._base_seed_drawn = True
        batches = [[int(i) for i in batch] for batch in self.batch_sampler][start:]
        sizes = [len(batch) for batch in batches]
        bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        indices = np.fromiter((i for batch in batches for i in batch), dtype=np.int64, count=int(bounds[-1]))
        n = self.source.num_samples
        if len(indices) and (indices.min() < 0 or indices.max() >= n):
            bad = int(indices[(indices < 0) | (indices >= n)][0])
            name = type(self.batch_sampler).__name__
            raise IndexError(f"{name} gave index {bad}, outside the {n} samples of {self.source.name}")
        assembly = self.assembly
        if max(sizes, default=0) > assembly.batch_size:  # a batch sampler's batches size the buffers
            assembly = dataclasses.replace(assembly, batch_size=max(sizes))
        return EpochPass(
            self.source,
            indices,
            epoch,
            start,
            seed=self.seed,
            drop_last=False,
            world_size=1,
            workers=self.workers,
            assembly=assembly,
            progress=self.progress,
            bounds=bounds,
            kept=self.kept,
            skip=skip,
        )

    def state_dict(self, epoch: int, start: int, yielded: int) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "order": "sampler",
            "sampler": type(self.batch_sampler).__name__,
            "num_samples": self.source.num_samples,
            "world_size": self.world_size,
            "epoch": epoch,
            "batches_done": start + yielded,
        }

    def resume_point(self, state: dict[str, Any]) -> tuple[int, int]:
        """``(epoch, batches to skip)``; a state of another kind of order or dataset size is refused."""
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a {STATE_FORMAT} v{STATE_VERSION} state dict")
        if state.get("order") != "sampler":
            raise ValueError(
                "state_dict comes from a loader with fastio's own order (seed=, shuffle=); this loader's "
                "order comes from its sampler"
            )
        if state["num_samples"] != self.source.num_samples:
            raise ValueError(
                f"state_dict num_samples={state['num_samples']!r} but this loader has "
                f"num_samples={self.source.num_samples!r}"
            )
        if state.get("world_size", 1) != self.world_size:
            raise ValueError(
                f"state_dict world_size={state.get('world_size', 1)!r} but this loader splits its sampler "
                f"across world_size={self.world_size!r}: a sampler's order resumes on the same world size"
            )
        return int(state["epoch"]), int(state["batches_done"])
