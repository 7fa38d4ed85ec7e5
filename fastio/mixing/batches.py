"""A mixed :class:`fastio.StreamLoader`'s batches: :class:`StreamBatches` (a
:class:`fastio.pipeline.batches.Batches`) walks the epoch's mixed list (:mod:`fastio.mixing.schedule`) with
the single-source machinery: the rank split and resume arithmetic of :mod:`fastio.pipeline.order` and one
:class:`fastio.pipeline.epoch.EpochPass` per pass.

Resume: the state dict records the epoch, the position reached and the layout ``(world_size, batch_size)``
the epoch's list was laid out for. A resumed epoch keeps that list, so at any ``num_workers`` the batches are
the uninterrupted run's, and at another world size or batch size the rest of the list is split anew: nothing
seen twice, nothing skipped beyond ``drop_last``'s tail. The next epoch is laid out for the loader's own.

Example::

    batches = StreamBatches(source, orders, OrderSettings(seed=0), WorkerSettings(), AssemblySettings(8))
    for batch in batches.iterate(epoch=0, start=0):
        ...
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import numpy as np

from fastio.assembly.pack import Pack, TokenPacker
from fastio.mixing.schedule import MixedOrders
from fastio.mixing.source import MixedSource
from fastio.mixing.stream import MIX_MODES, Stream
from fastio.pipeline.batches import Batches, SampleBatches
from fastio.pipeline.settings import AssemblySettings, OrderSettings, WorkerSettings

__all__ = ["StreamBatches", "mixed_batches", "mixing_identity"]


def mixing_identity(source: MixedSource, orders: MixedOrders) -> dict[str, Any]:
    """What a mixed loader's state dict records so that a resume on other streams is refused.

    Example::

        mixing_identity(source, orders)["stream_weights"]   # [0.7, 0.3]
    """
    return {
        "stream_names": list(source.names),
        "stream_sizes": orders.sizes.tolist(),
        "stream_weights": list(orders.weights),
        "epoch_size": orders.epoch_size,
        "mix": orders.mix,
    }


class StreamBatches(SampleBatches):
    """Batches of ``batch_size`` positions of the epoch's mixed list, rank ``rank``'s share: a
    :class:`fastio.pipeline.batches.SampleBatches` whose epoch is the mixed list, laid out for ``(world_size,
    batch_size)``, a resumed epoch keeping its own layout.

    Example::

        batches = StreamBatches(source, orders, OrderSettings(), WorkerSettings(), AssemblySettings(8))
        assert len(list(batches.iterate(0, 0))) == batches.num_batches(0)
    """

    KIND = "streams"
    MISMATCH = "the mixed epoch would differ"

    def __init__(
        self,
        source: MixedSource,
        orders: MixedOrders,
        order: OrderSettings,
        workers: WorkerSettings,
        assembly: AssemblySettings,
        progress: bool = False,
    ) -> None:
        super().__init__(source, orders, order, workers, assembly, progress)
        self._resumed: tuple[int, tuple[int, int]] | None = None  # (epoch, layout) of a loaded state

    def epoch_size(self) -> int:
        return len(self.orders)

    def epoch_ids(self, epoch: int, start: int) -> np.ndarray:
        return self.orders(epoch, self.layout(epoch, start))

    def identity(self) -> dict[str, Any]:
        return {**self.order.identity(), **mixing_identity(self.source, self.orders)}

    def check_kind(self, state: dict[str, Any]) -> None:
        if state.get("order") != self.KIND:
            raise ValueError(
                "state_dict comes from a loader of one source; this loader mixes streams "
                "(a list of fastio.Stream): its epochs are another list of samples"
            )

    def layout(self, epoch: int, start: int) -> tuple[int, int]:
        """The ``(world_size, batch_size)`` epoch ``epoch``'s list is laid out for: a resumed epoch's own,
        else this loader's.

        Example::

            batches.layout(0, 0) == (batches.order.world_size, batches.assembly.batch_size)
        """
        if start and self._resumed is not None and self._resumed[0] == epoch:
            return self._resumed[1]
        return self.order.world_size, self.assembly.batch_size

    def state_dict(self, epoch: int, start: int, yielded: int) -> dict[str, Any]:
        world, batch = self.layout(epoch, start)
        return {
            **super().state_dict(epoch, start, yielded),
            "layout_world_size": world,
            "layout_batch_size": batch,
        }

    def resume_point(self, state: dict[str, Any]) -> tuple[int, int]:
        """Where ``state`` left the epoch's mixed list; the seed, shuffle settings, streams (names, sizes,
        weights), ``epoch_size`` and ``mix`` must match, else ``ValueError`` naming the first that differs."""
        epoch, start = super().resume_point(state)
        self._resumed = (epoch, (int(state["layout_world_size"]), int(state["layout_batch_size"])))
        return epoch, start


def mixed_batches(
    source: MixedSource,
    streams: list[Stream],
    *,
    mix: str,
    epoch_size: int | None,
    pack: Pack | None,
    order: OrderSettings,
    workers: WorkerSettings,
    assembly: AssemblySettings,
    progress: bool = False,
) -> Batches:
    """A mixed loader's batches: :class:`StreamBatches`, or with ``pack=`` a
    :class:`fastio.assembly.pack.TokenPacker` over the mixed list of documents (laid out so that each rank's
    documents are a contiguous stretch of the interleave). Checks ``mix`` and ``epoch_size``.

    Example::

        batches = mixed_batches(source, streams, mix="sample", epoch_size=None, pack=None,
                                order=OrderSettings(), workers=WorkerSettings(), assembly=AssemblySettings(8))
    """
    if mix not in MIX_MODES:
        raise ValueError(f"mix must be one of {MIX_MODES}, got {mix!r}")
    size = source.num_samples if epoch_size is None else epoch_size
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ValueError(f"epoch_size must be an int >= 1 (samples per epoch, all streams), got {size!r}")
    shard_sizes = [s.shard_sizes for s in source.sources]
    orders = MixedOrders(shard_sizes, [s.weight for s in streams], int(size), mix, order)
    if pack is None:
        return StreamBatches(source, orders, order, workers, assembly, progress)
    if mix == "batch":
        raise ValueError(
            'mix="batch" with pack=: a packed row concatenates documents, so rows mix streams anyway; '
            'use mix="sample" (each rank\'s documents are drawn in proportion)'
        )
    documents = functools.partial(orders, layout=(order.world_size, 1))
    return TokenPacker(
        source, pack, documents, order=order, workers=workers, assembly=assembly,
        identity=mixing_identity(source, orders),
    )  # fmt: skip
