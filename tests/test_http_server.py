"""benchmarks/http_server.py, the file server the remote tests and benchmarks share: ranges as HTTP says,
every request logged (and counted over ``/__stats``), faults on demand, loopback unless told otherwise."""

from __future__ import annotations

import dataclasses
import http.client
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.http_server import STATS_PATH, HttpServer

REPO = Path(__file__).resolve().parent.parent
BODY = bytes(range(200)) * 3  # 600 bytes, no two neighbours alike


@pytest.fixture
def server(tmp_path: Path):
    (tmp_path / "www" / "sub").mkdir(parents=True)
    (tmp_path / "www" / "data.bin").write_bytes(BODY)
    (tmp_path / "secret.bin").write_bytes(b"outside the served folder")
    with HttpServer(tmp_path / "www") as running:
        yield running


@dataclasses.dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


def _get(server: HttpServer, path: str, method: str = "GET", **headers: str) -> Answer:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.request(method, path, headers=headers)
        response = connection.getresponse()
        return Answer(response.status, response.headers, response.read())
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("wanted", "start", "end"),
    [("bytes=2-5", 2, 6), ("bytes=590-", 590, 600), ("bytes=-7", 593, 600), ("bytes=595-9999", 595, 600)],
)
def test_a_range_is_answered_206_with_its_bytes(server, wanted, start, end):
    response = _get(server, "/data.bin", Range=wanted)
    assert response.status == 206
    assert response.body == BODY[start:end]
    assert response.headers["Content-Range"] == f"bytes {start}-{end - 1}/{len(BODY)}"
    (logged,) = server.log("/data.bin")
    assert (logged.start, logged.end, logged.sent) == (start, end, end - start)


@pytest.mark.parametrize("wanted", ["bytes=600-", "bytes=9-3", "items=0-1", "bytes=0-1,4-5", "bytes=-"])
def test_a_range_past_the_end_or_of_another_form_is_416(server, wanted):
    response = _get(server, "/data.bin", Range=wanted)
    assert response.status == 416
    assert response.headers["Content-Range"] == f"bytes */{len(BODY)}"
    assert server.bytes_served() == 0


def test_a_whole_file_and_a_head_and_what_is_not_a_file(server):
    whole = _get(server, "/data.bin")
    assert (whole.status, whole.body, whole.headers["Accept-Ranges"]) == (200, BODY, "bytes")
    head = _get(server, "/data.bin", method="HEAD")
    assert (head.status, head.body, head.headers["Content-Length"]) == (200, b"", str(len(BODY)))
    assert _get(server, "/sub").status == 404  # a folder: no listings
    assert _get(server, "/../secret.bin").status == 404  # outside the root
    assert [r.method for r in server.log("/data.bin")] == ["GET", "HEAD"]
    assert server.bytes_served("/data.bin") == len(BODY)


def test_stats_count_requests_and_bytes_per_path_and_clear_log_restarts_them(server):
    _get(server, "/data.bin", Range="bytes=0-99")
    _get(server, "/data.bin", Range="bytes=100-")
    _get(server, "/missing.bin")
    stats = json.loads(_get(server, STATS_PATH).body)
    assert stats == {"/data.bin": {"requests": 2, "bytes": 600}, "/missing.bin": {"requests": 1, "bytes": 0}}
    assert server.bytes_served() == 600
    server.clear_log()
    assert json.loads(_get(server, STATS_PATH).body) == {} and server.bytes_served() == 0


def test_faults_missing_denied_and_the_next_failures_of_a_path(server):
    server.faults.missing.add("/data.bin")
    assert _get(server, "/data.bin").status == 404
    server.faults.missing.clear()
    server.faults.denied.add("/data.bin")
    assert _get(server, "/data.bin").status == 403
    server.faults.denied.clear()
    server.faults.fail_next["/data.bin"] = 2
    assert [_get(server, "/data.bin").status for _ in range(3)] == [503, 503, 200]
    assert server.failures() == 2


def test_the_server_listens_on_loopback_unless_told(server):
    assert server.url("data.bin") == f"http://127.0.0.1:{server.port}/data.bin"


def test_run_as_a_program_it_says_its_port_and_serves(tmp_path):
    (tmp_path / "data.bin").write_bytes(BODY)
    command = [sys.executable, "-m", "benchmarks.http_server", str(tmp_path)]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, port = proc.stdout.readline().split()
        assert ready == "ready"
        connection = http.client.HTTPConnection("127.0.0.1", int(port), timeout=10)
        connection.request("GET", "/data.bin", headers={"Range": "bytes=10-19"})
        assert connection.getresponse().read() == BODY[10:20]
        connection.close()
    finally:
        proc.kill()
        proc.wait()
