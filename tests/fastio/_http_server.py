"""A real HTTP server for the remote tests: a ``ThreadingHTTPServer`` on 127.0.0.1 in a thread, serving one
directory with ``Range`` support, keep-alive, a per-path request log and faults the test controls.

Faults (:class:`Faults`, changeable while the server runs):

* ``missing``: paths answered 404; ``denied``: paths answered 403.
* ``fault_rate``: the share of GET requests that fail, half by dropping the connection (before the response,
  or after half the body) and half with 503; decided by a ``random.Random(seed)`` so a run repeats.
* ``fail_next``: the next N requests of a path fail (503), then it is served.
* ``delay_s``: seconds to wait before each response (a slow server).

Example::

    with HttpServer(tmp_path) as server:
        server.faults.missing.add("/shard-001.tar")
        url = server.url("shard-000.tar")
        ...
        assert server.bytes_served("/shard-000.tar") == size
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import http.server
import os
import random
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path

from fastio.remote import RetryPolicy

__all__ = ["FAST_RETRY", "Faults", "HttpServer", "Request", "cache_folder_bytes"]

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


@dataclasses.dataclass
class Faults:
    missing: set[str] = dataclasses.field(default_factory=set)
    denied: set[str] = dataclasses.field(default_factory=set)
    fault_rate: float = 0.0
    fail_next: dict[str, int] = dataclasses.field(default_factory=dict)
    delay_s: float = 0.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    path: str
    start: int
    end: int  # exclusive; bytes actually sent are counted separately
    status: int  # 0 for a dropped connection
    sent: int


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # quiet: the log is kept in server.requests
        return

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        owner = self.server.owner
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        faults = owner.faults
        if faults.delay_s:
            time.sleep(faults.delay_s)
        if path in faults.missing:
            return self._status(path, 404)
        if path in faults.denied:
            return self._status(path, 403)
        fault = owner._pick_fault(path, body)
        if fault == "503":
            return self._status(path, 503)
        file = (owner.root / path.lstrip("/")).resolve()
        if not file.is_relative_to(owner.root) or not file.is_file():
            return self._status(path, 404)
        size = file.stat().st_size
        start, end, status = 0, size, 200
        header = self.headers.get("Range")
        if header and header.startswith("bytes="):
            first, _, last = header[len("bytes=") :].partition("-")
            start = int(first) if first else max(0, size - int(last))
            end = min(size, int(last) + 1) if first and last else size
            status = 206
            if start >= size or start >= end:
                return self._status(path, 416)
        if fault == "drop_before":
            owner._log(Request(self.command, path, start, end, 0, 0))
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return None
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        sent = 0
        if body:
            limit = (end - start) // 2 if fault == "drop_after" else end - start
            with open(file, "rb") as fh:
                fh.seek(start)
                while sent < limit:
                    data = fh.read(min(1 << 20, limit - sent))
                    if not data:
                        break
                    self.wfile.write(data)
                    sent += len(data)
            if fault == "drop_after":
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                status = 0
        owner._log(Request(self.command, path, start, end, status, sent))
        return None

    def _status(self, path: str, status: int) -> None:
        owner = self.server.owner
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()
        owner._log(Request(self.command, path, 0, 0, status, 0))


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: HttpServer

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that gave up on a slow or faulty response closes its end: expected here, not worth a trace.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class HttpServer:
    """Serves ``root`` on ``127.0.0.1`` (a free port) until :meth:`stop` (or the ``with`` block ends)."""

    def __init__(self, root: str | os.PathLike[str], faults: Faults | None = None) -> None:
        self.root = Path(root).resolve()
        self.faults = faults or Faults()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._rng = random.Random(self.faults.seed)
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.daemon = True
        self._thread.start()

    def url(self, relative: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{relative.lstrip('/')}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> HttpServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _pick_fault(self, path: str, body: bool) -> str | None:
        with self._lock:
            left = self.faults.fail_next.get(path, 0)
            if left:
                self.faults.fail_next[path] = left - 1
                return "503"
            if not body or not self.faults.fault_rate or self._rng.random() >= self.faults.fault_rate:
                return None
            return self._rng.choice(("503", "drop_before", "drop_after"))

    def _log(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def log(self, path: str | None = None) -> list[Request]:
        """The requests served so far (of ``path`` only, when given)."""
        with self._lock:
            return [r for r in self.requests if path is None or r.path == path]

    def bytes_served(self, path: str) -> int:
        """Body bytes of successful GETs of ``path`` (a shard downloaded once: exactly its size)."""
        return sum(r.sent for r in self.log(path) if r.method == "GET" and r.status in (200, 206))

    def failures(self) -> int:
        """Requests that were dropped or answered 503."""
        return sum(r.status in (0, 503) for r in self.log())
