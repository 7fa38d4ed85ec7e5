"""Batch stages: built-in, vectorized steps a :class:`fastio.StreamLoader` runs on each gathered batch.

A stage reads some fields of the batch the source gathered (raw bytes, arrays) and writes its results
straight into fixed-shape output tensors the loader owns (reused ring-slot buffers, pinned where asked),
so a decoded image batch is never stacked or copied again. Stages run in the worker (thread or process)
that made the batch, in order, before any per-sample ``transform``.

The contract (:class:`BatchStage`):

1. ``output_specs()`` names the fixed outputs: field -> (torch dtype, per-sample shape). The loader
   allocates ``[batch_size, *shape]`` buffers for them beside the source's own.
2. ``__call__(batch, out, ctx)`` fills ``out[name][:B]`` for every output, and returns the batch (the
   same dict, changed: consumed inputs replaced or removed, outputs added).
3. Every random draw comes from :mod:`fastio.assembly.seeding` with ``(ctx.seed, ctx.epoch, ctx.sample_ids)``:
   the same sample in the same epoch gets the same draws for any ``num_workers``, world size or resume.

Example::

    class Double:
        def output_specs(self): return {"x2": (torch.float32, (4,))}
        def __call__(self, batch, out, ctx):
            torch.mul(batch["x"].float(), 2, out=out["x2"]); batch["x2"] = out["x2"]; return batch

    loader = fastio.StreamLoader("data/train", batch_size=64, stages=[Double()])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from fastio.errors import MissingFieldError

__all__ = ["BatchStage", "StageContext", "input_field"]


@dataclasses.dataclass(frozen=True)
class StageContext:
    """What a stage may know about the batch it runs on.

    Attributes:
        seed: the loader's seed.
        epoch: the epoch this batch belongs to.
        sample_ids: int64 ``[B]``: each row's global sample index in the dataset.
        threads: how many threads the stage may use for this batch.
    """

    seed: int
    epoch: int
    sample_ids: np.ndarray
    threads: int


@runtime_checkable
class BatchStage(Protocol):
    """A vectorized step over one gathered batch (see the module docstring)."""

    def output_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]: ...

    def __call__(self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: StageContext) -> Any: ...


def input_field(batch: Mapping[str, Any], field: str, reader: str) -> Any:
    """``batch[field]``: the input a stage reads, or :class:`fastio.errors.MissingFieldError` naming the
    fields the batch has (bookkeeping fields such as ``__key__`` left out) when it has no ``field``.

    Example::

        encoded = input_field(batch, "jpg", "ImageStage(field='jpg')")
    """
    try:
        return batch[field]
    except KeyError:
        available = sorted(str(name) for name in batch if not str(name).startswith("__"))
        raise MissingFieldError(reader, field, available) from None
