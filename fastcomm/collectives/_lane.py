"""The phase-2 lane: a thread and a second process group per user process group.

An exchange of two dependent collectives (two-phase, two allreduces) issues its first on the caller's
group and thread; the lane issues the second as soon as the first arrives, on a second process group over
the same ranks that nothing else uses, in the order the exchanges were submitted. Each group then sees one
thread issue collectives in one order, the same on every rank, and no second collective waits for the
caller's next call (in the DDP hooks, on a 1 Gbit/s link that idle gap was ~55 ms of a 0.35 s step).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from fastcomm.collectives._threads import OrderedWorker
from fastcomm.collectives.errors import PeerCollectiveError

__all__ = [
    "Lane", "SecondCollective", "finish_on_lane", "lane_for", "release_lane", "timeout_of", "wait_for_peers",
]  # fmt: skip


class SecondCollective(Protocol):
    """An exchange whose first collective is in flight; :meth:`finish` issues its second."""

    future: torch.futures.Future

    def finish(self, group: dist.ProcessGroup | None = None) -> None:
        """Wait for the first collective, then issue the second over ``group`` (default: the first's)."""
        ...


def finish_on_lane(pending: SecondCollective, group: dist.ProcessGroup) -> None:
    """``pending.finish`` on a lane's thread and group; a failure reaches the waiter through the future."""
    try:
        pending.finish(group)
    except Exception as error:  # noqa: BLE001 - handed to whoever waits on the exchange
        if not pending.future.done():
            pending.future.set_exception(error)


class Lane:
    """A thread that runs jobs in submission order, and the process group only it issues collectives on.

    Phase 1 stays on the user's group, issued from DDP's hook thread like every other collective there.
    """

    def __init__(self, parent: dist.ProcessGroup) -> None:
        ranks = dist.get_process_group_ranks(parent)
        # Every rank makes the lane at the same point of its collectives on ``parent``; behind a phase 1 in
        # flight, this waits for it.
        wait_for_peers(parent, "phase-2 lane barrier")
        self.group = dist.new_group(
            ranks=ranks,
            backend=dist.get_backend(parent),
            # Only the parent's ranks run this hook, so a subgroup's lane must synchronize locally. A lane
            # over every rank is made by every rank, at the same point of each one's sequence of groups, so
            # it uses the plain path: the local one (torch 2.13, gloo) hangs or times out when the ranks
            # made different numbers of groups they are not members of before it.
            use_local_synchronization=len(ranks) != dist.get_world_size(),
            group_desc="fastcomm_phase2",
            timeout=timeout_of(parent),
        )
        # jobs report their own failures through their bucket's future; the worker is stopped at exit
        self.worker = OrderedWorker("fastcomm-phase2")

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the lane's thread after the jobs submitted before it."""
        self.worker.submit(job)


def wait_for_peers(group: dist.ProcessGroup | None, where: str = "wait_for_peers barrier") -> None:
    """Return once every rank of ``group`` has called this; raise at once where a peer is dead.

    A one-element CPU all-reduce: gloo fails it on the closed connection of a killed peer, where
    ``dist.new_group``'s own barrier on the store would wait out the whole timeout (gloo's default: 30
    minutes). What fastcomm runs before it makes a group at first use (the phase-2 lane, the node groups of
    hierarchical hooks), every rank at the same point of its collectives on ``group``. A group without a CPU
    backend (NCCL only) is left alone: there a dead peer is only ever seen by the timeout.

    Args:
        group: the process group (``None``: the default one).
        where: what the barrier is for, named by the error.

    Raises:
        PeerCollectiveError: a peer died, was stopped past the timeout, or the link dropped (``where``
            names the barrier; the original error is its ``reason``).

    Example::

        wait_for_peers(None)   # the default group
    """
    try:
        (group if group is not None else dist.group.WORLD)._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):  # no CPU backend on this group
        return
    try:
        dist.all_reduce(torch.zeros(1), group=group)
    except Exception as error:
        raise PeerCollectiveError(where, None, error) from error


def timeout_of(group: dist.ProcessGroup) -> timedelta | None:
    """The collective timeout of ``group``'s CPU backend, or ``None`` (new_group's default) if unknown.

    The lane's group takes its parent's: a group made without one gets gloo's 30 minutes, and a peer
    stopped between phase 1 and phase 2 would hang the survivor that long instead of failing.
    """
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


# process group -> its lane, or None where none could be made. The entry keeps the group alive until exit
# (destroy_process_group shuts both groups down). A version holding groups weakly, ending a lane's thread
# when its group was freed, aborted ranks at exit in our tests.
_LANES: dict[dist.ProcessGroup, Lane | None] = {}
_LANES_LOCK = threading.Lock()


def lane_for(process_group: dist.ProcessGroup | None) -> Lane | None:
    """The lane of ``process_group`` (``None``: the default group), made at first use; ``None`` if impossible.

    A group that cannot have a lane (no second group can be made over it) is remembered (one warning, no
    retry per bucket); that is the same on every rank, so all ranks fall back to finishing in the next hook
    call together. A dead peer is not that: its :class:`PeerCollectiveError` is raised, and nothing is
    remembered.

    Raises:
        PeerCollectiveError: a peer failed the barrier before the lane's group is made.
    """
    parent = process_group if process_group is not None else dist.group.WORLD
    with _LANES_LOCK:
        if parent in _LANES:
            return _LANES[parent]
        lane: Lane | None
        try:
            lane = Lane(parent)
        except PeerCollectiveError:
            raise
        except (RuntimeError, ValueError, KeyError) as error:  # KeyError: a group dist did not make
            warnings.warn(
                f"fastcomm: no second process group for overlapped phase 2 ({error}); phase 2 is issued "
                f"from the next hook call instead",
                RuntimeWarning,
                stacklevel=3,
            )
            lane = None
        _LANES[parent] = lane
        return lane


def release_lane(process_group: dist.ProcessGroup) -> None:
    """Forget ``process_group``'s entry: a group its owner replaced and will not use again.

    torchft makes a new process group at every quorum; without this, each old one stayed in the cache
    (with its ``None``: torchft's groups get no lane) for the rest of the run. A lane that was made ends
    its thread after the jobs already submitted; its group is left to its owner.

    Example::

        release_lane(old_quorum_group)      # fastcomm.ft.ManagedExchange does it at each new quorum
    """
    with _LANES_LOCK:
        lane = _LANES.pop(process_group, None)
    if lane is not None:
        lane.worker.stop(timeout=0.0)
