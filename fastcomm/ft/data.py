"""Each replica's share of one sample order, re-split at every quorum: no sample lost or read twice.

All replicas read one global order (a ``fastio.StreamLoader``'s epoch order, the same seed everywhere).
:class:`ReplicaData` keeps the position up to which every replica's batches were *committed* (their
gradients or pseudo-gradients reached the weights: ``manager.should_commit()`` said so), the same on every
replica, and healed like the weights. At each quorum the rest of the epoch is split over the replicas
taking part, by their rank in the quorum (``loader.state_dict()`` at another world size resumes there):

* ``n`` replicas in a quorum, replica ``i`` reads samples ``i, i + n, i + 2n, ...`` of the order from the
  committed position on (``batch_size`` of them per step, the ``DistributedSampler`` split);
* a step or sync that commits moves the committed position past what all ``n`` read in it;
* one that fails (a peer died inside it) is read again, by the replicas of the next quorum, from the
  committed position: what the dead replica had read since the last commit is read again by a survivor;
* a replica that joins heals the committed position from a peer and reads its share of the new split.

So every sample of the order reaches the weights exactly once, whoever comes and goes. fastcomm never
imports fastio: ``make_loader(rank, world_size)`` builds the loader (anything with ``state_dict``,
``load_state_dict`` and iteration).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastcomm.ft.errors import AsyncQuorumError

__all__ = ["ReplicaData"]


class ReplicaData:
    """This replica's batches under a ``torchft.Manager``: its share of the order, from the committed point.

    Args:
        make_loader: ``(rank, world_size) -> loader``; the loader of replica ``rank`` of ``world_size``
            (``fastio.StreamLoader(path, ..., order=fastio.OrderOptions(rank=rank, world_size=world_size))``),
            the same order (seed, shuffle, batch size) on every replica.

    Example::

        data = fastcomm.ft.ReplicaData(lambda rank, world: fastio.StreamLoader(
            "data", batch_size=8, shuffle=True, seed=0,
            order=fastio.OrderOptions(rank=rank, world_size=world)))
        manager.start_quorum(); data.split(manager)
        batch = data.next()
        ...
        data.commit() if manager.should_commit() else data.rollback()
    """

    def __init__(self, make_loader: Callable[[int, int], Any]) -> None:
        self.make_loader = make_loader
        self.committed: dict[str, Any] | None = None  # the loader position every replica committed
        self.rank, self.world_size = 0, 1
        self.loader: Any = None
        self._batches: Iterator[Any] | None = None
        self._quorum: tuple[int, int] | None = None

    def split(self, manager: Any) -> None:
        """After a quorum: read this replica's share of the rest of the order from the committed position
        (a new loader when the quorum's size or this replica's rank in it changed)."""
        if getattr(manager, "_use_async_quorum", False):
            raise AsyncQuorumError(
                "fastcomm.ft.ReplicaData needs torchft.Manager(..., use_async_quorum=False): a replica still "
                "healing takes no share of the samples"
            )
        quorum = (int(manager.participating_rank()), int(manager.num_participants()))
        if quorum != self._quorum or self._batches is None:
            self._quorum = quorum
            self.rank, self.world_size = quorum
            self._restart()

    def next(self) -> Any:
        """This replica's next batch (a new epoch of the loader when one ends)."""
        if self._batches is None:
            self._restart()
        assert self._batches is not None
        try:
            return next(self._batches)
        except StopIteration:
            self.loader.set_epoch(self.loader.epoch + 1)
            self._batches = iter(self.loader)
            return next(self._batches)

    def commit(self) -> None:
        """The batches read since the last commit reached the weights (on every replica of the quorum)."""
        if self.loader is not None:
            self.committed = self.loader.state_dict()

    def rollback(self) -> None:
        """They did not: read them again from the committed position (at the next :meth:`split` or now)."""
        self._batches = None

    def _restart(self) -> None:
        self.loader = self.make_loader(self.rank, self.world_size)
        if self.committed is not None:
            self.loader.load_state_dict(self.committed)
        self._batches = iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """The committed position (the same on every replica)."""
        return {"committed": self.committed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Heal the committed position from a peer; the next :meth:`split` reads this replica's share."""
        self.committed = state_dict["committed"]
        self._batches = None
