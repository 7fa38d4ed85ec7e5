"""What the remote tests share besides their HTTP server (:mod:`benchmarks.http_server`): retries fast
enough for injected faults, and the bytes a node cache folder really holds.

Example::

    source = RemoteShardSource(server.url("train/"), cache_dir=cache, retry=FAST_RETRY)
    assert cache_folder_bytes(cache) <= limit
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from fastio.remote import RetryPolicy

__all__ = ["FAST_RETRY", "cache_folder_bytes"]

# Retries fast enough for a test's injected faults (a 5 s socket timeout still bounds a stuck request).
FAST_RETRY = RetryPolicy(retries=8, backoff=0.005, max_backoff=0.05, timeout=5.0, chunk_bytes=1024)


def cache_folder_bytes(directory: Path) -> int:
    """Every byte a node cache folder holds, by its own walk (not the cache's accounting), under the cache's
    lock (``.fastio-cache.lock``, which every admission, eviction and rename takes): a walk without it could
    count an evicted entry and the one admitted after it, which never were there together."""
    total = 0
    with open(directory / ".fastio-cache.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for root, _, files in os.walk(directory):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(root, name)).st_size
    return total
