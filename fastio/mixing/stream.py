"""One weighted stream of a mixed :class:`fastio.StreamLoader`: :class:`Stream`, and the mixing modes.

Example::

    loader = fastio.StreamLoader([fastio.Stream("data/web", weight=0.7), fastio.Stream("data/code", 0.3)],
                                 batch_size=64, shuffle=True, seed=0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from fastio.errors import EmptySourceError

__all__ = ["MIX_MODES", "Stream", "as_streams"]

MIX_MODES = ("sample", "batch")


@dataclasses.dataclass(frozen=True)
class Stream:
    """A source of a mixed loader and its weight: the share of each epoch (and of each batch) it gets.

    Args:
        source: anything ``StreamLoader`` takes as a source (a shard directory, tar paths or patterns,
            compressed tars, a URL, a map-style ``Dataset``, a :class:`fastio.Source`).
        weight: its share relative to the other streams' weights (> 0, finite); default 1.
        name: what errors and ``stats()`` call it (default: the source's own name).

    Example::

        web = fastio.Stream("data/web", weight=0.7, name="web")
    """

    source: Any
    weight: float = 1.0
    name: str | None = None

    def __post_init__(self) -> None:
        try:
            weight = float(self.weight)
        except (TypeError, ValueError):
            raise ValueError(f"Stream weight must be a number > 0, got {self.weight!r}") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"Stream weight must be a finite number > 0, got {self.weight!r}")
        object.__setattr__(self, "weight", weight)


def as_streams(source: Any) -> list[Stream] | None:
    """The streams of a loader's ``source`` when it is a list or tuple of :class:`Stream`, else None; an
    empty list raises :class:`fastio.EmptySourceError` (a ``ValueError``), a list mixing streams and other
    things ``ValueError``.

    Example::

        as_streams([Stream("a"), Stream("b")])   # the two streams
        as_streams("data/train") is None
    """
    if not isinstance(source, (list, tuple)):
        return None
    if not source:
        raise EmptySourceError(
            "StreamLoader got an empty list as source; pass a path, a Dataset, or a list of fastio.Stream"
        )
    kinds: Sequence[bool] = [isinstance(s, Stream) for s in source]
    if not any(kinds):
        return None
    if not all(kinds):
        other = next(s for s, k in zip(source, kinds, strict=True) if not k)
        raise ValueError(
            f"StreamLoader's source list mixes fastio.Stream with {type(other).__name__} ({other!r}); "
            "wrap every source in fastio.Stream(source, weight=...)"
        )
    return list(source)
