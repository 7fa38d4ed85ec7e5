"""The hierarchy's three steps for one bucket (:class:`ShardReduction`), and the in-node arithmetic.

:meth:`~fastcomm.hooks.hierarchical.Hierarchy.reduce` builds a :class:`ShardReduction` per bucket and runs
its steps where the module docstring of :mod:`fastcomm.hooks.hierarchical.hierarchy` says: step 1 in the
hook call, step 2 on the cross-node thread, step 3 on the gather thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives import SecondCollective, all_gather_flat, finish_on_lane, when_done
from fastcomm.collectives.errors import PeerCollectiveError
from fastcomm.collectives.two_phase import Phase2Payload
from fastcomm.hooks.engine.accounting import NodeTraffic
from fastcomm.hooks.engine.store import BucketStore
from fastcomm.hooks.engine.util import BucketKey
from fastcomm.hooks.hierarchical.groups import NodeGroups
from fastcomm.hooks.hierarchical.protocols import FlatCall, FlatState

__all__ = ["ShardReduction", "phase2_thread", "sum_in_rank_order"]

# reduce_scatter_tensor was renamed reduce_scatter_single; use whichever this torch has, without a warning
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def phase2_thread(groups: NodeGroups) -> Callable[[SecondCollective], None]:
    """Where an inner two-phase state's deferred phase 2 goes: the node groups' phase-2 thread and group.

    The cross-node thread issues every phase 1 (and the last bucket's phase 2) on the cross-node group;
    the phase-2 thread finishes the other buckets in the order they were deferred, on the phase-2 group,
    each as soon as its phase 1 arrives. One thread per group, bucket order: the same on every rank.
    """

    def defer(pending: SecondCollective) -> None:
        groups.phase2_worker.submit(lambda: finish_on_lane(pending, groups.phase2_group))

    return defer


@dataclass
class ShardReduction:
    """One bucket through the hierarchy's three steps, each a method run where :meth:`Hierarchy.reduce` says.

    Every step hands a failure to ``done``, the future DDP waits on; none issues a collective from a
    callback.
    """

    groups: NodeGroups
    store: BucketStore  # the shard store
    traffic: NodeTraffic
    call: FlatCall
    compress: Callable[[Any], torch.futures.Future[Tensor]]
    inner: FlatState
    shard_key: BucketKey
    shard_size: int
    done: torch.futures.Future[Tensor] = field(default_factory=torch.futures.Future)
    source: Tensor | None = None  # the bucket (plus what it owes), padded: step 1 reads it, step 3 fills it
    shard: Tensor | None = None  # this rank's shard of the node's sum
    received: Tensor | None = None  # gloo: the other local ranks' copies of this rank's shard
    works: list[dist.Work] = field(default_factory=list)
    divide_first: bool = False

    def where(self, step: str) -> str:
        return f"{type(self.call.state).__name__} hierarchical {step}"

    def reduce_in_node(self, source: Tensor) -> None:
        """Step 1, in the hook call: this rank's shard of the node's sum, issued on the node's reduce group.

        Over gloo each shard goes straight to its owner, which sums the node's copies in step 2 (see the
        module docstring); elsewhere one reduce-scatter.
        """
        groups, flat, store = self.groups, self.call.flat, self.store
        local, node_size, shard_size = groups.local_rank, groups.node_size, self.shard_size
        # fp16's sum of L gradients can overflow where their mean does not: divide first there (a pass
        # over the bucket); wider types divide the shard after the sum (half the elements at L = 2)
        self.divide_first = flat.dtype == torch.float16
        if self.divide_first:
            source.div_(node_size)
        if groups.gloo:
            self.shard = source[local * shard_size : (local + 1) * shard_size]
            received = store.buffers.tensor(
                self.shard_key, "node_received", flat, (node_size - 1) * shard_size
            )
            self.received = received.view(node_size - 1, shard_size)
            for r, (piece, owner) in enumerate(_node_shards(source, shard_size, groups)):
                if r != local:
                    copy = self.received[_row_of(r, local)]
                    self.works.append(dist.irecv(copy, src=owner, group=groups.reduce_group))
                    self.works.append(dist.isend(piece, dst=owner, group=groups.reduce_group))
        else:
            self.shard = store.buffers.tensor(self.shard_key, "shard", flat, shard_size)
            self.works = [_reduce_scatter_flat(self.shard, source, group=groups.reduce_group, async_op=True)]
        self.traffic.add(intra_node_bytes=(node_size - 1) * shard_size * flat.element_size())
        self.source = source

    def exchange_across_nodes(self) -> None:
        """Step 2, on the cross-node thread: wait for step 1, then the flat exchange of the shard."""
        try:
            reduced = self._exchange()
        except Exception as error:  # noqa: BLE001 - handed to whoever waits on the bucket
            self.done.set_exception(error)
            return
        self.groups.gather_worker.submit(lambda: self.gather_in_node(reduced))

    def _exchange(self) -> torch.futures.Future[Tensor]:
        call, inner, groups = self.call, self.inner, self.groups
        assert self.shard is not None
        if call.bucket_index == 0:
            inner.flush_pending()  # a last bucket DDP did not mark
        try:
            for work in self.works:  # all of them: the gather writes into the other shards
                work.wait()
        except Exception as error:
            raise PeerCollectiveError(self.where("node reduction"), call.bucket_index, error) from error
        if self.received is not None:
            sum_in_rank_order(self.shard, self.received, groups.local_rank)
        if not self.divide_first:
            self.shard.div_(groups.node_size)
        entry = inner.store.entry(self.shard_key, (self.shard_size,), groups.nodes)
        shard_call = dataclasses.replace(
            call, state=inner, key=self.shard_key, entry=entry, flat=self.shard, world_size=groups.nodes,
            rank=groups.node,
        )  # fmt: skip
        return self.compress(shard_call)

    def gather_in_node(self, reduced: torch.futures.Future[Tensor]) -> None:
        """Step 3, on the gather thread: every shard into the bucket, on the node's gather group.

        The others' shards are decoded from their payloads where the exchange kept them (two-phase
        compressors), else sent dense through ``source`` (whose sums are spent).
        """
        flat = self.call.flat
        assert self.source is not None
        try:
            mine = reduced.wait().reshape(-1)
            payloads = getattr(self.inner, "payloads", None)
            payload = None if payloads is None else payloads.pop(self.shard_key, None)
            if payload is None:
                works, finish = self._gather_dense(
                    self.source, mine, self.shard_size, flat, flat.element_size()
                )
            else:
                works, finish = self._gather_payloads(self.shard_key, payload, mine, self.shard_size, flat)
        except Exception as error:  # noqa: BLE001 - handed to whoever waits on the bucket
            self.done.set_exception(error)
            return
        arrived = torch.futures.collect_all([work.get_future() for work in works])
        when_done(arrived, lambda done: self._place(done, finish))

    def _gather_dense(
        self, source: Tensor, mine: Tensor, shard_size: int, flat: Tensor, elem: int
    ) -> tuple[list[dist.Work], Callable[[], None]]:
        """Step 3 with the decoded shards: each into ``source``, then ``source`` into the bucket."""
        groups = self.groups
        local = groups.local_rank
        if groups.gloo:
            own = source[local * shard_size : (local + 1) * shard_size]
            if mine.data_ptr() != own.data_ptr():
                own.copy_(mine)
            # one broadcast per shard: faster than gloo's all-gather (measured)
            works = [
                dist.broadcast(piece, src=owner, group=groups.gather_group, async_op=True)
                for piece, owner in _node_shards(source, shard_size, groups)
            ]
        else:
            works = [all_gather_flat(source, mine.contiguous(), group=groups.gather_group, async_op=True)]
        self.traffic.add(intra_node_bytes=(groups.node_size - 1) * shard_size * elem)

        def finish() -> None:
            if source.data_ptr() != flat.data_ptr():
                flat.copy_(source[: flat.numel()])

        return works, finish

    def _gather_payloads(
        self, shard_key: BucketKey, payload: Phase2Payload, mine: Tensor, shard_size: int, flat: Tensor
    ) -> tuple[list[dist.Work], Callable[[], None]]:
        """Step 3 with the compressed shards: every local rank's phase-2 payloads, decoded here.

        Each rank decodes its partners' payloads as their own exchanges did, so every rank of the node
        holds the same bits, for ``1/ratio`` of the dense shards' bytes inside the node.
        """
        groups = self.groups
        local, node_size, numel = groups.local_rank, groups.node_size, flat.numel()
        sent = payload.gathered
        rows = self.store.buffers.tensor(shard_key, "node_payloads", sent, node_size * sent.numel())
        rows = rows.view(node_size, sent.numel())
        if groups.gloo:
            first = groups.node * node_size
            works = [
                dist.broadcast(sent if r == local else rows[r], src=first + r, group=groups.gather_group,
                               async_op=True)
                for r in range(node_size)
            ]  # fmt: skip
        else:
            works = [all_gather_flat(rows.view(-1), sent, group=groups.gather_group, async_op=True)]
        self.traffic.add(intra_node_bytes=(node_size - 1) * sent.numel())
        accounting = self.inner.accounting

        def finish() -> None:
            for r in range(node_size):
                lo, hi = r * shard_size, min((r + 1) * shard_size, numel)
                if lo >= hi:
                    continue
                if r == local:
                    if mine.data_ptr() != flat[lo:hi].data_ptr():
                        flat[lo:hi].copy_(mine[: hi - lo])
                    continue
                accounting.note_output(payload.decode_into(flat[lo:hi], rows[r]))

        return works, finish

    def _place(
        self, arrived: torch.futures.Future[list[torch.futures.Future[Any]]], finish: Callable[[], None]
    ) -> None:
        """The gather's callback: the partners' shards into the bucket, then the bucket to DDP."""
        try:
            for piece in arrived.value():
                piece.value()
        except Exception as error:  # noqa: BLE001 - reaches DDP's wait
            failure = PeerCollectiveError(self.where("node gather"), self.call.bucket_index, error)
            failure.__cause__ = error
            self.done.set_exception(failure)
            return
        try:
            finish()
        except Exception as error:  # noqa: BLE001 - reaches DDP's wait
            self.done.set_exception(error)
            return
        self.done.set_result(self.call.flat)


def _row_of(rank: int, local: int) -> int:
    """The row of local rank ``rank``'s copy in local rank ``local``'s received copies (its own has none)."""
    return rank if rank < local else rank - 1


def sum_in_rank_order(shard: Tensor, received: Tensor, local: int) -> None:
    """``shard`` (local rank ``local``'s own copy) becomes the sum of every local rank's, in rank order.

    ``received`` holds the other local ranks' copies, in rank order (row :func:`_row_of`), so every node
    sums in the same order (fp32 addition does not associate: the order is what makes the result
    independent of who owns it).
    """
    others = received.shape[0]
    if others == 1:  # two terms: a + b is b + a, bit for bit
        shard.add_(received[0])
        return
    if local == 0:
        for row in range(others):
            shard.add_(received[row])
        return
    total = received[0]  # local rank 0's copy
    for r in range(1, others + 1):
        total.add_(shard if r == local else received[_row_of(r, local)])
    shard.copy_(total)


def _node_shards(source: Tensor, shard_size: int, groups: NodeGroups) -> list[tuple[Tensor, int]]:
    """Each local rank's shard of ``source`` (a view) with that rank's global rank, in local-rank order."""
    first = groups.node * groups.node_size
    return [(source[r * shard_size : (r + 1) * shard_size], first + r) for r in range(groups.node_size)]
