"""fastio.remote.cache.ShardCache and fastio.remote.fetch on their own: sizes, pins, eviction order,
partial downloads, one download per node across processes, failure classification, redaction."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
import threading
from pathlib import Path

import pytest

from fastio.errors import CorruptShardError
from fastio.remote.cache import CacheFullError, ShardCache, parse_size
from fastio.remote.fetch import (
    RemoteAccessError,
    RemoteNotFoundError,
    RemoteReadError,
    RetryPolicy,
    classify,
    expand_urls,
    redact,
    with_retries,
)

sys.path.insert(0, str(Path(__file__).parent))
from benchmarks.http_server import HttpServer  # noqa: E402


@pytest.mark.parametrize(
    "text, expected",
    [("50GB", 50 * 10**9), ("512MB", 512 * 10**6), ("1.5GiB", 3 * 2**29), ("800k", 800_000), ("7", 7),
     (4096, 4096), (None, None)],
)  # fmt: skip
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-5GB", 0, "0MB", True])
def test_parse_size_refuses(bad):
    with pytest.raises((ValueError, TypeError), match="cache_limit"):
        parse_size(bad)


def test_default_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTIO_CACHE", str(tmp_path / "here"))
    assert ShardCache().directory == tmp_path / "here"


def _fill(cache: ShardCache, key: str, size: int, byte: bytes = b"x") -> Path:
    return cache.fill(key, size, lambda part: part.write_bytes(byte * size))


def test_a_failed_write_leaves_nothing_visible(tmp_path):
    cache = ShardCache(tmp_path)

    def broken(part: Path) -> None:
        part.write_bytes(b"half")
        raise ConnectionResetError("dropped")

    with pytest.raises(ConnectionResetError):
        cache.fill("ds/a.tar", 100, broken)
    assert not cache.has("ds/a.tar")
    assert cache.usage() == 0  # no temporary file left either


def test_a_wrong_size_or_checksum_is_refused(tmp_path):
    cache = ShardCache(tmp_path)
    with pytest.raises(CorruptShardError, match="100 bytes"):
        cache.fill("ds/a.tar", 100, lambda part: part.write_bytes(b"x" * 99))

    def refuse(part: Path) -> None:
        raise CorruptShardError(str(part), "download", "crc32 0x1", "crc32 0x2")

    with pytest.raises(CorruptShardError, match="crc32"):
        cache.fill("ds/b.tar", 10, lambda part: part.write_bytes(b"y" * 10), refuse)
    assert not cache.has("ds/a.tar") and not cache.has("ds/b.tar") and cache.usage() == 0


def test_eviction_takes_read_entries_first_then_the_least_recently_used(tmp_path):
    cache = ShardCache(tmp_path, cache_limit=300)
    for key in ("a", "b", "c"):
        cache.pin(key)
        _fill(cache, key, 100)
        cache.unpin(key)
    cache.pin("a")  # a is now the most recently used
    cache.unpin("a")
    cache.mark_read("c")  # c was read this epoch: it goes first
    _fill(cache, "d", 100)
    assert not cache.has("c") and all(cache.has(k) for k in ("a", "b", "d"))
    _fill(cache, "e", 100)  # then b, the least recently used
    assert not cache.has("b") and all(cache.has(k) for k in ("a", "d", "e"))


def test_an_entry_is_evicted_with_the_sidecars_its_user_names_and_no_other_file(tmp_path):
    # The cache knows no format: the suffixes of what is kept beside an entry come from its user.
    cache = ShardCache(tmp_path, cache_limit=400, sidecars=(".idx",))
    cache.pin("a")
    _fill(cache, "a", 100)
    cache.unpin("a")
    Path(f"{cache.path('a')}.idx").write_bytes(b"i" * 50)
    Path(f"{cache.path('a')}.notes").write_bytes(b"n" * 50)
    _fill(cache, "b", 250)  # needs a's room: a goes, and its .idx with it
    assert not cache.has("a") and not Path(f"{cache.path('a')}.idx").exists()
    assert Path(f"{cache.path('a')}.notes").exists()  # not named: kept


def test_discard_removes_an_entry_and_its_parts_but_no_pinned_one_and_nothing_else(tmp_path):
    # What a source calls when the bytes under a key turn out not to be the object's (republished unseen).
    cache = ShardCache(tmp_path, sidecars=(".idx",))
    keys = ("v1/a.tar", "v1/a.tar@0-4", "v1/a.tar@4-8", "v1/a.tar@8-9", "v1/a.tar2", "v1/b.tar@0-4")
    for key in keys:
        cache.pin(key)
        _fill(cache, key, 10)
        if key != "v1/a.tar@8-9":  # being read by this process: it stays
            cache.unpin(key)
    Path(f"{cache.path('v1/a.tar')}.idx").write_bytes(b"i" * 5)
    assert cache.discard("v1/a.tar") == 3
    assert [k for k in keys if cache.has(k)] == ["v1/a.tar@8-9", "v1/a.tar2", "v1/b.tar@0-4"]
    assert not Path(f"{cache.path('v1/a.tar')}.idx").exists()
    cache.unpin("v1/a.tar@8-9")
    assert cache.discard("v1/a.tar") == 1 and cache.discard("v1/none.tar") == 0


def test_pinned_entries_are_never_evicted_and_a_full_cache_is_named(tmp_path):
    cache = ShardCache(tmp_path, cache_limit=150, wait_s=0.2)
    cache.pin("a")
    _fill(cache, "a", 100)
    cache.pin("b")
    _fill(cache, "b", 100)  # allowed: the cache held 100 <= 150 bytes before it (limit + one shard)
    assert cache.usage() == 200
    with pytest.raises(CacheFullError, match="cache_limit 150"):
        _fill(cache, "c", 100)
    cache.unpin("b")
    _fill(cache, "c", 100)
    assert cache.has("a") and not cache.has("b") and cache.has("c")


def _folder_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_a_sidecar_is_reserved_with_its_entry_and_counted_until_written(tmp_path):
    cache = ShardCache(tmp_path, cache_limit=1000)
    cache.pin("s.tar")
    job = cache.reserve("s.tar", 300, extra=40)
    assert cache.usage() == 340 == _folder_bytes(tmp_path)  # the placeholder holds the sidecar's room
    job.part.write_bytes(b"t" * 300)

    def beside(path: Path) -> None:
        assert not job.room.exists()  # the sidecar takes the placeholder's room, never both at once
        Path(f"{path}.fidx").write_bytes(b"i" * 40)

    job.finish(beside=beside)
    assert cache.usage() == 340 == _folder_bytes(tmp_path)
    aborted = cache.reserve("u.tar", 100, extra=10)
    aborted.abort()
    assert cache.usage() == 340 == _folder_bytes(tmp_path)  # nothing of it is left


def test_an_entry_is_admitted_only_with_room_for_its_sidecar(tmp_path):
    # The folder may pass the limit by one entry's file, never by its sidecar as well.
    cache = ShardCache(tmp_path, cache_limit=250, wait_s=0.2)
    cache.pin("a")
    _fill(cache, "a", 200)
    cache.pin("b")
    with pytest.raises(CacheFullError):
        cache.reserve("b", 100, extra=60)  # 200 + 60 > 250: it would end at limit + file + 10
    job = cache.reserve("b", 100, extra=50)  # 200 + 50 <= 250: ends at exactly limit + its file
    assert job is not None and cache.usage() == 350
    job.abort()


def test_a_pin_in_another_process_blocks_eviction(tmp_path):
    cache = ShardCache(tmp_path, cache_limit=100, wait_s=0.2)
    _fill(cache, "a", 100)
    ready, done = multiprocessing.get_context("fork").Event(), multiprocessing.get_context("fork").Event()

    def hold() -> None:
        reader = ShardCache(tmp_path)  # its pins go with it: it lives while the child waits
        reader.pin("a")
        ready.set()
        done.wait(30)

    child = multiprocessing.get_context("fork").Process(target=hold)
    child.start()
    try:
        assert ready.wait(30)
        _fill(cache, "b", 100)  # admitted at 100 <= limit, but "a" could not be evicted for it
        assert cache.has("a") and cache.usage() == 200
    finally:
        done.set()
        child.join(30)
    _fill(cache, "c", 100)
    assert not cache.has("a")


def _fill_in_child(directory: str, log: str) -> None:
    def write(part: Path) -> None:
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        part.write_bytes(b"z" * 1000)

    ShardCache(directory).fill("ds/one.tar", 1000, write)


def test_processes_on_one_node_fill_an_entry_once(tmp_path):
    log = tmp_path / "writes.log"
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=_fill_in_child, args=(str(tmp_path / "c"), str(log))) for _ in range(4)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [c.exitcode for c in children] == [0] * 4
    assert len(log.read_text().split()) == 1
    assert (tmp_path / "c" / "ds" / "one.tar").read_bytes() == b"z" * 1000


def test_stale_parts_of_dead_processes_are_removed(tmp_path):
    (tmp_path / "ds").mkdir()
    stale = tmp_path / "ds" / ".a.tar.part-999999999-1"
    stale.write_bytes(b"x" * 10)
    cache = ShardCache(tmp_path)
    assert not stale.exists() and cache.usage() == 0


@pytest.mark.parametrize("key", ["/abs", "../up", "a/../../b", "x.lock", "x.pin", ""])
def test_bad_keys_are_refused(tmp_path, key):
    with pytest.raises(ValueError, match="cache key"):
        ShardCache(tmp_path).path(key)


class _Status(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class _BotoError(Exception):
    def __init__(self, code: str, status: int) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


def _wrapped(cause: BaseException) -> FileNotFoundError:
    try:
        raise FileNotFoundError("http://h/x") from cause  # what fsspec's HTTP info does with every failure
    except FileNotFoundError as exc:
        return exc


@pytest.mark.parametrize(
    "exc, kind",
    [
        (ConnectionResetError(), "transient"), (TimeoutError(), "transient"),
        (asyncio.TimeoutError(), "transient"), (_Status(503), "transient"), (_Status(429), "transient"),
        (_Status(404), "missing"), (_Status(403), "denied"), (_BotoError("NoSuchKey", 404), "missing"),
        (_BotoError("AccessDenied", 403), "denied"), (_BotoError("SlowDown", 503), "transient"),
        (_wrapped(_Status(503)), "transient"), (_wrapped(_Status(404)), "missing"),
        (FileNotFoundError("x"), "missing"), (PermissionError("x"), "denied"), (ValueError("bug"), "fatal"),
    ],
)  # fmt: skip
def test_classify(exc, kind):
    assert classify(exc)[0] == kind


def test_retries_are_bounded_and_the_error_names_url_and_cause():
    calls = []

    def flaky() -> None:
        calls.append(1)
        raise _Status(503)

    policy = RetryPolicy(retries=3, backoff=0.001, max_backoff=0.002)
    with pytest.raises(RemoteReadError, match="503") as caught:
        with_retries(flaky, "https://user:secret@h/a.tar", policy)
    assert len(calls) == 4 and caught.value.attempts == 4
    assert "secret" not in str(caught.value) and caught.value.url == "https://***@h/a.tar"


@pytest.mark.parametrize("status, error", [(404, RemoteNotFoundError), (403, RemoteAccessError)])
def test_missing_and_denied_are_not_retried(status, error):
    calls = []

    def fail() -> None:
        calls.append(1)
        raise _Status(status)

    with pytest.raises(error, match=str(status)):
        with_retries(fail, "s3://b/a.tar", RetryPolicy(retries=5, backoff=0.001))
    assert len(calls) == 1


def test_a_transient_failure_then_success_returns():
    calls = []

    def second_time() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionResetError("reset")
        return "ok"

    assert with_retries(second_time, "http://h/a", RetryPolicy(retries=2, backoff=0.001)) == "ok"


def test_redact_strips_credentials_and_query_values():
    assert (
        redact("see https://bob:pw@host/a.tar?sig=abc&x=1 now")
        == "see https://***@host/a.tar?sig=***&x=*** now"
    )
    assert redact("s3://bucket/key") == "s3://bucket/key"


def test_expand_urls_keeps_query_and_padding():
    urls = expand_urls("http://127.0.0.1:1/shard-{08..10}.tar?v=1")
    assert urls == [f"http://127.0.0.1:1/shard-{n}.tar?v=1" for n in ("08", "09", "10")]


def test_expand_urls_globs_through_the_filesystem(tmp_path):
    for name in ("a-0.tar", "a-1.tar", "b-0.tar"):
        (tmp_path / name).write_bytes(b"")
    found = expand_urls(f"file://{tmp_path}/a-*.tar")
    assert [u.rsplit("/", 1)[1] for u in found] == ["a-0.tar", "a-1.tar"]


def test_slow_server_times_out_as_a_transient_failure(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    from fastio.remote.fetch import read_bytes

    with HttpServer(tmp_path) as server:
        server.faults.delay_s = 1.0
        with pytest.raises(RemoteReadError, match="attempt") as caught:
            read_bytes(server.url("a.bin"), RetryPolicy(retries=1, backoff=0.001, timeout=0.2))
        server.faults.delay_s = 0.0
    assert caught.value.attempts == 2


def test_http_server_serves_ranges_and_downloads_stream(tmp_path):
    import urllib.request

    from fastio.remote.fetch import download, remote_size

    (tmp_path / "a.bin").write_bytes(bytes(range(256)))
    with HttpServer(tmp_path) as server:
        url = server.url("a.bin")
        request = urllib.request.Request(url, headers={"Range": "bytes=10-19"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 206 and response.read() == bytes(range(10, 20))
        assert remote_size(url, RetryPolicy()) == 256
        chunks = []
        out = tmp_path / "copy.bin"
        download(url, out, 256, RetryPolicy(chunk_bytes=50), on_bytes=chunks.append)
        assert out.read_bytes() == bytes(range(256)) and sum(chunks) == 256 and len(chunks) == 6
        assert len([r for r in server.log("/a.bin") if r.method == "GET" and r.start == 0]) == 1  # one stream


def test_a_server_without_range_support_is_streamed(tmp_path):
    import functools
    import http.server

    from fastio.remote.fetch import download

    data = bytes(range(256)) * 40
    (tmp_path / "a.bin").write_bytes(data)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return

    handler = functools.partial(Quiet, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # Python's own: ignores Range
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        out = tmp_path / "copy.bin"
        url = f"http://127.0.0.1:{server.server_address[1]}/a.bin"
        assert download(url, out, len(data), RetryPolicy(chunk_bytes=1000)) == len(data)
        assert out.read_bytes() == data
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _exited_child() -> int:
    """The pid of a child process that has exited and is not reaped yet (a zombie: signals still reach it)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        os.sched_yield()
    return pid


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc to see a zombie process")
def test_a_reservation_takes_the_room_of_a_part_left_by_an_exited_process(tmp_path):
    # A worker process killed mid-download leaves its reserved part file (counted at full size). Its room
    # is free: a reservation must take it, not stall on it, also before the parent has reaped the worker.
    cache = ShardCache(tmp_path, cache_limit=99, stall_s=2.0, wait_s=4.0)
    pid = _exited_child()
    cancel, got = threading.Event(), []
    try:
        (tmp_path / "ds").mkdir()
        stale = tmp_path / "ds" / f".a.tar.part-{pid}-1"
        stale.write_bytes(b"x" * 100)
        reserve = lambda: got.append(cache.reserve("ds/b.tar", 100, cancel))  # noqa: E731
        waiter = threading.Thread(target=reserve, daemon=True)
        waiter.start()
        waiter.join(60)
        cancel.set()  # ends a wait that would never end on its own
        waiter.join(60)
        assert got[0] is not None, "the reservation still waited on a dead process's part after 60 s"
        assert not stale.exists()
        got[0].part.write_bytes(b"y" * 100)
        got[0].finish()
        assert cache.usage() == 100
    finally:
        os.waitpid(pid, 0)
