"""Naming files: the paths a brace or glob pattern names (:func:`expand_pattern`, for local shards and,
braces only, for URLs) and where fastio keeps what it brings local (:func:`default_cache_dir`).

Example::

    expand_pattern("data/shard-{000000..000002}.tar")   # three paths, zero padding kept
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastio.errors import EmptySourceError

__all__ = ["LOCAL_COPIES", "default_cache_dir", "expand_pattern", "is_path_list"]

# The folder of a cache directory that holds local files made usable (compressed tars decompressed), kept
# apart from the remote shard cache's entries so that its limit and eviction never count or touch them.
LOCAL_COPIES = "local"

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_ALTERNATIVES = re.compile(r"\{([^{}]*,[^{}]*)\}")


def expand_pattern(pattern: str | Sequence[str]) -> list[str]:
    """Paths named by brace ranges (``{000..099}``), alternatives (``{a,b}``) and globs, in that order.

    Example::

        expand_pattern("data/shard-{000000..000002}.tar")   # three paths, zero padding kept
    """
    if not isinstance(pattern, str):
        return [p for item in pattern for p in expand_pattern(item)]
    candidates = [m for m in (_RANGE.search(pattern), _ALTERNATIVES.search(pattern)) if m is not None]
    if candidates:
        match = min(
            candidates, key=lambda m: m.start()
        )  # leftmost group first: "{a,b}-{1..2}" -> a-1, a-2, ...
        head, tail = pattern[: match.start()], pattern[match.end() :]
        if match.re is _RANGE:
            first, last = match.group(1), match.group(2)
            width = len(first) if first.startswith("0") or len(first) == len(last) else 0
            names = [f"{n:0{width}d}" for n in range(int(first), int(last) + 1)]
        else:
            names = match.group(1).split(",")
        return [p for name in names for p in expand_pattern(head + name + tail)]
    if glob.has_magic(pattern):
        found = sorted(glob.glob(pattern))
        if not found:
            raise EmptySourceError(f"{pattern}: the pattern matches no file")
        return found
    return [pattern]


def is_path_list(target: Any) -> bool:
    """True for a non-empty list of strings (paths, patterns or URLs): what a list of shards is.

    Example::

        assert is_path_list(["a.tar", "b.tar"]) and not is_path_list([])
    """
    return isinstance(target, list) and bool(target) and all(isinstance(t, str) for t in target)


def default_cache_dir() -> Path:
    """``$FASTIO_CACHE`` when set, else ``~/.cache/fastio``: where remote shards are cached and compressed
    tars decompressed.

    Example::

        cache = ShardCache(default_cache_dir())
    """
    env = os.environ.get("FASTIO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fastio"
