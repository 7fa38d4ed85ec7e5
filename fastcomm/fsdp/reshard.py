"""FSDP's error feedback at another world size: where each gradient element lies in the reduce-scatter's
flat input, and the re-shard of saved residuals (:meth:`fastcomm.fsdp.FSDPCompression.merge_state_dicts`).

A compressed reduce-scatter's residual is what this rank's compression of the *whole* flat gradient of a
parameter group left out, in FSDP2's layout of that gradient: ``W`` rows of ``S`` elements, row ``r``
holding chunk ``r`` of every parameter (``ceil(dim0 / W)`` rows of it, zero padded) back to back. At
another world size both ``S`` and which rows hold which element change, so a saved residual is re-sharded
in three steps:

1. Every new rank owes the mean over the old ranks of what each owed
   (:meth:`fastcomm.collectives.Residual.merge_state_dicts`, the rule every mode shares), in the old
   layout: the mean over ranks still owed, what error feedback has yet to send, is unchanged.
2. That mean is cut back into the group's parameters (:meth:`GroupLayout.split`); the padding's residual is
   owed to no parameter and is dropped.
3. The parameters are laid out again for the new world size (:meth:`GroupLayout.join`), padding zero.

HSDP's residuals (the cross-replica all-reduce's, of one shard position of the old mesh plus its segment)
belong to the old mesh's shape and are not re-sharded: :class:`FSDPReshardError` says so.

Example::

    layout = GroupLayout(shapes=((37, 13), (37,)), world_size=2)
    flat = layout.join([torch.ones(37, 13), torch.ones(37)])  # 2 rows of 19 * 13 + 19 elements
    again = layout.resized(3).join(layout.split(flat))       # the same parameters, 3 rows of 13 * 14
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor

from fastcomm.collectives.residual import Residual

__all__ = ["FSDPReshardError", "GroupLayout", "merge_reduction_states"]


class FSDPReshardError(ValueError):
    """A compression state that cannot be loaded or re-sharded at this world size; the message says how.

    Example::

        try:
            compression.load_state_dict(saved_by_two_ranks)  # now 3 ranks
        except fastcomm.fsdp.FSDPReshardError as error:
            print(error)  # merge the old ranks' states with FSDPCompression.merge_state_dicts first
    """


@dataclass(frozen=True)
class GroupLayout:
    """Where the parameters of one FSDP parameter group lie in its reduce-scatter's flat gradient.

    Attributes:
        shapes: each parameter's full shape, in the group's order (FSDP2 shards every one on dim 0).
        world_size: the ranks the group is sharded over.

    Example::

        GroupLayout(shapes=((5, 37),), world_size=2).numel  # 2 rows of 3 * 37: 222
    """

    shapes: tuple[tuple[int, ...], ...]
    world_size: int

    def _rows(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(rows of each rank's chunk, elements per row) of a parameter of ``shape``."""
        first = shape[0] if shape else 1
        return math.ceil(first / self.world_size), math.prod(shape[1:])

    @property
    def row_numel(self) -> int:
        """Elements of one rank's row (its shard of every parameter, padded), ``S``."""
        return sum(rows * width for rows, width in map(self._rows, self.shapes))

    @property
    def numel(self) -> int:
        """Elements of the flat gradient: ``world_size`` rows of :attr:`row_numel`."""
        return self.world_size * self.row_numel

    def split(self, flat: Tensor) -> list[Tensor]:
        """``flat`` (this layout's flat gradient) as the full parameters, padding dropped.

        Raises:
            FSDPReshardError: ``flat`` holds another number of elements than this layout.
        """
        if flat.numel() != self.numel:
            raise FSDPReshardError(
                f"a residual of {flat.numel()} elements does not fit the parameter group's layout "
                f"({self.numel} elements at {self.world_size} ranks): it was saved for another model"
            )
        grid = flat.reshape(self.world_size, self.row_numel)
        params, start = [], 0
        for shape in self.shapes:
            rows, width = self._rows(shape)
            chunk = grid[:, start : start + rows * width].reshape(self.world_size * rows, width)
            params.append(chunk[: shape[0] if shape else 1].reshape(shape).clone())
            start += rows * width
        return params

    def join(self, params: Sequence[Tensor]) -> Tensor:
        """The flat gradient of this layout holding ``params`` (full parameters), padding zero."""
        grid = params[0].new_zeros(self.world_size, self.row_numel)
        start = 0
        for shape, param in zip(self.shapes, params, strict=True):
            rows, width = self._rows(shape)
            padded = param.new_zeros(self.world_size * rows, width)
            padded[: shape[0] if shape else 1] = param.reshape(-1, width)
            grid[:, start : start + rows * width] = padded.reshape(self.world_size, rows * width)
            start += rows * width
        return grid.reshape(-1)

    def resized(self, world_size: int) -> GroupLayout:
        """The same parameters sharded over ``world_size`` ranks."""
        return replace(self, world_size=world_size)

    def state_dict(self) -> dict[str, Any]:
        """Plain values, for a checkpoint."""
        return {"shapes": [list(shape) for shape in self.shapes], "world_size": self.world_size}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> GroupLayout:
        """The layout :meth:`state_dict` described."""
        return cls(tuple(tuple(int(n) for n in s) for s in state["shapes"]), int(state["world_size"]))


def merge_reduction_states(
    name: str, states: Sequence[dict[str, Any]], world_size: int, rank: int
) -> dict[str, Any]:
    """The state of FSDP module ``name``'s reduction that new rank ``rank`` of ``world_size`` loads.

    Steps 1-3 of the module docstring for the residual; the step counter and traffic are old rank 0's
    (the same step on every rank: it seeds stochastic rounding alike everywhere).

    Raises:
        FSDPReshardError: an HSDP reduction, or a state saved without its layout (by an earlier release).

    Example::

        merged = merge_reduction_states("blocks.0", [sd0["reductions"]["blocks.0"], sd1[...]], 3, rank=0)
    """
    first = states[0]
    merged = {**first, "feedback": None}
    if first.get("layout") is None and first["feedback"] is not None:
        why = (
            "the state was saved without its layout (by an earlier release)"
            if "layout" not in first
            else "its layout is not known (HSDP keeps it for one shard position of the old mesh; a group "
            "with parameters that get no gradient reduces fewer elements than its parameters hold)"
        )
        raise FSDPReshardError(
            f"fastcomm.fsdp cannot re-shard the residual of FSDP module {name!r} to {world_size} ranks: "
            f"{why}; restart at {len(states)} ranks, or at {world_size} without the residuals "
            f"(error_feedback=False, or a fresh compression state)"
        )
    if first.get("layout") is None:
        return merged
    old = GroupLayout.from_state_dict(first["layout"])
    new = old.resized(world_size)
    merged["layout"] = new.state_dict()
    if first["feedback"] is None:
        return merged
    mean, _ = Residual.merge_state_dicts([state["feedback"] for state in states], world_size, rank)
    worker = mean.get("worker")
    if worker is not None:
        mean = {**mean, "worker": new.join(old.split(worker)).to(worker.dtype)}
    merged["feedback"] = mean
    return merged
