"""The default collate of :class:`fastio.StreamLoader`'s Python path: ``default_collate``, plus ragged fields.

:func:`collate_samples` gives exactly what ``torch.utils.data.default_collate`` gives for every structure that
function accepts (dicts, lists, tuples, namedtuples, nested; tensors, numpy arrays and scalars, Python ints,
floats and bools, str and bytes), so a transform written for DataLoader sees the same batch here. Two cases
that ``default_collate`` refuses come back as lists instead, because fastio's sources produce them:

1. tensors or numpy arrays whose shapes differ across the batch (variable-length fields such as token
   arrays): a list of tensors, one per sample;
2. ``None`` (a tar sample that lacks a field the others have): a list holding the ``None`` values.

It never allocates in shared memory (``default_collate`` does inside DataLoader workers): fastio's worker
processes hand batches over through their own slot files.

Example::

    batch = collate_samples([{"x": torch.ones(2), "n": 1}, {"x": torch.zeros(2), "n": 2}])
    assert batch["x"].shape == (2, 2) and batch["n"].dtype == torch.int64
    ragged = collate_samples([torch.ones(3), torch.ones(5)])
    assert isinstance(ragged, list) and len(ragged) == 2
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

__all__ = ["collate_samples"]


def _collate_tensors(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> Any:
    first = batch[0]
    if all(t.shape == first.shape for t in batch):
        return torch.stack(batch, 0)
    return list(batch)


def _collate_arrays(batch: list[np.ndarray], *, collate_fn_map: Any = None) -> Any:
    # default_collate refuses arrays of strings and objects with the same message; keep its rule.
    if batch[0].dtype.kind in "SaUO":
        return default_collate_fn_map[np.ndarray](batch, collate_fn_map=collate_fn_map)
    return _collate_tensors([torch.as_tensor(b) for b in batch])


def _collate_none(batch: list[None], *, collate_fn_map: Any = None) -> list[None]:
    return list(batch)


_COLLATE_FN_MAP = {
    **default_collate_fn_map,
    torch.Tensor: _collate_tensors,
    np.ndarray: _collate_arrays,
    type(None): _collate_none,
}


def collate_samples(samples: list[Any]) -> Any:
    """``torch.utils.data.default_collate(samples)``, except that tensors/arrays of unequal shapes and
    ``None`` values become lists (see the module docstring).

    Example::

        batch = collate_samples([{"x": torch.ones(2), "t": b"a"}, {"x": torch.zeros(2), "t": b"b"}])
        assert batch["x"].shape == (2, 2) and batch["t"] == [b"a", b"b"]
    """
    return collate(samples, collate_fn_map=_COLLATE_FN_MAP)
