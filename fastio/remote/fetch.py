"""Reading remote objects through fsspec, with a bounded retry policy and errors that name the URL.

Any URL fsspec understands works: ``s3://`` (s3fs), ``gs://`` (gcsfs), ``az://``/``abfs://`` (adlfs),
``http(s)://`` (aiohttp), ``file://`` and plain paths. Credentials come from the environment the way each
filesystem expects (``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``...) or from ``storage_options``; they never
appear in a message: :func:`redact` (:mod:`fastio.remote.errors`) strips ``user:password@`` and query
values from every URL fastio prints.

How a failure is treated (:func:`classify`, :func:`with_retries`):

1. A missing object (HTTP 404/410, S3 ``NoSuchKey``/``NoSuchBucket``, ``FileNotFoundError``) raises
   :class:`RemoteNotFoundError` at once; denied access (401/403, ``AccessDenied``, ``PermissionError``)
   raises :class:`RemoteAccessError` at once. Both name the URL and the code.
2. A transient failure (connection reset or dropped, a body cut short, a timeout, HTTP 408/429/5xx, S3
   ``SlowDown``/``InternalError``) is retried up to ``RetryPolicy.retries`` times, sleeping
   ``min(max_backoff, backoff * 2**attempt)`` scaled by a random factor in ``[1 - jitter, 1]`` before each
   retry; then :class:`RemoteReadError` names the URL, the attempts and the last cause.
3. Anything else (a bug, a bad argument) is not retried: it raises :class:`RemoteReadError` after one
   attempt, naming the URL and the cause.

fsspec's HTTP ``info`` reports every failure as ``FileNotFoundError``; :func:`classify` looks through the
exception's cause for the real HTTP status, so a 503 on a HEAD is retried and only a real 404 is "missing".

Example::

    policy = RetryPolicy(retries=5)
    urls = expand_urls("http://127.0.0.1:8000/data/shard-{000..009}.bin")
    size = remote_size(urls[0], policy)
    download(urls[0], "/tmp/shard-000.bin", size, policy)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import http.client
import io
import os
import random
import re
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastio.files.paths import expand_pattern
from fastio.remote.errors import (
    RemoteAccessError,
    RemoteError,
    RemoteNotFoundError,
    RemoteReadError,
    redact,
)

__all__ = [
    "RemoteAccessError", "RemoteError", "RemoteNotFoundError", "RangeReader", "RemoteReadError",
    "RetryPolicy", "cat_ranges", "classify", "download", "expand_urls", "filesystem", "is_remote",
    "object_info", "read_bytes", "redact", "remote_size", "with_retries",
]  # fmt: skip

T = TypeVar("T")

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How transient failures are retried (see the module docstring).

    Args:
        retries: retries after the first attempt (0: fail on the first transient error).
        backoff: seconds before the first retry; doubled for each further one.
        max_backoff: cap of one sleep.
        jitter: each sleep is scaled by a random factor in ``[1 - jitter, 1]`` (ranks that failed together
            do not retry together).
        timeout: seconds a connection or a read may stall before it counts as a transient failure.
        chunk_bytes: bytes per ranged read of a download (a retry resumes from the last whole chunk).

    Example::

        RetryPolicy(retries=3, backoff=0.1, timeout=30)
    """

    retries: int = 5
    backoff: float = 0.25
    max_backoff: float = 8.0
    jitter: float = 0.5
    timeout: float = 60.0
    chunk_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError(f"backoff and max_backoff must be >= 0, got {self.backoff}, {self.max_backoff}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to sleep before retry number ``attempt`` (0-based)."""
        base = min(self.max_backoff, self.backoff * 2.0**attempt)
        return base * (1.0 - self.jitter * rng.random())


def is_remote(path: Any) -> bool:
    """True for a URL with a scheme other than ``file://`` (what the remote source handles).

    Example::

        assert is_remote("s3://bucket/train/") and not is_remote("/data/train")
    """
    return isinstance(path, str) and bool(_SCHEME.match(path)) and not path.startswith("file://")


def filesystem(
    url: str, storage_options: dict[str, Any] | None = None, timeout: float = 60.0
) -> tuple[Any, str]:
    """``(fsspec filesystem, path within it)`` for ``url``. HTTP gets a socket timeout of ``timeout`` seconds
    (unless ``storage_options`` sets ``client_kwargs``), so a stalled server counts as a transient failure.

    Resolved on every call: fsspec caches instances per process, and a forked worker gets its own.

    Example::

        fs, path = filesystem("http://127.0.0.1:8000/data/listing")
    """
    import fsspec

    options = dict(storage_options or {})
    if url.startswith(("http://", "https://")) and "client_kwargs" not in options:
        import aiohttp

        options["client_kwargs"] = {
            "timeout": aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        }
    return fsspec.core.url_to_fs(url, **options)


def _statuses(exc: BaseException) -> list[tuple[str, BaseException]]:
    """Every status or error code found on ``exc`` and its causes, innermost last."""
    found: list[tuple[str, BaseException]] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):  # botocore ClientError
            error = response.get("Error", {})
            if error.get("Code"):
                found.append((str(error["Code"]), current))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                found.append((str(status), current))
        elif response is not None and getattr(response, "status_code", None):  # requests HTTPError
            found.append((str(response.status_code), current))
        status = getattr(current, "status", None)  # aiohttp ClientResponseError
        if isinstance(status, int):
            found.append((str(status), current))
        current = current.__cause__ or current.__context__
    return found


_MISSING_CODES = {"404", "410", "NoSuchKey", "NoSuchBucket", "NotFound", "ResourceNotFound", "BlobNotFound"}
_DENIED_CODES = {"401", "403", "AccessDenied", "Forbidden", "AuthorizationFailure", "InvalidAccessKeyId"}
_TRANSIENT_CODES = {
    "408", "429", "RequestTimeout", "SlowDown", "Throttling", "ThrottlingException", "InternalError",
    "ServiceUnavailable", "RequestTimeTooSkewed",
}  # fmt: skip
_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT}


def _transient_type(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError, http.client.HTTPException)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    try:
        import aiohttp
    except ImportError:
        return False
    # Connection failures, a server that closed mid-response, a body cut short.
    return isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))


def classify(exc: BaseException) -> tuple[str, str]:
    """``(kind, code)`` of a failed remote call: kind is ``"missing"``, ``"denied"``, ``"transient"`` or
    ``"fatal"``; code is the HTTP status or store error code found (or the exception's type name).

    Example::

        assert classify(ConnectionResetError())[0] == "transient"
        assert classify(FileNotFoundError("x"))[0] == "missing"
    """
    for code, _ in _statuses(exc):
        if code in _MISSING_CODES:
            return "missing", code
        if code in _DENIED_CODES:
            return "denied", code
        if code in _TRANSIENT_CODES or (code.isdigit() and 500 <= int(code) <= 599):
            return "transient", code
    current: BaseException | None = exc
    seen: set[int] = set()
    while current is not None and id(current) not in seen:  # a transport failure anywhere in the chain
        seen.add(id(current))
        if _transient_type(current):
            return "transient", type(current).__name__
        current = current.__cause__ or current.__context__
    if isinstance(exc, FileNotFoundError):
        return "missing", "FileNotFoundError"
    if isinstance(exc, PermissionError):
        return "denied", "PermissionError"
    return "fatal", type(exc).__name__


def _describe(exc: BaseException, code: str) -> str:
    text = redact(str(exc))[:300]
    label = f"HTTP {code}" if code.isdigit() else code
    return f"{label} ({type(exc).__name__}: {text})" if text else label


def with_retries(
    call: Callable[[], T],
    url: str,
    policy: RetryPolicy,
    rng: random.Random | None = None,
    on_retry: Callable[[int, str], None] | None = None,
) -> T:
    """``call()`` under ``policy``: missing/denied raise at once, transient failures are retried with
    backoff, then :class:`RemoteReadError` (see the module docstring). ``on_retry(attempt, cause)`` is told
    of each retry.

    Example::

        data = with_retries(lambda: fs.cat_file(path), url, RetryPolicy(retries=3))
    """
    rng = rng or random.Random()
    attempt = 0
    while True:
        try:
            return call()
        except RemoteError:
            raise
        except Exception as exc:  # sorted by classify(): only transient failures are retried
            kind, code = classify(exc)
            if kind == "missing" and code == "FileNotFoundError" and url.startswith(("http://", "https://")):
                code = "404"  # fsspec's HTTP filesystem raises a bare FileNotFoundError for exactly that
            if kind == "missing":
                raise RemoteNotFoundError(url, code) from None
            if kind == "denied":
                raise RemoteAccessError(url, code) from None
            cause = _describe(exc, code)
            if kind == "fatal" or attempt >= policy.retries:
                raise RemoteReadError(url, attempt + 1, cause) from None
            if on_retry is not None:
                on_retry(attempt, cause)
            time.sleep(policy.delay(attempt, rng))
            attempt += 1


def expand_urls(pattern: str | Sequence[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """The URLs named by brace ranges (``{000..099}``), alternatives (``{a,b}``) and globs (``*``, ``[...]``
    in the path, listed through the filesystem), in that order; a list is expanded item by item.

    Example::

        expand_urls("http://127.0.0.1:8000/shard-{000..002}.bin")   # three URLs, zero padding kept
    """
    if not isinstance(pattern, str):
        return [url for item in pattern for url in expand_urls(item, storage_options)]
    # Braces only: glob characters are set aside (a URL's "?" starts its query, not a wildcard).
    hidden = pattern.replace("*", "\x00").replace("?", "\x01").replace("[", "\x02")
    expanded = [
        u.replace("\x00", "*").replace("\x01", "?").replace("\x02", "[") for u in expand_pattern(hidden)
    ]
    urls = []
    for url in expanded:
        path = urllib.parse.urlsplit(url).path if _SCHEME.match(url) else url
        if "*" in path or "[" in path:
            fs, fspath = filesystem(url, storage_options)
            found = sorted(fs.glob(fspath))
            if not found:
                raise RemoteNotFoundError(url, "the pattern matches no object")
            urls.extend(fs.unstrip_protocol(f) if _SCHEME.match(url) else f for f in found)
        else:
            urls.append(url)
    return urls


def object_info(url: str, policy: RetryPolicy, storage_options: dict[str, Any] | None = None) -> dict:
    """What the store reports of the object at ``url`` (``fs.info``: its ``size``, checked to be there, and
    what else the store gives, such as an HTTP server's ``ETag``), under ``policy``.

    Example::

        info = object_info("http://127.0.0.1:8000/train/shard-000000.bin", RetryPolicy())
    """

    def info() -> dict[str, Any]:
        fs, path = filesystem(url, storage_options, policy.timeout)
        found = dict(fs.info(path))
        if found.get("size") is None:
            raise RemoteReadError(url, 1, "the server does not report the object's size (no Content-Length)")
        return found

    return with_retries(info, url, policy)


def remote_size(url: str, policy: RetryPolicy, storage_options: dict[str, Any] | None = None) -> int:
    """The size in bytes of the object at ``url`` (:func:`object_info`), under ``policy``.

    Example::

        n = remote_size("s3://bucket/train/shard-000000.bin", RetryPolicy())
    """
    return int(object_info(url, policy, storage_options)["size"])


def read_bytes(url: str, policy: RetryPolicy, storage_options: dict[str, Any] | None = None) -> bytes:
    """The whole object at ``url`` (for small ones: a listing, sidecars), under ``policy``.

    Example::

        listing = json.loads(read_bytes("http://127.0.0.1:8000/data/listing", RetryPolicy()))
    """

    def cat() -> bytes:
        fs, path = filesystem(url, storage_options, policy.timeout)
        return bytes(fs.cat_file(path))

    return with_retries(cat, url, policy)


def cat_ranges(
    url: str, ranges: Sequence[tuple[int, int]], size: int, policy: RetryPolicy,
    storage_options: dict[str, Any] | None,
) -> tuple[list[bytes], bool]:  # fmt: skip
    """Bytes ``[start, stop)`` of the ``size``-byte object at ``url`` for each of ``ranges`` (concurrently
    on HTTP and object stores), one attempt (for :func:`with_retries`), and whether the server ignored
    ``Range`` (sent the whole object, sliced here). Never short: fewer bytes than asked (a body cut short,
    an object shorter than ``size``) raise a transient error, retried, then :class:`RemoteReadError`.

    Example::

        [head], _ = with_retries(lambda: cat_ranges(url, [(0, 32)], size, policy, None), url, policy)
    """
    fs, path = filesystem(url, storage_options, policy.timeout)
    starts, stops = [int(a) for a, _ in ranges], [int(b) for _, b in ranges]
    found = fs.cat_ranges([path] * len(ranges), starts, stops, on_error="raise")
    out, whole = [], False
    for start, stop, data in zip(starts, stops, found, strict=True):
        if len(data) > stop - start:
            if len(data) != size:
                got = f"asked for bytes [{start}, {stop}) of {size}, got {len(data)} bytes"
                raise RemoteReadError(url, 1, got)
            data, whole = data[start:stop], True
        if len(data) < stop - start:  # a body cut short: transient
            raise http.client.IncompleteRead(bytes(data[:64]), stop - start - len(data))
        out.append(bytes(data))
    return out, whole


class RangeReader(io.RawIOBase):
    """A read-only, forward-only file over the ``size`` bytes of ``url``: ranged reads of
    ``policy.chunk_bytes``, each under ``policy`` (a transient failure retries that chunk only, so progress
    is kept and memory stays one chunk). What a streaming decompressor reads from.

    HTTP(S) objects are streamed by one plain GET instead (a new ranged request per chunk restarts TCP
    from slow start after each idle gap: one ranged stream ran at ~0.75x of a shaped 1 Gbit/s link, a
    streamed GET at its rate), reopened after a transient failure and read forward to where the last whole
    chunk ended (the retry budget stays per chunk). Any other store that ignores ``Range`` answers the
    first ranged read with the whole object and is then streamed the same way.

    Example::

        with RangeReader(url, size, RetryPolicy()) as raw:
            head = raw.read(512)
    """

    def __init__(
        self,
        url: str,
        size: int,
        policy: RetryPolicy,
        storage_options: dict[str, Any] | None = None,
        on_bytes: Callable[[int], None] | None = None,
        on_retry: Callable[[int, str], None] | None = None,
    ) -> None:
        super().__init__()
        self.url, self.size, self.policy = url, int(size), policy
        self.storage_options, self.on_bytes, self.on_retry = storage_options, on_bytes, on_retry
        self.position = 0
        self._buffer = b""
        self._rng = random.Random()
        # Ranged reads, except over HTTP (see the class docstring) or once a server showed it ignores Range.
        self._ranges = not url.startswith(("http://", "https://"))
        self._stream: Any = None
        self._stream_at = 0

    def readable(self) -> bool:
        return True

    def _chunk(self, start: int, stop: int) -> bytes:
        if not self._ranges:
            return self._streamed(start, stop)
        [data], whole = cat_ranges(self.url, [(start, stop)], self.size, self.policy, self.storage_options)
        self._ranges = not whole  # the whole object came back: stream the rest with one GET
        return data

    def _streamed(self, start: int, stop: int) -> bytes:
        try:
            if self._stream is None or self._stream_at > start:
                fs, path = filesystem(self.url, self.storage_options, self.policy.timeout)
                # The size is known: fsspec's HTTP open then sends no HEAD before its GET.
                sized = {"size": self.size} if self.url.startswith(("http://", "https://")) else {}
                self._stream, self._stream_at = fs.open(path, "rb", block_size=0, **sized), 0
            while self._stream_at < start:  # forward to where the last good chunk ended
                skipped = self._stream.read(min(start - self._stream_at, 1 << 20))
                if not skipped:
                    raise http.client.IncompleteRead(b"", start - self._stream_at)
                self._stream_at += len(skipped)
            parts, wanted = [], stop - start
            while wanted:
                part = self._stream.read(wanted)
                if not part:
                    raise http.client.IncompleteRead(b"".join(parts)[:64], wanted)
                parts.append(part)
                wanted -= len(part)
                self._stream_at += len(part)
            return b"".join(parts)
        except BaseException:
            if self._stream is not None:
                with contextlib.suppress(Exception):
                    self._stream.close()
            self._stream = None
            raise

    def close(self) -> None:
        if self._stream is not None:
            with contextlib.suppress(Exception):
                self._stream.close()
            self._stream = None
        super().close()

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size
        while len(self._buffer) < n and self.position < self.size:
            start = self.position
            stop = min(self.size, start + self.policy.chunk_bytes)
            data = with_retries(
                functools.partial(self._chunk, start, stop), self.url, self.policy, self._rng, self.on_retry
            )
            self.position = stop
            if self.on_bytes is not None:
                self.on_bytes(len(data))
            self._buffer = data if not self._buffer else self._buffer + data
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out

    def readinto(self, target: Any) -> int:
        data = self.read(len(target))
        target[: len(data)] = data
        return len(data)


def download(
    url: str,
    dest: str | os.PathLike[str],
    size: int,
    policy: RetryPolicy,
    storage_options: dict[str, Any] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    on_retry: Callable[[int, str], None] | None = None,
) -> int:
    """Copy the ``size`` bytes of ``url`` into the file ``dest`` (written from byte 0; the caller gives it a
    temporary name) through a :class:`RangeReader`: a transient failure retries one chunk, never the whole
    object. ``on_bytes(n)`` is called after each chunk, ``on_retry(attempt, cause)`` before each retry.
    Returns the bytes written.

    Example::

        download("http://127.0.0.1:8000/data/shard-000.bin", "/tmp/shard-000.bin.part", 4096, RetryPolicy())
    """
    reader = RangeReader(url, size, policy, storage_options, on_bytes, on_retry)
    done = 0
    with reader, open(dest, "r+b" if os.path.exists(dest) else "wb") as out:
        while done < size:
            data = reader.read(policy.chunk_bytes)
            if not data:
                break
            out.write(data)
            done += len(data)
    return done
