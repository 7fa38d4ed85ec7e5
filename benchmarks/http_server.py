"""The HTTP file server the remote-data tests and benchmarks read shards from: one folder over HTTP/1.1.

A ``ThreadingHTTPServer`` in a thread of its own, serving the files under one folder:

1. ``GET`` and ``HEAD`` with keep-alive; one ``Range: bytes=first-last`` (also ``first-`` and ``-suffix``)
   answered 206 with ``Content-Range``, 416 past the end or for any other form; 404 outside the folder.
   A file's answers carry an ``ETag`` (its mtime and size) and ``Last-Modified``, as file servers send.
2. Bodies go out with ``sendfile``, so a benchmark measures the link, not this server.
3. Every request is logged (:class:`Request`): :meth:`HttpServer.log`, :meth:`HttpServer.bytes_served`,
   and, for a client in another process, ``GET /__stats``: JSON of the requests and body bytes per path.
4. Faults the caller controls, changeable while it runs (:class:`Faults`): ``missing`` paths answered 404,
   ``denied`` 403; ``fault_rate``: the share of GETs that fail, by dropping the connection (before the
   response, or after half the body) or with 503, drawn from ``random.Random(seed)`` so a run repeats;
   ``fail_next``: the next N requests of a path answered 503; ``delay_s`` before each response.

It listens on 127.0.0.1 unless told another address (a benchmark's server inside a network namespace
listens on that namespace's end of its veth pair). Run as a program, it serves until killed and prints
``ready <port>`` once it listens.

Example::

    with HttpServer(tmp_path) as server:
        server.faults.missing.add("/shard-001.tar")
        url = server.url("shard-000.tar")
        ...
        assert server.bytes_served("/shard-000.tar") == size

    python -m benchmarks.http_server /data --host 10.231.0.130    # prints "ready <port>"
"""

from __future__ import annotations

import argparse
import dataclasses
import email.utils
import http.server
import json
import os
import random
import re
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

__all__ = ["STATS_PATH", "Faults", "HttpServer", "Request", "main"]

STATS_PATH = "/__stats"
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclasses.dataclass
class Faults:
    """What the server gets wrong on purpose (see the module docstring); change the fields at any time."""

    missing: set[str] = dataclasses.field(default_factory=set)
    denied: set[str] = dataclasses.field(default_factory=set)
    fault_rate: float = 0.0
    fail_next: dict[str, int] = dataclasses.field(default_factory=dict)
    delay_s: float = 0.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Request:
    """One request answered: ``[start, end)`` is the byte range asked for (``end`` exclusive), ``status`` 0
    for a dropped connection, ``sent`` the body bytes that went out."""

    method: str
    path: str
    start: int
    end: int
    status: int
    sent: int


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a body's last byte goes on its own (see _serve), at once
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        return  # the log is kept as data: HttpServer.log()

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        owner = self.server.owner
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        if path == STATS_PATH:
            return self._stats()
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
        stat = file.stat()
        size = stat.st_size
        start, end, status = 0, size, 200
        wanted = self.headers.get("Range")
        if wanted is not None:
            match = _RANGE.fullmatch(wanted.strip())
            if not match or match.groups() == ("", ""):
                return self._status(path, 416, size)
            first, last = match.groups()
            if first:
                start, end = int(first), min(size, int(last) + 1) if last else size
            else:  # a suffix: the last N bytes
                start = max(0, size - int(last))
            if start >= size or start >= end:
                return self._status(path, 416, size)
            status = 206
        if fault == "drop_before":
            owner._log(Request(self.command, path, start, end, 0, 0))
            self._drop()
            return None
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        # Validators, as file servers send them: a file rewritten in place (same size) is told apart.
        self.send_header("ETag", f'"{stat.st_mtime_ns:x}-{size:x}"')
        self.send_header("Last-Modified", email.utils.formatdate(stat.st_mtime, usegmt=True))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        # Every answer is logged before its last byte goes out, so a client that has its whole answer finds
        # it in the log (a body cut short by the client is not logged; one cut at its last byte is).
        if not body:
            owner._log(Request(self.command, path, start, end, status, 0))
            self.end_headers()
            return None
        self.end_headers()
        if fault == "drop_after":
            sent = self._send(file, start, (end - start) // 2)
            if sent is not None:
                owner._log(Request(self.command, path, start, end, 0, sent))
                self._drop()
            return None
        sent = self._send(file, start, end - start - 1)
        if sent is not None:
            owner._log(Request(self.command, path, start, end, status, sent + 1))
            self._send(file, start + sent, 1)
        return None

    def _send(self, file: Path, offset: int, count: int) -> int | None:
        """Send ``count`` bytes of ``file`` from ``offset``; how many went, or None if the client hung up."""
        if not count:
            return 0
        self.wfile.flush()
        with open(file, "rb") as fh:
            try:
                return self.connection.sendfile(fh, offset=offset, count=count)
            except ConnectionError:  # the client gave up (a timeout of its own)
                self.close_connection = True
                return None

    def _drop(self) -> None:
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def _status(self, path: str, status: int, size: int | None = None) -> None:
        self.send_response(status)
        if size is not None:
            self.send_header("Content-Range", f"bytes */{size}")
        self.send_header("Content-Length", "0")
        self.server.owner._log(Request(self.command, path, 0, 0, status, 0))
        self.end_headers()

    def _stats(self) -> None:
        body = json.dumps(self.server.owner.stats()).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: HttpServer

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that gave up on a slow or faulty response closes its end: expected here, not worth a trace.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class HttpServer:
    """Serves the files under ``root`` on ``host`` (127.0.0.1 unless given) and a free port, until
    :meth:`stop` or the end of the ``with`` block.

    Args:
        root: the folder served; a URL path names a file under it.
        faults: what to get wrong on purpose (:class:`Faults`); none by default.
        host: the address to listen on.
        port: the port; 0 (the default) picks a free one, then in :attr:`port`.

    Example::

        with HttpServer(folder) as server:
            data = urllib.request.urlopen(server.url("index.json")).read()
            assert server.bytes_served("/index.json") == len(data)
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        faults: Faults | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.root = Path(root).resolve()
        self.faults = faults or Faults()
        self.host = host
        self._requests: list[Request] = []
        self._lock = threading.Lock()
        self._rng = random.Random(self.faults.seed)
        self._server = _Server((host, port), _Handler)
        self._server.owner = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.daemon = True
        self._thread.start()

    def url(self, relative: str = "") -> str:
        """The URL of ``relative`` (a path under the root)."""
        return f"http://{self.host}:{self.port}/{relative.lstrip('/')}"

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
            self._requests.append(request)

    def log(self, path: str | None = None) -> list[Request]:
        """The requests answered so far (of ``path`` only, when given)."""
        with self._lock:
            return [r for r in self._requests if path is None or r.path == path]

    def clear_log(self) -> None:
        """Forget the requests answered so far (a benchmark's next run counts from zero)."""
        with self._lock:
            self._requests.clear()

    def bytes_served(self, path: str | None = None) -> int:
        """Body bytes of successful GETs of ``path`` (of every path when not given): a file downloaded once
        counts exactly its size."""
        return sum(r.sent for r in self.log(path) if r.method == "GET" and r.status in (200, 206))

    def failures(self) -> int:
        """Requests that were dropped or answered 503."""
        return sum(r.status in (0, 503) for r in self.log())

    def stats(self) -> dict[str, dict[str, int]]:
        """Per path: the requests answered and the body bytes sent (what ``GET /__stats`` answers)."""
        out: dict[str, dict[str, int]] = {}
        for r in self.log():
            entry = out.setdefault(r.path, {"requests": 0, "bytes": 0})
            entry["requests"] += 1
            entry["bytes"] += r.sent
        return out


def main(argv: Sequence[str] | None = None) -> None:
    """Serve a folder until killed; print ``ready <port>`` once listening.

    Example::

        main(["/data", "--host", "127.0.0.1"])
    """
    parser = argparse.ArgumentParser(description="Serve a folder over HTTP/1.1 with Range, until killed.")
    parser.add_argument("root", help="the folder to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    args = parser.parse_args(argv)
    with HttpServer(args.root, host=args.host, port=args.port) as server:
        print(f"ready {server.port}", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
