"""Compressed all-reduces through a ``torchft.Manager``, as its own ``Manager.allreduce`` does them.

torchft remakes its process group at every quorum (a replica left or joined). :class:`ManagedExchange` asks
the Manager for the group of the current quorum at each call and runs :func:`fastcomm.collectives.all_reduce`
on it, so the DDP hooks' and DiLoCo's exchanges (two-phase for blockwise compressors, an all-gather of
payloads for top-k, two rounds for PowerSGD) travel unchanged. Per call:

1. wait for the quorum; at the first exchange of a quorum, check that every replica's exchange has the same
   settings (one small all-gather): :class:`~fastcomm.ft.CompressorMismatchError` if not;
2. a replica that does not take part in this step (torchft's asynchronous quorum, while it heals) sends
   zeros and keeps its error feedback for later;
3. the compressed all-reduce sums over the quorum, and the sum is divided by the replicas taking part;
4. a failed collective (a peer killed inside the exchange, the group's timeout) is reported to the Manager
   (``manager.report_error``) instead of raised: the call returns ``False``, ``manager.should_commit()``
   then answers ``False`` on every replica that saw it, and the next quorum leaves the dead peer out.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives import Residual, Traffic, all_gather_flat, all_reduce, release_lane
from fastcomm.compress.protocol import AllreduceCompressor, Compressor
from fastcomm.ft.errors import CompressorMismatchError, NoProcessGroupError, require_torchft

__all__ = ["ManagedExchange", "process_group_of", "refit"]


def process_group_of(manager: Any) -> Any:
    """The torchft process group a ``torchft.Manager`` reconfigures at every quorum.

    Raises :class:`~fastcomm.ft.NoProcessGroupError` if it holds none.

    Example::

        pg = process_group_of(manager)      # a torchft.ProcessGroupGloo, say
    """
    pg = getattr(manager, "_pg", None)
    if not isinstance(pg, require_torchft().process_group.ProcessGroup):
        raise NoProcessGroupError(
            f"the torchft.Manager holds no torchft process group (got {type(pg).__name__}): build it with "
            f"pg=torchft.ProcessGroupGloo() (CPU) or torchft.ProcessGroupNCCL() (CUDA), or use "
            f"fastcomm.ft.connect(), which does"
        )
    return pg


def refit(residual: Residual) -> None:
    """Fold the segment residual of a two-phase exchange into ``worker``, for a new quorum.

    A new quorum gives this replica another rank, or cuts the tensor into other segments; what it owed on
    its old segment (:meth:`~fastcomm.collectives.Residual.owed`) stays owed, now by ``worker`` alone.

    Example::

        refit(residual)      # after a quorum of 3 replicas became one of 2
    """
    if residual.server is None or residual.worker is None:
        return
    owed = residual.owed(0, residual.worker.numel())
    residual.load_state_dict({"worker": owed.to(residual.worker.dtype)})


class ManagedExchange:
    """Compressed all-reduces on the process group of a ``torchft.Manager``'s current quorum.

    Args:
        manager: the ``torchft.Manager`` of this replica (``use_async_quorum`` either way).
        fingerprint: what must be equal on every replica of a quorum (the compressor's settings, say); it is
            compared at the first exchange of each quorum.
        device: where the exchanged tensors are; the comparison's tensors go there too (a
            ``torchft.ProcessGroupNCCL`` takes CUDA tensors only).

    Example::

        exchange = ManagedExchange(manager, fingerprint=repr(compressor))
        manager.start_quorum()
        ok = exchange.all_reduce(grad, compressor, residual=residual, seed=manager.current_step())
        if manager.should_commit():          # False on every replica where an exchange failed
            optimizer.step()
    """

    def __init__(self, manager: Any, fingerprint: str = "", device: str | torch.device = "cpu") -> None:
        self.manager = manager
        self.pg = process_group_of(manager)
        self.fingerprint = fingerprint
        self.device = torch.device(device)
        self.traffic = Traffic()
        self.failures = 0
        self._checked: dist.ProcessGroup | None = None
        self._group: dist.ProcessGroup | None = None  # the last quorum's group seen
        self._fitted: weakref.WeakKeyDictionary[Residual, dist.ProcessGroup] = weakref.WeakKeyDictionary()

    def group(self) -> dist.ProcessGroup:
        """The current quorum's process group (waits for the quorum).

        A new quorum's group replaces the last one for good (torchft aborts it): its entry in the
        collectives' lane cache is dropped (:func:`fastcomm.collectives.release_lane`).
        """
        self.manager.wait_quorum()
        group = self.pg.parent
        if group is not self._group:
            if self._group is not None:
                release_lane(self._group)
            self._group = group
        return group

    def begin(self, prepare: Callable[[dist.ProcessGroup], None] | None = None) -> dist.ProcessGroup | None:
        """The current quorum's group, its settings checked and ``prepare(group)`` run; ``None`` (reported
        to the Manager) if the quorum or either failed, or an earlier exchange of this step did.

        Raises:
            CompressorMismatchError: the replicas' ``fingerprint`` differ (:meth:`check`).
        """
        manager = self.manager
        if manager.errored():
            return None
        try:
            group = self.group()
            self.check(group)
            if prepare is not None:
                prepare(group)
        except CompressorMismatchError:
            raise
        except Exception as error:  # noqa: BLE001 - torchft's contract: report, never raise mid-step
            manager.report_error(error)
            self.failures += 1
            return None
        return group

    def check(self, group: dist.ProcessGroup) -> None:
        """At the first exchange on ``group``: every replica's ``fingerprint`` must be this one's."""
        if self._checked is group:
            return
        mine = zlib.crc32(self.fingerprint.encode())
        gathered = torch.empty(group.size(), dtype=torch.int64, device=self.device)
        all_gather_flat(gathered, torch.tensor([mine], dtype=torch.int64, device=self.device), group=group)
        self._checked = group
        values = gathered.tolist()
        if any(value != mine for value in values):
            raise CompressorMismatchError(
                f"the replicas of this quorum exchange with different settings (fingerprints "
                f"{values}; this replica's {mine} is {self.fingerprint!r}): start every "
                f"replica with the same method and options"
            )

    def all_reduce(
        self,
        tensor: Tensor,
        compressor: Compressor | AllreduceCompressor | None,
        *,
        residual: Residual | None = None,
        seed: int = 0,
        shapes: list[torch.Size] | None = None,
    ) -> bool:
        """The mean over the replicas taking part of ``tensor``, in place; ``False`` if it failed.

        Args:
            tensor: a contiguous float tensor, the same size on every replica.
            compressor: a ``fastcomm.compress`` compressor, or ``None`` for a plain fp32 sum.
            residual: this replica's error feedback of ``tensor`` (kept when the replica sits out).
            seed: the stochastic-rounding stream, the same on every replica (the step, say).
            shapes: the parameter shapes ``tensor`` holds (PowerSGD).

        Returns:
            ``True`` when ``tensor`` holds the mean; ``False`` when the exchange failed (reported to the
            Manager, ``tensor`` undefined) or an earlier one of this step did.
        """
        manager = self.manager
        group = self.begin()
        if group is None:
            return False
        participants = manager.num_participants()
        if not manager.is_participating():
            tensor.zero_()
            residual = None
        elif residual is not None and self._fitted.get(residual) is not group:
            refit(residual)
            self._fitted[residual] = group
        try:
            if compressor is None:
                dist.all_reduce(tensor, group=group)
            else:
                all_reduce(tensor, compressor, residual=residual, op=dist.ReduceOp.SUM, group=group,
                           seed=seed, shapes=shapes, traffic=self.traffic)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - torchft's contract: report, never raise mid-step
            manager.report_error(error)
            self.failures += 1
            return False
        tensor.div_(max(participants, 1))
        return True
