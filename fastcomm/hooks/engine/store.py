"""The bucket store: per-parameter compression state (residuals, velocity) across bucket layouts and steps.

DDP groups parameters into buckets and calls a hook per bucket. The store keeps each layout's tensors (one
element per gradient element, e.g. error-feedback residuals) and where every parameter lives. A bucket's
error feedback is the :class:`~fastcomm.collectives.Residual` every mode keeps
(:meth:`BucketEntry.feedback`): what a rank owes, and how it re-shards, are that store's rules. The store
adds what buckets need:

* **Bucket rebuilds** lose nothing: a layout never seen before inherits every slice its parameters had in
  their old buckets, so compression can start at step 0 (DDP regroups after the first iteration).
* **Skipped steps** change nothing: tensors a hook updates are *staged* and committed when the iteration
  closes with finite outputs, dropped when it does not (GradScaler skips that step).
* **Kept narrow**: with a ``residual_dtype`` the residuals are committed in it and widened when a hook
  reads them (:meth:`BucketStore.current`), so only the narrow copies stay between iterations.
* **Resume** is bit-identical: a fresh DDP reduces its first iteration in its initial layout (every
  parameter in one bucket, in forward order) and rebuilds after it, but the checkpoint was taken under the
  rebuilt layout, whose blocks, segments and top-k budgets cover other elements. During the first iteration
  after :meth:`BucketStore.load_state_dict`, a bucket made of whole buckets of the checkpoint's layout
  (every bucket of its last iteration, dense ones too) is reduced as those buckets
  (:meth:`BucketStore.resume_parts`): each part gathered into the checkpoint's parameter
  order, compressed as the checkpointed bucket was, and scattered back. That costs one gather and one
  scatter copy of the bucket, on that one iteration only. The layout recorded is the one buckets were
  reduced as (those parts), so a checkpoint taken right after that iteration resumes the same way; and a
  state whose buckets another hook reduces for a while (CompressedAdam's compressor during warm-up) is
  told DDP's layout all along, so a checkpoint taken before its first bucket has one too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fastcomm.collectives.residual import Residual, check_residual_dtype
from fastcomm.hooks.engine.buffers import BufferPool
from fastcomm.hooks.engine.util import BucketKey

__all__ = ["BucketEntry", "BucketStore", "ResumePart"]

# the segment tensor of two-phase hooks: this rank's phase-2 residual, not one element per bucket element
SEGMENT_TENSOR = "server_residual"
# the error-feedback tensors, kept in a store's residual_dtype between iterations
RESIDUAL_TENSORS = ("residual", SEGMENT_TENSOR)


@dataclass
class BucketEntry:
    """State of one bucket layout: its parameters' sizes, in bucket order, and its tensors.

    ``tensors`` holds bucket-layout tensors (one element per gradient element, e.g. ``"residual"``,
    ``"velocity"``) and at most one segment tensor, ``"server_residual"``: the phase-2 residual of the part
    ``[segment_start, segment_start + len)`` of the bucket that this rank reduces in two-phase hooks.
    """

    numels: tuple[int, ...]
    world_size: int
    segment_start: int = 0
    tensors: dict[str, Tensor] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def may_owe(self, segment: bool = True) -> bool:
        """Whether :meth:`owed` (``segment``) or the ``"residual"`` alone could be non-zero: one read of the
        tensors, without building the sum. False means nothing is owed; True, look with :meth:`owed`.

        Example::

            BucketEntry(numels=(4,), world_size=2).may_owe()   # False: it holds no residual
        """
        residual = self.tensors.get("residual")
        if residual is not None and bool((residual[: self.numel] if segment else residual).any()):
            return True
        server = self.tensors.get(SEGMENT_TENSOR) if segment else None
        return server is not None and bool(server.any())

    def feedback(self) -> Residual:
        """The bucket's error feedback as the :class:`~fastcomm.collectives.Residual` every mode keeps: a
        view of ``"residual"`` (its ``worker``) and the segment tensor (its ``server``), not a copy.

        Example::

            entry = BucketEntry(numels=(4,), world_size=2, tensors={"residual": torch.ones(4)})
            entry.feedback().worker is entry.tensors["residual"]  # True
        """
        return Residual(
            worker=self.tensors.get("residual"),
            server=self.tensors.get(SEGMENT_TENSOR),
            segment_start=self.segment_start,
            world_size=self.world_size,
        )

    def owed(self) -> Tensor | None:
        """What this rank still owes for the whole bucket (fp32), or ``None`` if it holds no residual.

        :meth:`~fastcomm.collectives.Residual.owed` of :meth:`feedback`: the ``"residual"`` tensor plus the
        segment tensor times the world size over the segment (the part that runs past the bucket is
        padding, and owes nothing): :meth:`BucketStore.residual_of` of every parameter of the bucket, side
        by side.

        Example::

            entry = BucketEntry(numels=(6, 4), world_size=2, segment_start=8)
            entry.tensors = {"residual": torch.ones(10), "server_residual": torch.ones(8)}
            entry.owed()  # 1 for elements 0-7, 1 + 2 * 1 = 3 for 8-9 (elements 10-15 are padding)
        """
        return self.feedback().owed(0, self.numel)


@dataclass(frozen=True)
class ResumePart:
    """A checkpointed bucket inside a bucket of another layout: its key and where its parameters lie.

    ``spans`` are ``(offset, numel)`` ranges of the enclosing bucket, in the checkpointed bucket's order.
    """

    key: BucketKey
    spans: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return sum(numel for _, numel in self.spans)

    def gather(self, flat: Tensor) -> Tensor:
        """This part of ``flat`` (the enclosing bucket), in the checkpointed order, as a new tensor."""
        return torch.cat([flat[offset : offset + numel] for offset, numel in self.spans])

    def scatter(self, part: Tensor, flat: Tensor) -> None:
        """Write ``part`` (what :meth:`gather` returned, reduced) back into ``flat``."""
        start = 0
        for offset, numel in self.spans:
            flat[offset : offset + numel] = part[start : start + numel]
            start += numel


class BucketStore:
    """Bucket tensors keyed by parameter, rebuild inheritance, staging for skipped steps, checkpoints.

    Args:
        residual_dtype: the dtype the error-feedback residuals (``"residual"`` and the segment tensor) are
            kept in between iterations: committed in it, widened to the gradient's dtype when a hook reads
            them (:meth:`current`); ``None``: as the hook computed them, no copies. Rule 2 of
            :mod:`fastcomm.collectives.residual`.

    Example::

        store = BucketStore()
        entry = store.entry((0, 1), numels=(6, 4), world_size=2)
        residual = store.current(entry, "residual", like=torch.zeros(10))
        store.stage((0, 1), "residual", residual + 1)
        store.end_iteration(finite=True)  # the staged residual becomes current
    """

    def __init__(self, residual_dtype: torch.dtype | None = None) -> None:
        self.residual_dtype = check_residual_dtype(residual_dtype)
        self.buffers = BufferPool()
        self._entries: dict[BucketKey, BucketEntry] = {}
        # parameter key -> (bucket key, offset of the parameter in that bucket)
        self._param_loc: dict[int, tuple[BucketKey, int]] = {}
        # None: the tensor is dropped at the commit (paid: nothing owed, and no memory held for it)
        self._staged: dict[tuple[BucketKey, str], Tensor | None] = {}
        # tensors replaced at the last commit, reused as the next staged copies (no allocation per step)
        self._spares: dict[tuple[BucketKey, str], Tensor] = {}
        # every bucket of the iteration in progress and of the one before it (dense ones too), by key
        self._layout: dict[BucketKey, tuple[int, ...]] = {}
        self._last_layout: dict[BucketKey, tuple[int, ...]] = {}
        # the checkpoint's layout, from load_state_dict until the first iteration after it is over
        self._restored: dict[BucketKey, tuple[int, ...]] = {}

    # ------------------------------------------------------------------------------------------ layouts
    def begin_iteration(self) -> None:
        """DDP's bucket 0 of a new iteration: the buckets noted since the last call are the last layout."""
        if self._layout:
            self._last_layout, self._layout = self._layout, {}
            self._restored = {}

    def note_bucket(self, key: BucketKey, numels: tuple[int, ...]) -> None:
        """Record that DDP's current layout has this bucket (kept in checkpoints for the resume).

        A bucket that :meth:`resume_parts` splits is recorded as those parts, the layout it is reduced as.
        """
        parts = self.resume_parts(key)
        if parts is None:
            self._layout[key] = numels
        for part in parts or ():
            self._layout[part.key] = tuple(numel for _, numel in part.spans)

    def holds(self, key: BucketKey) -> bool:
        """Whether the store has an entry for this exact layout."""
        return key in self._entries

    def knows_any(self, key: BucketKey) -> bool:
        """Whether any parameter of ``key`` has state from an earlier layout."""
        return any(pkey in self._param_loc for pkey in key)

    def entry(self, key: BucketKey, numels: tuple[int, ...], world_size: int) -> BucketEntry:
        """The layout's entry; a new layout inherits its parameters' slices from their old buckets."""
        entry = self._entries.get(key)
        if entry is None:
            entry = BucketEntry(numels=numels, world_size=world_size)
            self._inherit(key, entry)
            self._entries[key] = entry
        return entry

    def _inherit(self, key: BucketKey, entry: BucketEntry) -> None:
        """Copy each parameter's slices from the bucket that held it before a DDP bucket rebuild.

        A two-phase hook's phase-2 residual covers only this rank's segment of the old bucket; it is folded
        into this rank's phase-1 residual multiplied by the world size, which keeps the mean over ranks of
        what is still owed unchanged, so error feedback loses nothing across the rebuild.
        """
        sources = []
        offset = 0
        for pkey, numel in zip(key, entry.numels, strict=True):
            location = self._param_loc.get(pkey)
            if location is not None and location[0] in self._entries:
                sources.append((location[0], location[1], offset, numel))
            self._param_loc[pkey] = (key, offset)
            offset += numel
        for old_key, old_offset, new_offset, numel in sources:
            old = self._entries[old_key]
            for name, tensor in old.tensors.items():
                if name != SEGMENT_TENSOR:
                    target = entry.tensors.setdefault(name, tensor.new_zeros(entry.numel))
                    target[new_offset : new_offset + numel] = tensor[old_offset : old_offset + numel]
            overlap = old.feedback().segment_overlap(old_offset, numel)
            if overlap is not None and "residual" in old.tensors:
                start, stop, delta = overlap
                target = entry.tensors["residual"]
                lo, hi = new_offset + start - old_offset, new_offset + stop - old_offset
                target[lo:hi] = (target[lo:hi].float() + delta).to(target.dtype)
        for old_key in {source[0] for source in sources}:
            if all(self._param_loc[p][0] != old_key for p in old_key):
                del self._entries[old_key]
                self.buffers.drop(old_key)
                for stale in [k for k in self._spares if k[0] == old_key]:
                    del self._spares[stale]

    def resume_parts(self, key: BucketKey) -> list[ResumePart] | None:
        """How to compress a new layout ``key`` as checkpointed buckets (first iteration after a restore).

        Returns:
            The buckets of the checkpoint's layout that ``key`` is made of (each one whole, in the
            checkpoint's bucket order), or ``None`` to reduce ``key`` as one bucket: outside that
            iteration, for a bucket of the checkpoint's layout itself, or when ``key`` is not made of whole
            buckets of it.
        """
        if not self._restored or key in self._restored:
            return None
        position = {pkey: index for index, pkey in enumerate(key)}
        inside = [old for old in self._restored if any(p in position for p in old)]
        if sorted(p for old in inside for p in old) != sorted(key):
            return None
        numel_of = {p: n for old in inside for p, n in zip(old, self._restored[old], strict=True)}
        offsets, start = {}, 0
        for pkey in key:
            offsets[pkey], start = start, start + numel_of[pkey]
        return [ResumePart(old, tuple((offsets[p], numel_of[p]) for p in old)) for old in inside]

    # ---------------------------------------------------------------------------------------- tensors
    def current(self, entry: BucketEntry, name: str, like: Tensor, numel: int | None = None) -> Tensor:
        """The committed tensor ``name`` of a bucket, on ``like``'s device and dtype.

        ``numel`` defaults to ``like.numel()``. A missing tensor, or one of another length, starts as zeros;
        one restored from a checkpoint on another device is moved there.
        """
        numel = like.numel() if numel is None else numel
        tensor = entry.tensors.get(name)
        if tensor is None or tensor.numel() != numel:
            tensor = like.new_zeros(numel)
        elif tensor.dtype != like.dtype or tensor.device != like.device:
            tensor = tensor.to(device=like.device, dtype=like.dtype)
        entry.tensors[name] = tensor
        return tensor

    def spare(self, key: BucketKey, name: str, current: Tensor) -> Tensor:
        """An uninitialised buffer like ``current`` (the one it replaced last time) for its successor.

        Ops that read the committed tensor and write the new one in the same pass (``residual_source``)
        stage this buffer instead of copying ``current`` first.
        """
        spare = self._spares.pop((key, name), None)
        if (
            spare is None
            or (spare.shape, spare.dtype, spare.device) != (current.shape, current.dtype, current.device)
            or spare.data_ptr() == current.data_ptr()
        ):
            return torch.empty_like(current)
        return spare

    def stage(self, key: BucketKey, name: str, tensor: Tensor | None) -> None:
        """Keep ``tensor`` as the bucket's new ``name`` if this iteration turns out finite; ``None``: drop
        ``name`` then (it reads as zeros, :meth:`current`, and is no longer held)."""
        self._staged[(key, name)] = tensor

    def set_segment(self, entry: BucketEntry, start: int, world_size: int) -> None:
        """Record which part of the bucket this rank's segment tensor covers (two-phase hooks)."""
        entry.segment_start, entry.world_size = start, world_size

    def end_iteration(self, finite: bool) -> None:
        """Commit the staged tensors after a step, or drop them after a skipped one."""
        staged, self._staged = self._staged, {}
        if not finite:
            return
        for (key, name), tensor in staged.items():
            entry = self._entries.get(key)
            if entry is None:
                continue
            if tensor is None:
                entry.tensors.pop(name, None)
                self._spares.pop((key, name), None)
                continue
            old = entry.tensors.get(name)
            if self.residual_dtype is not None and name in RESIDUAL_TENSORS:
                # kept narrow, without a spare: its wide buffer would hold the memory the narrow copy saves
                entry.tensors[name] = tensor.to(self.residual_dtype)
                continue
            entry.tensors[name] = tensor
            if old is not None and old.data_ptr() != tensor.data_ptr():
                self._spares[(key, name)] = old

    def take_owed(
        self, key: BucketKey, numels: tuple[int, ...], world_size: int, segment: bool = False
    ) -> Tensor | None:
        """What a bucket's parameters still owe from compressed steps, staged as paid; ``None`` if nothing.

        Such residuals exist after a bucket rebuild put compressed parameters into a bucket that goes
        dense, or (``segment``) where a hook switches a bucket from a two-phase exchange to dense: then
        the phase-2 segment residual is owed too (:meth:`BucketEntry.owed`). They are sent with the dense
        allreduce instead of being stranded, and dropped once that step commits: a bucket that stays dense
        then holds no residual, and its next dense steps find nothing owed without reading one.
        """
        if not self.knows_any(key):
            return None
        entry = self.entry(key, numels, world_size)
        if not entry.may_owe(segment):  # e.g. a dense step after a paid switch: nothing held, no sum built
            return None
        owed = entry.owed() if segment else entry.tensors.get("residual")
        if owed is None or not bool(owed.any()):
            return None
        for name in ("residual", SEGMENT_TENSOR) if segment else ("residual",):
            if name in entry.tensors:
                self.stage(key, name, None)
        return owed

    def scale(self, factor: float) -> None:
        """Multiply every bucket tensor by ``factor`` (committed ones; call between iterations)."""
        for entry in self._entries.values():
            for tensor in entry.tensors.values():
                tensor.mul_(factor)

    def residual_bytes(self) -> int:
        """Bytes of error-feedback residuals held (between iterations: in ``residual_dtype`` when set).

        Example::

            BucketStore(torch.bfloat16).residual_bytes()  # 0: nothing compressed yet
        """
        return sum(
            tensor.numel() * tensor.element_size()
            for entry in self._entries.values()
            for name, tensor in entry.tensors.items()
            if name in RESIDUAL_TENSORS
        )

    def residual_of(self, pkey: int, numel: int) -> Tensor | None:
        """Parameter ``pkey``'s residual (fp32, flat), the phase-2 residual folded in; ``None`` if none."""
        location = self._param_loc.get(pkey)
        if location is None:
            return None
        key, offset = location
        owed = self._entries[key].feedback().owed(offset, numel)
        return torch.zeros(numel, dtype=torch.float32) if owed is None else owed

    # ------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``buckets``: every entry's parameters, sizes, segment and tensors (cloned), in the order they
        were made; ``layout``: the parameters and sizes of every bucket of the last iteration, in order
        (``[]`` when no bucket was noted since the store was made or restored without a layout)."""
        last = self._layout or self._last_layout
        layout = [{"params": list(key), "numels": list(numels)} for key, numels in last.items()]
        return {"buckets": self._entries_state(), "layout": layout}

    def _entries_state(self) -> list[dict[str, Any]]:
        return [
            {
                "params": list(key),
                "numels": list(entry.numels),
                "world_size": entry.world_size,
                "segment_start": entry.segment_start,
                "tensors": {name: tensor.clone() for name, tensor in entry.tensors.items()},
            }
            for key, entry in self._entries.items()
        ]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace everything with what :meth:`state_dict` returned (the residuals in this store's
        ``residual_dtype``, when it has one).

        The ``layout`` becomes the restored layout that the first iteration is reduced as
        (:meth:`resume_parts`). ``"layout": []`` means none: the first iteration reduces DDP's buckets as
        they come (a state merged for another world size, :mod:`fastcomm.hooks.engine.reshard`, whose old
        layout's segments and budgets belong to the old ranks). A dict without a ``layout`` key (an older
        checkpoint) restores its entries' layout.
        """
        self.__init__(self.residual_dtype)  # type: ignore[misc]
        for item in state_dict["buckets"]:
            key = tuple(int(p) for p in item["params"])
            entry = BucketEntry(
                numels=tuple(int(n) for n in item["numels"]),
                world_size=int(item["world_size"]),
                segment_start=int(item["segment_start"]),
                tensors={name: self._kept(name, tensor) for name, tensor in item["tensors"].items()},
            )
            self._entries[key] = entry
            offset = 0
            for pkey, numel in zip(key, entry.numels, strict=True):
                self._param_loc[pkey] = (key, offset)
                offset += numel
        layout = state_dict["layout"] if "layout" in state_dict else state_dict["buckets"]
        self._restored = {
            tuple(int(p) for p in item["params"]): tuple(int(n) for n in item["numels"]) for item in layout
        }
        self._last_layout = dict(self._restored)

    def _kept(self, name: str, tensor: Tensor) -> Tensor:
        """A copy of ``tensor`` as this store keeps tensor ``name`` between iterations."""
        if self.residual_dtype is not None and name in RESIDUAL_TENSORS:
            return tensor.to(self.residual_dtype, copy=True)
        return tensor.clone()
