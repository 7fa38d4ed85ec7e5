"""The node topology of hierarchical compression: ``node_size``, the sub-groups, and their issuing threads.

Ranks ``n * L .. n * L + L - 1`` form node ``n`` (torchrun's numbering: ``LOCAL_RANK = rank % L``). Each
rank takes part in three groups, made once per ``node_size`` by every rank in the same order (a plain
``dist.new_group`` over the whole world for every group, the rank a member or not, so that no rank's group
history differs from another's: the local-synchronization path hangs then, see
:func:`fastcomm.collectives.lane_for`):

* ``reduce_group``: the ranks of this rank's node; the dense reduce-scatter, issued from DDP's hook thread.
* ``cross_group``: the ranks with this rank's local rank on every node; the compressed exchange of the
  shard, issued from :attr:`NodeGroups.cross_worker` in bucket order.
* ``phase2_group``: the cross-node ranks again; the second collective of a two-phase exchange, issued
  from :attr:`NodeGroups.phase2_worker` in bucket order (as the phase-2 lane does for flat hooks).
* ``gather_group``: the ranks of the node again; the all-gather of the reduced shards, issued from
  :attr:`NodeGroups.gather_worker` in bucket order.

Each group sees one thread issue its collectives, in bucket order, the same on every rank, so the
collective order is deterministic without any collective issued from a callback.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch.distributed as dist

from fastcomm.collectives import OrderedWorker, timeout_of, wait_for_peers
from fastcomm.hooks.engine.options import require_int

__all__ = ["NodeGroups", "OrderedWorker", "check_node_size", "node_groups", "resolve_node_size"]


def check_node_size(node_size: int | None) -> int | None:
    """``node_size`` validated: ``None`` (from ``LOCAL_WORLD_SIZE``) or a positive int.

    Raises:
        ValueError: not ``None`` and not an int of at least 1 (a bool is not one).
    """
    if node_size is None:
        return None
    return require_int("node_size", node_size, minimum=1)


def resolve_node_size(node_size: int | None, process_group: dist.ProcessGroup | None) -> int:
    """The ranks per node the hook uses: 1 (flat) or ``L > 1`` with at least two nodes.

    1. ``node_size=None``: ``LOCAL_WORLD_SIZE`` when it is set, above 1, divides the world size and
       leaves at least two nodes, on the default group; otherwise flat (1).
    2. An explicit ``node_size``: it must divide the world size; ``node_size`` 1 or the world size (one
       node) is flat.

    Raises:
        ValueError: an explicit ``node_size > 1`` that does not divide the world size, or with a
            ``process_group`` other than the default group.
    """
    world_size = dist.get_world_size()
    whole_world = process_group is None or dist.get_world_size(process_group) == world_size
    if node_size is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        size = int(local) if local.isdigit() else 1
        if size > 1 and whole_world and world_size % size == 0 and world_size > size:
            return size
        return 1
    if node_size > 1 and not whole_world:
        raise ValueError(
            f"node_size={node_size} needs the default process group (hierarchical compression builds its "
            f"node groups over every rank); got a process group of {dist.get_world_size(process_group)} "
            f"of the {world_size} ranks"
        )
    if world_size % node_size != 0:
        raise ValueError(
            f"node_size={node_size} does not divide the world size {world_size}: every node must hold "
            f"node_size ranks"
        )
    return 1 if node_size in (1, world_size) else node_size


@dataclass(frozen=True)
class NodeGroups:
    """This rank's place in the node topology and the groups and threads of hierarchical compression.

    Attributes:
        node_size: ranks per node (``L``).
        nodes: number of nodes (``N = W / L``), the size of :attr:`cross_group`.
        node: this rank's node, its rank in :attr:`cross_group`.
        local_rank: this rank's place in its node, its rank in the node groups; it owns shard
            ``local_rank`` of every bucket.
        gloo: the node groups are gloo's (whose reduces and broadcasts beat its reduce-scatter and
            all-gather: :mod:`fastcomm.hooks.hierarchical.hierarchy`).
    """

    node_size: int
    nodes: int
    node: int
    local_rank: int
    reduce_group: dist.ProcessGroup
    gather_group: dist.ProcessGroup
    cross_group: dist.ProcessGroup
    phase2_group: dist.ProcessGroup
    cross_worker: OrderedWorker
    phase2_worker: OrderedWorker
    gather_worker: OrderedWorker
    gloo: bool


# node_size -> this process's groups: made once, the first time any state asks (every rank asks at the
# same point: register(), or the first compressed bucket), kept until exit like the phase-2 lanes
_GROUPS: dict[int, NodeGroups] = {}
_GROUPS_LOCK = threading.Lock()


def node_groups(node_size: int) -> NodeGroups:
    """The groups of a ``node_size``-rank-per-node topology over the default group, made at first use.

    Every rank must call this at the same point of its sequence of collectives (it makes ``2 N + 2 L``
    groups, every rank every group: the node groups, the gather groups, the cross-node groups, then
    the phase-2 groups).

    Example::

        groups = node_groups(2)  # on 4 ranks: nodes {0, 1} and {2, 3}; cross groups {0, 2} and {1, 3}
        groups.cross_group  # rank 1's: {1, 3}
    """
    with _GROUPS_LOCK:
        found = _GROUPS.get(node_size)
        if found is not None:
            return found
        world_size, rank = dist.get_world_size(), dist.get_rank()
        nodes = world_size // node_size
        backend = dist.get_backend()
        timeout = timeout_of(dist.group.WORLD)

        def make(ranks: list[int], desc: str) -> dist.ProcessGroup:
            return dist.new_group(ranks=ranks, backend=backend, timeout=timeout, group_desc=desc)

        # A peer killed before this point (made at the first compressed bucket when the hook was not
        # registered through fastcomm.register) fails at once here, not after the whole timeout in new_group.
        wait_for_peers(None, "hierarchical node groups barrier")

        node_ranks = [list(range(n * node_size, (n + 1) * node_size)) for n in range(nodes)]
        reduce_groups = [make(ranks, "fastcomm_node_reduce") for ranks in node_ranks]
        gather_groups = [make(ranks, "fastcomm_node_gather") for ranks in node_ranks]
        cross_ranks = [[n * node_size + j for n in range(nodes)] for j in range(node_size)]
        cross_groups = [make(ranks, "fastcomm_cross_node") for ranks in cross_ranks]
        phase2_groups = [make(ranks, "fastcomm_cross_node_phase2") for ranks in cross_ranks]
        node, local_rank = divmod(rank, node_size)
        found = NodeGroups(
            node_size=node_size,
            nodes=nodes,
            node=node,
            local_rank=local_rank,
            reduce_group=reduce_groups[node],
            gather_group=gather_groups[node],
            cross_group=cross_groups[local_rank],
            phase2_group=phase2_groups[local_rank],
            cross_worker=OrderedWorker("fastcomm-cross-node"),
            phase2_worker=OrderedWorker("fastcomm-cross-node-phase2"),
            gather_worker=OrderedWorker("fastcomm-node-gather"),
            gloo=backend == "gloo",
        )
        _GROUPS[node_size] = found
        return found
