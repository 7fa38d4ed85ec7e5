"""Error feedback: what compression left out, owed to the next call. One store for every mode.

A :class:`Residual` holds, for one tensor reduced again and again:

* ``worker``: what this rank's compression of the tensor left out (one element per element);
* ``server``: what the re-compression of this rank's segment of a two-phase all-reduce left out, the
  segment being ``[segment_start, segment_start + len)`` of a ``world_size``-rank exchange;
* ``compressor_state``: a compressor's own state between calls (PowerSGD's warm start).

The DDP hooks keep one per bucket layout (:meth:`fastcomm.hooks.engine.store.BucketEntry.feedback`), FSDP
one per parameter group, DiLoCo one per fragment, and a caller of :mod:`fastcomm.collectives` its own. The
rules they share live here:

1. **What a rank owes** (:meth:`Residual.owed`): ``worker`` plus ``world_size`` times ``server`` over the
   segment, in fp32. The mean over ranks of what they owe is what error feedback still has to send.
2. **Kept narrow** (``residual_dtype``, e.g. ``torch.bfloat16``: half the memory of fp32): between calls
   the tensors are kept in that dtype (:meth:`Residual.keep`) and widened back to the exchange's dtype for
   the next call (:meth:`Residual.take`, :meth:`Residual.lend`).
3. **Re-sharded** to another world size (:meth:`Residual.merge_state_dicts`): at the same world size each
   rank keeps its own, so a resume is bit-identical; at another, every new rank owes the mean over the old
   ranks of what each owed (:func:`mean_over_ranks`), so the mean over ranks still owed is unchanged and no
   segment of the old group is kept. A compressor state (the same on every rank) is averaged too.

Example::

    residual = Residual(torch.bfloat16)
    fastcomm.collectives.all_reduce(tensor, compressor, residual=residual)
    residual.keep()  # the call is over: keep the residual in bf16 until the next one
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["Residual", "check_residual_dtype", "mean_over_ranks"]

_TENSORS = ("worker", "server", "compressor_state")


class Residual:
    """Error feedback owned by its caller, for one tensor of one size reduced again and again.

    The tensors are made (zeros) at the first call that needs them: ``worker`` like the tensor (fp32 for an
    :class:`~fastcomm.compress.AllreduceCompressor`), ``server`` this rank's segment of a two-phase
    all-reduce (fp32), ``compressor_state`` for a compressor that ``keeps_state`` (PowerSGD's warm start).
    Save and load it with :meth:`state_dict` / :meth:`load_state_dict`; re-shard saved ones to another
    world size with :meth:`merge_state_dicts`.

    Args:
        residual_dtype: the dtype the tensors are kept in between calls (:meth:`keep`); ``None``: the
            exchange's own, no copies.
        worker, server, compressor_state, segment_start, world_size: tensors already held (a view of
            another store's tensors), and where ``server`` lies.

    Example::

        residual = fastcomm.collectives.Residual()
        for step in range(steps):
            fastcomm.collectives.all_reduce(pseudo_gradient, compressor, residual=residual)
    """

    def __init__(
        self,
        residual_dtype: torch.dtype | None = None,
        *,
        worker: Tensor | None = None,
        server: Tensor | None = None,
        compressor_state: Tensor | None = None,
        segment_start: int = 0,
        world_size: int = 1,
    ) -> None:
        self.residual_dtype = check_residual_dtype(residual_dtype)
        self.worker, self.server, self.compressor_state = worker, server, compressor_state
        self.segment_start, self.world_size = segment_start, world_size
        self._pending: torch.futures.Future | None = None
        # residual_dtype's copies kept between calls, and the dtype each is widened to for a call
        self._kept: dict[str, Tensor] = {}
        self._working: dict[str, torch.dtype] = {}

    def __repr__(self) -> str:
        held = {name: tuple(t.shape) for name in _TENSORS if (t := self._held(name)) is not None}
        return f"Residual(residual_dtype={self.residual_dtype}, held={held})"

    # ------------------------------------------------------------------------------------- one call
    def settle(self) -> None:
        """Wait for the exchange that last wrote these tensors (a call's second collective may still run),
        and let go of it (its future holds every code buffer it sent and received)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def hold_until(self, future: torch.futures.Future) -> None:
        """Record that the exchange completing ``future`` writes these tensors (:meth:`settle` waits)."""
        self._pending = future

    def take(self, name: str, like: Tensor, numel: int) -> Tensor:
        """Tensor ``name`` (zeros at first; a kept one widened); ``ValueError`` if it was made for another
        size or dtype."""
        self.settle()
        current = getattr(self, name)
        if current is None and name in self._kept:
            current = self._kept.pop(name).to(self._working[name])
            setattr(self, name, current)
        if current is None:
            current = torch.zeros(numel, dtype=like.dtype, device=like.device)
        elif (current.numel(), current.dtype) != (numel, like.dtype):
            raise ValueError(
                f"Residual.{name} holds {current.numel()} {current.dtype} elements, this call needs {numel} "
                f"{like.dtype}: use one Residual per tensor, compressor and world size"
            )
        setattr(self, name, current)
        return current

    def place_segment(self, segment_start: int, world_size: int) -> None:
        """Record where ``server`` lies: ``[segment_start, segment_start + len)`` of a ``world_size``-rank
        exchange (a two-phase all-reduce's segment of this rank)."""
        self.segment_start, self.world_size = segment_start, world_size

    def lend(self) -> Residual:
        """This residual with its kept tensors widened to the exchange's dtype (itself, ready for a call)."""
        for name in list(self._kept):
            if getattr(self, name) is None:
                setattr(self, name, self._kept.pop(name).to(self._working[name]))
        return self

    def keep(self) -> None:
        """After a call: :meth:`settle`, then keep the tensors in ``residual_dtype`` and free the working
        copies (without a ``residual_dtype`` they stay as the call left them)."""
        self.settle()
        if self.residual_dtype is None:
            return
        for name in _TENSORS:
            working = getattr(self, name)
            if working is not None:
                self._working[name] = working.dtype
                self._kept[name] = working.to(self.residual_dtype)
                setattr(self, name, None)

    def nbytes(self) -> int:
        """Bytes held (between calls: what :meth:`keep` left)."""
        tensors = [getattr(self, name) for name in _TENSORS] + list(self._kept.values())
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # ------------------------------------------------------------------------------------ what is owed
    def _held(self, name: str) -> Tensor | None:
        """Tensor ``name`` in the exchange's dtype (a kept one widened, as a copy), or ``None``."""
        current = getattr(self, name)
        if current is None and name in self._kept:
            current = self._kept[name].to(self._working[name])
        return current

    def segment_overlap(self, offset: int, numel: int) -> tuple[int, int, Tensor] | None:
        """The part ``[start, stop)`` of ``[offset, offset + numel)`` that ``server`` covers.

        Returns ``(start, stop, world_size * server there)`` (what the mean over ranks owes for those
        elements, held by this rank alone), or ``None`` when they do not overlap.

        Example::

            Residual(server=torch.ones(4), segment_start=4, world_size=2).segment_overlap(0, 6)
            # (4, 6, tensor([2., 2.]))
        """
        server = self._held("server")
        if server is None:
            return None
        start = max(offset, self.segment_start)
        stop = min(offset + numel, self.segment_start + server.numel())
        if start >= stop:
            return None
        return start, stop, server[start - self.segment_start : stop - self.segment_start] * self.world_size

    def owed(self, offset: int = 0, numel: int | None = None) -> Tensor | None:
        """What this rank still owes for elements ``[offset, offset + numel)`` (fp32), or ``None`` if it
        holds neither residual.

        ``worker`` plus ``world_size`` times ``server`` over the segment (the part of a segment past the
        tensor is padding, and owes nothing). ``numel`` defaults to ``worker``'s.

        Example::

            residual = Residual(worker=torch.ones(10), server=torch.ones(8), segment_start=8, world_size=2)
            residual.owed()  # 1 for elements 0-7, 1 + 2 * 1 = 3 for 8-9 (elements 10-15 are padding)
        """
        worker, server = self._held("worker"), self._held("server")
        if worker is None and server is None:
            return None
        if numel is None:
            numel = worker.numel() - offset if worker is not None else self.segment_start + server.numel()
        device = (worker if worker is not None else server).device
        out = torch.zeros(numel, dtype=torch.float32, device=device)
        if worker is not None:
            out += worker[offset : offset + numel].float()
        overlap = self.segment_overlap(offset, numel)
        if overlap is not None:
            start, stop, delta = overlap
            out[start - offset : stop - offset] += delta
        return out

    # ------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The tensors (copies; ``None`` where not made yet; in ``residual_dtype`` when kept in it), the
        dtype each is widened to for a call (``"working"``, with a ``residual_dtype``) and where ``server``
        lies (``"segment_start"``, ``"world_size"``, when it is held)."""
        self.settle()
        state: dict[str, Any] = {}
        for name in _TENSORS:
            current = getattr(self, name)
            if current is not None and self.residual_dtype is not None:
                self._working[name] = current.dtype
                current = current.to(self.residual_dtype)
            elif current is None:
                current = self._kept.get(name)
            state[name] = None if current is None else current.clone()
        if self.residual_dtype is not None and self._working:
            state["working"] = {name: str(dtype) for name, dtype in self._working.items()}
        if state["server"] is not None:
            state["segment_start"], state["world_size"] = self.segment_start, self.world_size
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (or an FSDP ``ErrorFeedback``'s, ``tensors`` and
        ``working`` by name)."""
        self.settle()
        if "tensors" in state_dict:
            tensors = dict(state_dict["tensors"])
        else:
            tensors = {name: state_dict[name] for name in _TENSORS if state_dict.get(name) is not None}
        working = {k: _dtype(v) for k, v in state_dict.get("working", {}).items()}
        working = {name: working.get(name, tensor.dtype) for name, tensor in tensors.items()}
        self.segment_start = int(state_dict.get("segment_start", 0))
        self.world_size = int(state_dict.get("world_size", 1))
        self._kept, self._working = {}, {}
        for name in _TENSORS:
            setattr(self, name, None)
        if self.residual_dtype is None:
            for name, tensor in tensors.items():
                setattr(self, name, tensor.to(working[name]))
            return
        self._kept = {name: tensor.to(self.residual_dtype) for name, tensor in tensors.items()}
        self._working = working

    @classmethod
    def merge_state_dicts(
        cls, states: Sequence[dict[str, Any]], world_size: int, rank: int
    ) -> tuple[dict[str, Any], str]:
        """The state_dict new rank ``rank`` of ``world_size`` loads, from every old rank's (rule 3).

        Returns:
            ``(state_dict, why)``: at the same world size old rank ``rank``'s own; else ``worker`` the mean
            over old ranks of :meth:`owed`, in old rank 0's dtype, no ``server`` (folded in), and the mean
            ``compressor_state``; ``why`` says which, in words.

        Raises:
            ValueError: no states, ``rank`` outside ``world_size``, or old ranks' tensors of other sizes.

        Example::

            merged, why = Residual.merge_state_dicts([r0.state_dict(), r1.state_dict()], 3, rank=2)
        """
        if not states:
            raise ValueError("Residual.merge_state_dicts needs the state_dicts of the old ranks; got none")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if len(states) == world_size:
            return states[rank], f"Residual: same world size ({world_size}): old rank {rank}'s own, unchanged"
        olds = []
        for state in states:
            olds.append(cls())
            olds[-1].load_state_dict(state)
        numels = {old.worker.numel() for old in olds if old.worker is not None}
        if len(numels) > 1:
            raise ValueError(f"the old ranks' residuals hold {sorted(numels)} elements: one tensor's, please")
        numel = numels.pop() if numels else None
        merged: dict[str, Any] = dict.fromkeys(_TENSORS)
        if numel is not None:
            owed = [old.owed(0, numel) for old in olds]
            merged["worker"] = mean_over_ranks(owed, [_dtype_of(old.worker) for old in olds])
        kept = [old.compressor_state for old in olds]
        merged["compressor_state"] = mean_over_ranks([t if t is None else t.float() for t in kept],
                                                     [_dtype_of(t) for t in kept])  # fmt: skip
        working = states[0].get("working")
        if working:
            merged["working"] = {k: v for k, v in working.items() if merged.get(k) is not None}
        why = (
            f"Residual: {len(states)} -> {world_size} ranks: every rank owes the mean over the old ranks of "
            f"what each owed (segment residuals folded in), so the mean over ranks still owed is unchanged"
        )
        return merged, why


def check_residual_dtype(residual_dtype: object, error_feedback: bool = True) -> torch.dtype | None:
    """``residual_dtype`` if it is a floating-point ``torch.dtype`` or ``None``: the one check of the option
    wherever error feedback is kept (FSDP's reductions, the DDP hooks' states, DiLoCo, :class:`Residual`).

    Raises:
        ValueError: not a floating-point dtype, or a dtype given with ``error_feedback=False`` (no residual
            to keep in it).

    Example::

        >>> check_residual_dtype(torch.bfloat16)
        torch.bfloat16
    """
    if residual_dtype is not None and (
        not isinstance(residual_dtype, torch.dtype) or not residual_dtype.is_floating_point
    ):
        raise ValueError(f"residual_dtype must be a floating-point dtype or None, got {residual_dtype!r}")
    if residual_dtype is not None and not error_feedback:
        raise ValueError("residual_dtype needs error_feedback=True")
    return residual_dtype


def mean_over_ranks(values: Sequence[Tensor | None], dtypes: Sequence[torch.dtype | None]) -> Tensor | None:
    """The mean over old ranks of one tensor, a rank without it counting as zeros; ``None`` if none has it.

    ``values`` are each old rank's tensor in fp32 (what it owes, for a residual), ``dtypes`` the dtype each
    held it in: the mean is summed in fp32 on the first holder's device, divided by ``len(values)``, and
    cast to the dtype of the first rank that held one.

    Example::

        >>> mean_over_ranks([torch.ones(2), None], [torch.float32, None])
        tensor([0.5000, 0.5000])
    """
    dtype, total = torch.float32, None
    for value, held in zip(values, dtypes, strict=True):
        if held is not None and total is None:
            dtype = held
        if value is not None:
            total = value.clone() if total is None else total.add_(value.to(total.device))
    return None if total is None else total.div_(len(values)).to(dtype)


def _dtype_of(tensor: Tensor | None) -> torch.dtype | None:
    return None if tensor is None else tensor.dtype


def _dtype(name: str | torch.dtype) -> torch.dtype:
    """``"torch.bfloat16"`` (as a state_dict saves it) as ``torch.bfloat16``."""
    return name if isinstance(name, torch.dtype) else getattr(torch, name.removeprefix("torch."))
