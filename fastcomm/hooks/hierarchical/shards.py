"""The hierarchical exchange's arithmetic without its groups: shard sizes, the options it refuses, and
how a checkpoint's shard residuals fold back into bucket residuals (:mod:`fastcomm.hooks.hierarchical`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fastcomm.compress.protocol import AllreduceCompressor
from fastcomm.hooks.engine.store import BucketEntry
from fastcomm.hooks.hierarchical.protocols import FlatState

__all__ = ["check_hierarchical_options", "fold_shards", "shard_numel"]


def shard_numel(numel: int, node_size: int) -> int:
    """Elements of each local rank's shard of a ``numel``-element bucket: ``ceil(numel / node_size)``.

    Example::

        >>> shard_numel(1001, 2)
        501
    """
    return max(1, math.ceil(numel / node_size))


def check_hierarchical_options(state: FlatState, node_size: int | None) -> None:
    """Refuse an explicit ``node_size > 1`` on a state whose algorithm a shard would change.

    Raises:
        ValueError: PowerSGD (an :class:`~fastcomm.compress.AllreduceCompressor`), or top-k with DGC
            momentum or local clipping (their velocity and clipping shares belong to whole buckets).
    """
    if node_size is None or node_size == 1:
        return
    if isinstance(getattr(state, "compressor", None), AllreduceCompressor):
        raise ValueError(
            f"node_size={node_size}: {type(state.compressor).__name__} cannot compress a shard of a bucket "
            f"(its factors come from whole parameter matrices, which a 1/node_size shard cuts); use "
            f"node_size=1"
        )
    for name, off in (("momentum", 0.0), ("clip_norm", None)):
        if getattr(state, name, off) != off:
            raise ValueError(
                f"node_size={node_size} with {name}={getattr(state, name)!r}: hierarchical top-k supports "
                f"neither DGC momentum nor local clipping; use {name}={off!r} or node_size=1"
            )


def fold_shards(state_dict: dict[str, Any], old_rank: int) -> dict[str, Any]:
    """``state_dict`` with its shards' owed amounts moved into its bucket entries' ``residual`` tensors.

    For :meth:`~fastcomm.hooks.engine.compression.CompressionState.merge_state_dicts` at another world size:
    old rank ``old_rank`` owes, per bucket layout, ``L`` times its shard's owed amount (phase-2 residual
    folded in) on its shard of the bucket, in the bucket's layout, which the merge re-partitions like any
    residual. A state without hierarchical keys is returned as is.

    Example::

        folded = [fold_shards(states[r], r) for r in range(len(states))]
    """
    saved = state_dict.get("hierarchical")
    if not saved or not saved["layouts"]:
        return state_dict
    node_size = int(saved["node_size"])
    local_rank = old_rank % node_size
    shards = {tuple(int(p) for p in item["params"]): item for item in saved["store"]["buckets"]}
    buckets = [{**item, "tensors": dict(item["tensors"])} for item in state_dict["buckets"]]
    by_key = {tuple(int(p) for p in item["params"]): item for item in buckets}
    for layout in saved["layouts"]:
        item = shards.get(tuple(int(s) for s in layout["shard"]))
        key, numels = tuple(int(p) for p in layout["params"]), tuple(int(n) for n in layout["numels"])
        if item is None:
            continue
        entry = BucketEntry(
            numels=tuple(int(n) for n in item["numels"]),
            world_size=int(item["world_size"]),
            segment_start=int(item["segment_start"]),
            tensors=item["tensors"],
        )
        shard_owed = entry.owed()
        if shard_owed is None:
            continue
        total, shard = sum(numels), shard_owed.numel()
        owed = torch.zeros(total, dtype=torch.float32)
        start, stop = local_rank * shard, min((local_rank + 1) * shard, total)
        if start < stop:
            owed[start:stop] = shard_owed[: stop - start].cpu() * node_size
        target = by_key.get(key)
        if target is None:
            target = {"params": list(key), "numels": list(numels), "world_size": int(entry.world_size),
                      "segment_start": 0, "tensors": {}}  # fmt: skip
            buckets.append(target)
        kept = target["tensors"].get("residual")
        target["tensors"]["residual"] = owed if kept is None else kept.float() + owed
    return {**state_dict, "buckets": buckets}
