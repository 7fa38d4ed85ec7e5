"""What the remote tests share besides their HTTP server (:mod:`benchmarks.http_server`): retries fast
enough for injected faults, and the bytes a node cache folder really holds (one walk, shared with the
benchmarks: :func:`benchmarks.common.cache_folder_bytes`).

Example::

    source = RemoteShardSource(server.url("train/"), cache_dir=cache, retry=FAST_RETRY)
    assert cache_folder_bytes(cache) <= limit
"""

from __future__ import annotations

from benchmarks.common import cache_folder_bytes
from fastio.remote import RetryPolicy

__all__ = ["FAST_RETRY", "cache_folder_bytes"]

# Retries fast enough for a test's injected faults (a 5 s socket timeout still bounds a stuck request).
FAST_RETRY = RetryPolicy(retries=8, backoff=0.005, max_backoff=0.05, timeout=5.0, chunk_bytes=1024)
