"""Hierarchical (two-level) compression: dense inside a node, compressed only between nodes.

Every compressing hook (top-k, sign, quantize, registered compressors) takes ``node_size=L``. Then, for
each compressed bucket of ``numel`` elements, on a world of ``W = N * L`` ranks (``N`` nodes):

1. Reduce-scatter the bucket (zero padded to ``L * S``, ``S = ceil(numel / L)``) densely inside the node:
   local rank ``j`` gets shard ``j``, the sum over its node, divided by ``L`` (the node's mean; fp16
   buckets are divided before the sum, which could overflow).
2. Local rank ``j`` runs the flat hook's own exchange on its shard, over the ranks with local rank ``j``
   on every node (``N`` ranks): the same compressor, error feedback on that shard held by that rank,
   the same two-phase or all-gather exchange. Only this crosses the slow link: about ``1/L`` of what the
   flat hook sends across nodes (top-k: ``1/L**2``, as its flat traffic grows with ``W``).
3. All-gather the reduced shards inside the node; every rank holds the mean over all ``W`` ranks. A
   two-phase exchange (sign, quantization, blockwise compressors) ends with every node's copy of the
   shard's compressed payloads: those are what is gathered, and each rank decodes its partners' shards
   itself, which gives it the bits their exchanges wrote (sign: 1/32 of the dense shard's bytes; 8-bit:
   about 1/4). Top-k and other all-gather exchanges gather the decoded shard.

Over gloo, step 1 is point to point: each rank sends each other local rank its shard (``isend``) and
receives its own shard's copies (``irecv``), then sums them in local-rank order; step 3 is one broadcast
per shard (or per shard's payloads), from its owner. Measured on 2 ranks over loopback, a 50 MB bucket,
per rank: send and receive plus the sum 20-22 ms (15 ms of CPU); one ``reduce`` per shard 41-48 ms (30 ms
of CPU); an ``all_reduce`` 30-34 ms; ``reduce_scatter_tensor`` 67-84 ms. With 4 ranks on 2 cores the CPU
time is the step time. Other backends (NCCL) use ``reduce_scatter_tensor`` and ``all_gather_into_tensor``.

Collective order (:mod:`fastcomm.hooks.hierarchical.groups`): step 1 is issued by the hook call, on the node's
reduce group. Step 2 runs on the cross-node thread, bucket after bucket: it waits for the bucket's step 1
and issues the flat exchange (a two-phase hook's phase 2 goes to a phase-2 thread on a second cross-node
group, as the flat hooks' lane does; with ``overlap_phase2=False`` the next bucket's call finishes it,
and the last bucket itself). Step 3 runs on the gather thread: it waits for step 2's result and issues
the gather on a second node group. Each group sees one thread issue in bucket order on every rank;
nothing is issued from a callback.

Error feedback: the shard exchange keeps its residuals (phase 1 and phase 2) in a store of its own, one
entry per bucket layout, in units of the node's mean. When DDP rebuilds its buckets, what a rank's shard
of an old bucket still owes is handed to the new buckets as ``L`` times that owed amount in the rank's
own gradient (added once, before step 1), which keeps the mean over all ranks of what is owed unchanged.
Dense buckets (before ``start_iter``, below ``min_compress_numel``) are flat dense allreduces.

PowerSGD is not hierarchical: a shard of ``1/L`` of a bucket cuts through its parameters' matrices, whose
shapes its low-rank factors are built from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives import then
from fastcomm.hooks.engine.accounting import NodeTraffic, ShardAccounting
from fastcomm.hooks.engine.store import BucketStore
from fastcomm.hooks.engine.util import BucketKey
from fastcomm.hooks.hierarchical.groups import NodeGroups, node_groups, resolve_node_size
from fastcomm.hooks.hierarchical.protocols import FlatCall, FlatState, InnerParts
from fastcomm.hooks.hierarchical.reduction import ShardReduction, phase2_thread
from fastcomm.hooks.hierarchical.shards import check_hierarchical_options, fold_shards, shard_numel

__all__ = ["Hierarchy", "check_hierarchical_options", "fold_shards", "shard_numel"]

# reduce_scatter_tensor was renamed reduce_scatter_single; use whichever this torch has, without a warning
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Hierarchy:
    """The hierarchical part of a :class:`~fastcomm.hooks.engine.compression.CompressionState`.

    Holds the shard exchange's bucket store (residuals per shard), the node traffic counters, and, once
    resolved, the node groups and the inner state that runs the flat exchange over the cross-node group.
    A state whose ``node_size`` resolves to 1 keeps an empty one (its checkpoint has no hierarchical keys).

    Args:
        residual_dtype: the dtype the shard store keeps its residuals in between steps (the state's).

    Example::

        state = fastcomm.register(ddp, "sign", node_size=2)  # 2 ranks per node
        state.stats()["cross_node_bytes"]  # bytes this rank sent to other nodes
    """

    def __init__(self, residual_dtype: torch.dtype | None = None) -> None:
        self.store = BucketStore(residual_dtype)
        self.traffic = NodeTraffic()
        self.groups: NodeGroups | None = None
        self._resolved = False
        self._inner: FlatState | None = None
        # bucket layout -> (its shard store key, its parameters' sizes): a key of its own per layout, so
        # the shard store never mixes layouts (a rebuild hands the owed amounts over: _take_over)
        self._layouts: dict[BucketKey, tuple[BucketKey, tuple[int, ...]]] = {}
        # an old layout's owed amounts in its bucket layout, handed to the new layouts during a rebuild
        self._moving: dict[BucketKey, tuple[Tensor, tuple[int, ...]]] = {}
        self._next_shard = 0

    # ------------------------------------------------------------------------------------- resolution
    def resolve(self, state: FlatState) -> bool:
        """Whether ``state`` reduces hierarchically; the first call decides and makes the groups.

        Every rank must first call this at the same point (``register()``'s bind, or the first
        compressed bucket); before ``init_process_group`` nothing is decided. An env-derived
        ``node_size`` on a state that cannot shard stays flat.
        """
        if not self._resolved and dist.is_initialized():
            requested = state.node_size
            node_size = resolve_node_size(requested, state.process_group)
            if node_size > 1 and requested is None:
                try:
                    check_hierarchical_options(state, node_size)
                except ValueError:
                    node_size = 1
            if node_size > 1:
                self.groups = node_groups(node_size)
            self._resolved = True
        return self.groups is not None

    def _inner_state(self, state: FlatState) -> FlatState:
        """A state of the same class and options that runs the flat exchange over the cross-node group.

        It is built with what it shares with this hierarchy (:class:`InnerParts`): the shard store, the
        shard accounting, and (two-phase states overlapping phase 2) the node groups' phase-2 thread and
        group for its deferred second phases. No phase-2 lane: over a subgroup it needs a
        local-synchronization group, which hangs when group histories differ.
        """
        if self._inner is None:
            groups = self.groups
            assert groups is not None
            options = {**state.options(), "node_size": 1, "process_group": groups.cross_group}
            defer = None
            if options.get("overlap_phase2", False):
                options["overlap_phase2"] = False
                defer = phase2_thread(groups)
            parts = InnerParts(self.store, ShardAccounting(state.accounting, self.traffic), defer)
            self._inner = type(state)(**options, parts=parts)
        return self._inner

    # -------------------------------------------------------------------------------------- reducing
    def reduce(
        self, call: FlatCall, compress: Callable[[Any], torch.futures.Future[Tensor]]
    ) -> torch.futures.Future[Tensor]:
        """Steps 1-3 of the module docstring for one bucket; the future DDP waits on.

        Step 1 is issued here (:meth:`ShardReduction.reduce_in_node`); step 2 runs on the cross-node
        thread (:meth:`ShardReduction.exchange_across_nodes`), step 3 on the gather thread
        (:meth:`ShardReduction.gather_in_node`), each handing any failure to the returned future.
        """
        groups = self.groups
        assert groups is not None
        shard_size = shard_numel(call.flat.numel(), groups.node_size)
        shard_key = self._shard_key(call.key, call.entry.numels)
        inner = self._inner_state(call.state)
        reduction = ShardReduction(
            groups, self.store, self.traffic, call, compress, inner, shard_key, shard_size
        )
        reduction.reduce_in_node(self._bucket_with_owed(call, shard_key))
        groups.cross_worker.submit(reduction.exchange_across_nodes)
        return then(reduction.done, _value)

    def _bucket_with_owed(self, call: FlatCall, shard_key: BucketKey) -> Tensor:
        """The bucket plus what its parameters still owe (a rebuild, a merge), zero padded to ``L`` shards."""
        groups = self.groups
        assert groups is not None
        state, flat = call.state, call.flat
        owed = None
        if state.error_feedback:
            owed = self._owed(call.key, call.entry.numels)
            # residuals in the bucket layout: merged from another world size (fold_shards), or flat ones
            merged = state.store.take_owed(call.key, call.entry.numels, call.world_size)
            if merged is not None:
                owed = merged.float() if owed is None else owed + merged.float()
        source = flat if owed is None else flat + owed.to(device=flat.device, dtype=flat.dtype)
        numel, total = flat.numel(), shard_numel(flat.numel(), groups.node_size) * groups.node_size
        if numel != total:
            padded = self.store.buffers.tensor(shard_key, "padded", flat, total)
            padded[:numel].copy_(source)
            padded[numel:].zero_()
            source = padded
        return source

    def _shard_key(self, key: BucketKey, numels: tuple[int, ...]) -> BucketKey:
        """The shard store key of bucket layout ``key`` (a new layout takes over the old ones first)."""
        found = self._layouts.get(key)
        if found is None:
            self._take_over(key)
            found = ((self._next_shard,), numels)
            self._next_shard += 1
            self._layouts[key] = found
        return found[0]

    def _take_over(self, key: BucketKey) -> None:
        """Move every old layout sharing a parameter with ``key`` out of the shard store, as owed amounts.

        An old shard's owed amount (its phase-2 residual folded in, times the number of nodes: what the
        node still owes, in units of the node's mean) becomes ``L`` times that in the old bucket's layout,
        nonzero on this rank's shard only: the mean over all ranks is what the old layout still owed.
        """
        groups = self.groups
        assert groups is not None
        params = set(key)
        for old in [o for o in self._layouts if params.intersection(o)]:
            shard_key, old_numels = self._layouts.pop(old)
            total = sum(old_numels)
            owed = torch.zeros(total, dtype=torch.float32)
            if self.store.holds(shard_key):
                entry = self.store.entry(shard_key, (shard_numel(total, groups.node_size),), groups.nodes)
                shard_owed = entry.owed()
                entry.tensors.clear()
                if shard_owed is not None:
                    start = groups.local_rank * shard_owed.numel()
                    stop = min(start + shard_owed.numel(), total)
                    if start < stop:
                        owed[start:stop] = shard_owed[: stop - start].cpu() * groups.node_size
            self._moving[old] = (owed, old_numels)

    def _owed(self, key: BucketKey, numels: tuple[int, ...]) -> Tensor | None:
        """What this rank adds to bucket ``key``'s gradient for the old layouts (during a rebuild only)."""
        if not self._moving:
            return None
        located: dict[int, Tensor] = {}
        for old, (owed, old_numels) in self._moving.items():
            for pkey, piece in zip(old, owed.split(list(old_numels)), strict=True):
                located[pkey] = piece
        pieces = [located.get(pkey) for pkey in key]
        if all(piece is None for piece in pieces):
            return None
        return torch.cat([torch.zeros(n) if p is None else p for p, n in zip(pieces, numels, strict=True)])

    def residual_of(self, pkey: int, numel: int) -> Tensor | None:
        """What this rank owes for parameter ``pkey`` through its shards (fp32, flat), or ``None``.

        ``L`` times the shard's owed amount (phase-2 residual folded in) where this rank's shard of the
        parameter's bucket covers the parameter, zero elsewhere (another rank of the node owes that).
        """
        groups = self.groups
        for key, (shard_key, numels) in self._layouts.items():
            if pkey not in key or groups is None or not self.store.holds(shard_key):
                continue
            total = sum(numels)
            shard = shard_numel(total, groups.node_size)
            owed = self.store.entry(shard_key, (shard,), groups.nodes).owed()
            if owed is None:
                return None
            offset = sum(numels[: key.index(pkey)])
            start = groups.local_rank * shard
            lo, hi = max(offset, start), min(offset + numel, start + shard)
            out = torch.zeros(numel, dtype=torch.float32, device=owed.device)
            if lo < hi:
                out[lo - offset : hi - offset] = owed[lo - start : hi - start] * groups.node_size
            return out
        return None

    def end_iteration(self, finite: bool) -> None:
        """Commit (a step) or drop (a skipped one) the shard residuals staged this iteration."""
        self.store.end_iteration(finite)
        self._moving.clear()

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{}`` when flat; else the shard store, the layouts' shard keys and the traffic counters."""
        if not self._layouts and not any(self.traffic.counters.values()):
            return {}
        layouts = [
            {"params": list(key), "shard": list(shard), "numels": list(numels)}
            for key, (shard, numels) in self._layouts.items()
        ]
        saved = {"store": self.store.state_dict(), "layouts": layouts, "next_shard": self._next_shard}
        saved["node_size"] = 1 if self.groups is None else self.groups.node_size
        return {"hierarchical": {**saved, **self.traffic.counters}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s (nothing hierarchical in ``state_dict``: an empty hierarchy)."""
        saved = state_dict.get("hierarchical")
        self.store.load_state_dict(saved["store"] if saved else {"buckets": [], "layout": []})
        self.traffic.load(saved or {})
        self._moving = {}
        self._next_shard = int(saved["next_shard"]) if saved else 0
        self._layouts = {
            tuple(int(p) for p in item["params"]): (
                tuple(int(s) for s in item["shard"]),
                tuple(int(n) for n in item["numels"]),
            )
            for item in (saved["layouts"] if saved else [])
        }

    def stats(self) -> dict[str, int]:
        """``intra_node_bytes`` and ``cross_node_bytes`` (``{}`` when flat)."""
        if self.groups is None:
            return {}
        return dict(self.traffic.counters)


def _value(future: torch.futures.Future[Tensor]) -> Tensor:
    return future.value()
