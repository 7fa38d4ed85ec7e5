"""File locks that survive a fork correctly: every descriptor holding (or waiting for) a ``flock`` is
recorded, so that a forked child closes its copies. A copy left open in the child would keep the parent's
lock held for as long as the child lives. Opening and closing happen under one lock, which a fork takes
first, so no child is born between an open and its record. The shard cache (:mod:`fastio.remote.cache`)
takes all its locks through here.

Example::

    with flock(Path("/tmp/fastio-cache/.fastio-cache.lock"), fcntl.LOCK_EX):
        ...
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["close_held", "close_lock", "flock", "open_lock", "try_flock"]

_LOCK_FDS: set[int] = set()
_LOCK_FDS_LOCK = threading.RLock()  # a finalizer may close a lock on a thread that holds it


def open_lock(path: Path | str) -> int:
    """A descriptor of lock file ``path`` (created), recorded so that a forked child closes its copy."""
    with _LOCK_FDS_LOCK:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        _LOCK_FDS.add(fd)
    return fd


def close_lock(fd: int) -> None:
    """Close a descriptor of :func:`open_lock`: the last one of its open file releases its flock."""
    with _LOCK_FDS_LOCK:
        _LOCK_FDS.discard(fd)
        os.close(fd)


def close_held(held: dict[str, tuple[int, int]]) -> None:
    """Close every descriptor of ``held`` (name -> (descriptor, count)) and empty it: the finalizer of a
    table of held locks (the shard cache's pins), so they go with it."""
    for fd, _ in list(held.values()):
        with contextlib.suppress(OSError):
            close_lock(fd)
    held.clear()


@contextlib.contextmanager
def flock(path: Path, mode: int) -> Iterator[int]:
    """Hold ``fcntl.flock(mode)`` on lock file ``path`` for a ``with`` block."""
    fd = open_lock(path)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        close_lock(fd)


def try_flock(fd: int) -> bool:
    """An exclusive flock on ``fd`` without waiting; False when another open file holds one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _before_fork() -> None:
    _LOCK_FDS_LOCK.acquire()


def _after_fork_in_parent() -> None:
    _LOCK_FDS_LOCK.release()


def _after_fork_in_child() -> None:
    global _LOCK_FDS_LOCK
    _LOCK_FDS_LOCK = threading.RLock()
    for fd in list(_LOCK_FDS):  # the parent's copies keep its locks; the child lets go of its own
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
