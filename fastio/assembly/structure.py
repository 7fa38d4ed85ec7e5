"""Nested batch structures (dicts, lists, tuples, namedtuples) walked leaf by leaf.

Example::

    assert map_structure({"a": [1, (2, 3)]}, lambda v: v * 10) == {"a": [10, (20, 30)]}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["map_structure", "map_tensors"]


def map_structure(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to every leaf of nested dicts, lists, tuples and namedtuples; the structure is kept.

    Example::

        Pair = collections.namedtuple("Pair", "x y")
        assert map_structure({"a": [1, Pair(2, 3)]}, lambda v: v * 10) == {"a": [10, Pair(20, 30)]}
    """
    if isinstance(value, dict):
        return {k: map_structure(v, fn) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_structure(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_structure(v, fn) for v in value)
    return fn(value)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` applied to every tensor leaf of a nested structure; other leaves are kept as they are.

    Example::

        halves = map_tensors({"x": torch.ones(2), "key": "a"}, lambda t: t / 2)
    """
    return map_structure(value, lambda v: fn(v) if isinstance(v, torch.Tensor) else v)
