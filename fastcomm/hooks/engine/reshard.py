"""One hook-state ``state_dict`` per rank of a new group, from every old rank's: an elastic restart.

A checkpoint holds one hook-state ``state_dict`` per rank. A run that restarts with another number of
ranks has all of them in hand and needs one for each new rank; the states' ``merge_state_dicts``
classmethods build it with the helpers here. The rule, per kind of state:

1. **Same world size**: the new rank takes its own old ``state_dict`` unchanged, so the resume is
   bit-identical.
2. **Error-feedback residuals** (top-k, sign, quantize, any compressor; two-phase hooks' phase-2 residual
   of this rank's segment folded into the phase-1 residual times the old world size, as
   :meth:`~fastcomm.hooks.engine.store.BucketStore.residual_of` and a bucket rebuild fold it): re-partitioned.
   Every new rank owes the mean over old ranks of what each old rank still owed, so the mean over ranks of
   what is still owed (the error-feedback invariant of
   :meth:`~fastcomm.hooks.engine.compression.CompressionState.residual_of`) is unchanged: no gradient is
   lost and none is sent twice.
3. **DGC momentum velocity** (top-k with ``momentum > 0``): the mean over old ranks, the velocity of the
   mean gradient, which is what the ranks' velocities contribute to the reduced gradient on average. Any
   other bucket-layout tensor likewise: PowerSGD's warm-start ``Q``'s are the same on every rank (the
   mean of an allreduce), so their mean is themselves, valid at any world size.
4. **What belongs to the old group alone**: dropped. The segments of two-phase hooks (which part of a bucket
   a rank reduced) and the checkpoint's bucket layout, which would make the first iteration reduce its
   buckets as the old layout's (a bit-identical resume needs the old world size): the merged state has
   ``"layout": []`` (none), every bucket entry records the new world size and no segment.
5. **Counters** (steps, traffic): old rank 0's; steps and skipped steps must agree on every old rank.

Example::

    states = [torch.load(f"comm_{r}.pt") for r in range(old_world_size)]
    merged, why = type(state).merge_state_dicts(states, dist.get_world_size(), dist.get_rank())
    state.load_state_dict(merged)
    print(why)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fastcomm.collectives.residual import mean_over_ranks
from fastcomm.hooks.engine.accounting import COUNTERS
from fastcomm.hooks.engine.store import SEGMENT_TENSOR, BucketEntry

__all__ = [
    "BucketMerge",
    "check_mergeable",
    "describe",
    "keep_if_same_world",
    "merge_buckets",
    "merge_counters",
    "same_value",
]


@dataclass(frozen=True)
class BucketMerge:
    """What :func:`merge_buckets` did: bucket entries, their elements, which tensors, folded segments.

    Example::

        buckets, summary = merge_buckets([sd0, sd1], world_size=3)
        print("; ".join(summary.notes()))
    """

    buckets: int
    elements: int
    tensors: tuple[str, ...]
    folded_segments: int
    old_world_size: int

    def notes(self) -> list[str]:
        """The merge in words, one clause per kind of tensor (for the log line)."""
        if not self.buckets:
            return ["no bucket tensors yet (nothing compressed before the checkpoint)"]
        old = self.old_world_size
        notes = []
        if "residual" in self.tensors:
            folded = (
                f", each old rank's phase-2 segment residual folded in times {old}"
                if self.folded_segments
                else ""
            )
            notes.append(
                f"error-feedback residuals of {self.buckets} bucket entries ({self.elements} elements) "
                f"re-partitioned: every rank owes the mean over the {old} old ranks of what each still "
                f"owed{folded}, so the mean over ranks still owed is unchanged"
            )
        if "velocity" in self.tensors:
            notes.append(f"DGC momentum velocity: the mean over the {old} old ranks")
        others = [name for name in self.tensors if name not in ("residual", "velocity")]
        if others:  # PowerSGD's warm-start Q's, the same on every rank: the mean keeps them
            notes.append(f"{', '.join(others)}: the mean over the {old} old ranks")
        return notes


def check_mergeable(
    type_name: str, states: Sequence[dict[str, Any]], world_size: int, rank: int, *, options: bool = True
) -> None:
    """Raise unless ``states`` are old ranks' state_dicts of one ``type_name`` state, with one set of options.

    Raises:
        ValueError: no states; ``world_size`` or ``rank`` out of range; a state of another type, with
            other options (when ``options``), or at another step than old rank 0's.

    Example::

        check_mergeable("QuantState", [sd0, sd1], world_size=3, rank=0)  # sd1 with bits=4: ValueError
    """
    if not len(states):
        raise ValueError(f"{type_name}.merge_state_dicts needs the state_dicts of the old ranks; got none")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    for old_rank, state in enumerate(states):
        if not isinstance(state, dict) or state.get("type") != type_name:
            got = state.get("type") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"old rank {old_rank}'s state_dict is for {got!r}, not {type_name}")
    first = states[0]
    for old_rank, state in enumerate(states[1:], start=1):
        if options:
            names = sorted(set(first.get("options", {})) | set(state.get("options", {})))
            for name in names:
                mine, theirs = state.get("options", {}).get(name), first.get("options", {}).get(name)
                if not same_value(mine, theirs):
                    raise ValueError(
                        f"old rank {old_rank}'s {type_name} has {name}={mine!r}, old rank 0's "
                        f"{name}={theirs!r}: the state_dicts come from differently configured states"
                    )
        for name in ("steps", "skipped_steps"):
            if name in first and state.get(name) != first[name]:
                raise ValueError(
                    f"old rank {old_rank}'s {type_name} has {name}={state.get(name)!r}, old rank 0's "
                    f"{first[name]!r}: the state_dicts come from different checkpoints"
                )


def keep_if_same_world(
    type_name: str, states: Sequence[dict[str, Any]], world_size: int, rank: int, *, options: bool = True
) -> tuple[dict[str, Any], str] | None:
    """:func:`check_mergeable`, then ``(states[rank], why)`` if the world size is unchanged, else ``None``.

    Step 1 of the module docstring: at the same world size each rank resumes from its own state_dict, as
    saved, so the resume is bit-identical.

    Example::

        kept = keep_if_same_world("SignState", states, world_size, rank)
        if kept is not None:
            return kept
    """
    check_mergeable(type_name, states, world_size, rank, options=options)
    if len(states) != world_size:
        return None
    why = f"{type_name}: same world size ({world_size}): old rank {rank}'s own state_dict, unchanged"
    return states[rank], why + " (a bit-identical resume)"


def merge_counters(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A :class:`~fastcomm.hooks.HookState` ``state_dict`` with old rank 0's type, options and counters.

    Example::

        merged = merge_counters([sd0, sd1])  # CastState's whole merge: it holds no per-rank tensors
    """
    first = states[0]
    return {"type": first["type"], "options": first["options"], **{name: first[name] for name in COUNTERS}}


def merge_buckets(
    stores: Sequence[dict[str, Any]], world_size: int
) -> tuple[list[dict[str, Any]], BucketMerge]:
    """The bucket entries a rank of a ``world_size`` group loads, from every old rank's ``buckets``.

    Steps 2-4 of the module docstring, per bucket entry (the old ranks hold the same entries: DDP gives
    every rank the same layouts):

    1. ``residual``: the mean over old ranks of :meth:`~fastcomm.hooks.engine.store.BucketEntry.owed` (the
       phase-1 residual with the segment residual folded in), in fp32, cast to old rank 0's dtype.
    2. Every other bucket-layout tensor (``velocity``, ``compressor_state``): the mean over old ranks.
    3. The segment tensor is gone (folded in step 1); ``segment_start`` is 0 and ``world_size`` the new one.

    Args:
        stores: each old rank's store part of its state_dict (a dict with ``"buckets"``), by old rank.
        world_size: the new world size, recorded in every entry.

    Returns:
        The merged ``buckets`` list (one entry per old entry, in their order) and a :class:`BucketMerge`.

    Raises:
        ValueError: the old ranks' entries differ in parameters or sizes, or a tensor's length differs.

    Example::

        buckets, summary = merge_buckets([sd0, sd1], world_size=3)
        merged = {**merge_counters([sd0, sd1]), "buckets": buckets, "layout": []}
    """
    columns = [[_entry(item) for item in store["buckets"]] for store in stores]
    layouts = [[_key(item) for item in store["buckets"]] for store in stores]
    for old_rank, layout in enumerate(layouts[1:], start=1):
        if layout != layouts[0]:
            raise ValueError(
                f"old rank {old_rank}'s bucket entries (parameter keys, sizes) differ from old rank 0's: "
                f"{layout} vs {layouts[0]}"
            )
    keys = [params for params, _ in layouts[0]]
    merged, names, folded = [], set(), 0
    for position, key in enumerate(keys):
        column = [entries[position] for entries in columns]
        tensors: dict[str, Tensor] = {}
        if any(SEGMENT_TENSOR in entry.tensors for entry in column):
            folded += 1
        for name in _tensor_names(column):
            tensors[name] = _mean(column, key, name)
            names.add(name)
        merged.append(
            {
                "params": list(key),
                "numels": list(column[0].numels),
                "world_size": world_size,
                "segment_start": 0,
                "tensors": tensors,
            }
        )
    summary = BucketMerge(
        buckets=len(merged),
        elements=sum(entry.numel for entry in columns[0]),
        tensors=tuple(sorted(names)),
        folded_segments=folded,
        old_world_size=len(stores),
    )
    return merged, summary


def describe(type_name: str, old_world_size: int, world_size: int, notes: Sequence[str]) -> str:
    """The one log line of a merge: the state, the world sizes, what was done to each part and why.

    Example::

        >>> describe("CastState", 2, 3, ["no per-rank tensors; counters: old rank 0's"])
        "CastState: 2 -> 3 ranks: no per-rank tensors; counters: old rank 0's"
    """
    return f"{type_name}: {old_world_size} -> {world_size} ranks: " + "; ".join(notes)


def same_value(a: Any, b: Any) -> bool:
    """Whether two state values are equal: dicts, lists and tuples by item, tensors by ``torch.equal``.

    Other objects by ``==``, or else (two instances of a class without ``__eq__``, as a user's compressor
    unpickled from two ranks' files) by type and attributes.

    Example::

        >>> same_value({"ratio": 0.1, "t": torch.ones(2)}, {"ratio": 0.1, "t": torch.ones(2)})
        True
    """
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and (a.shape, a.dtype) == (b.shape, b.dtype)
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same_value(x, y) for x, y in zip(a, b, strict=True))
        )
    if a == b:
        return True
    if type(a) is type(b) and hasattr(a, "__dict__") and a is not b:
        return same_value(vars(a), vars(b))
    return False


def _key(item: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(int(p) for p in item["params"]), tuple(int(n) for n in item["numels"])


def _entry(item: dict[str, Any]) -> BucketEntry:
    return BucketEntry(
        numels=tuple(int(n) for n in item["numels"]),
        world_size=int(item["world_size"]),
        segment_start=int(item["segment_start"]),
        tensors=dict(item["tensors"]),
    )


def _tensor_names(column: list[BucketEntry]) -> list[str]:
    """The bucket-layout tensors any old rank holds for an entry, in first-seen order; the segment one
    becomes part of ``residual``."""
    names: dict[str, None] = {}
    for entry in column:
        for name in entry.tensors:
            names["residual" if name == SEGMENT_TENSOR else name] = None
    return list(names)


def _mean(column: list[BucketEntry], key: tuple[int, ...], name: str) -> Tensor:
    """The mean over old ranks of one entry's tensor ``name`` (``residual``: what each owed), in fp32, cast
    to the dtype of the first old rank's that holds it; a rank without it counts as zeros
    (:func:`~fastcomm.collectives.mean_over_ranks`, the rule every error-feedback store re-shards by)."""
    numel = column[0].numel
    values, dtypes = [], []
    for old_rank, entry in enumerate(column):
        held = entry.tensors.get(name)
        if held is not None and held.numel() != numel:
            raise ValueError(
                f"old rank {old_rank}'s {name!r} of the bucket of parameters {key} holds "
                f"{held.numel()} elements, the bucket {numel}"
            )
        dtypes.append(None if held is None else held.dtype)
        values.append(entry.owed() if name == "residual" else None if held is None else held.float())
    total = mean_over_ranks(values, dtypes)
    assert total is not None, f"no old rank holds {name!r}"
    return total
