"""StreamLoader reading shards from an HTTP server behind a shaped 1 Gbit/s link, then from its cache.

The question: how close does fastio's remote source come to the link's own rate in its first epoch, and to
local disk once the shards are in its cache? And how does ``webdataset.WebDataset``, reading the same tars
from the same server, compare?

1. Data (in a temp dir, removed at the end): random ``uint8`` samples of 3x64x64 (12,288 bytes) with an
   ``int64`` id, written twice: as fastio shards (``fastio.ShardWriter``) and as WebDataset tar shards
   (``webdataset.ShardWriter``, members ``x.bin`` + ``cls``), about ``--gigabytes`` each (1.0 by default, in
   shards of ``--shard-mb`` MB).
2. The server: a ``ThreadingHTTPServer`` with ``Range`` and ``HEAD`` support that sends files with
   ``sendfile`` (HTTP/1.1 keep-alive), run inside a network namespace (:class:`benchmarks.netlab.HostLink`)
   whose veth pair to the root namespace is shaped by tc tbf to 1 Gbit/s each way; the clients (the loaders)
   run in the root namespace. The server counts the bytes it sends, per file.
3. The link rate: the best of three ``curl`` downloads of one ``--probe-mb`` MB file over the same link from
   the same server (what one plain client gets). Every epoch-1 ratio is to it.
4. Every measured run is its own child process with a time limit (a hang or crash becomes a row with no
   number and its error, and the next run goes on):

   * fastio over HTTP (fastio shards, and the tars), ``num_workers`` 0 and 2, ``shuffle="shard"`` (the
     order remote sources require), an empty cache: epoch 1 comes over the link; epochs 2.. read the cache
     (the server's byte count says whether anything was fetched again). MB/s counts the set's bytes on the
     server (shard files and index) over the epoch's wall time: for epoch 1 from constructing the
     ``StreamLoader`` (opening the remote set: its index, object sizes, tar indexes) to the last batch,
     for the others from ``iter()`` to the last batch. The tars are served twice: without a ``.fidx``
     sidecar, as a WebDataset publisher has them (fastio then downloads each at open to index it), and
     with the sidecar ``fastio.index_tar`` writes (opening costs a small request per shard); the local
     baseline reads hard links of them in a third directory.
   * fastio on the same shards on local disk, in the same process (page cache warm: one warm-up epoch
     first), its epochs taking turns with the cache epochs so a change in the machine's load hits both
     alike: the baseline of the cache epochs.
   * ``webdataset.WebDataset`` over the same tars from the same server (its http support, a ``curl``
     pipe), batches of raw bytes (no decode), ``WebLoader`` with 0 and 2 workers.

   Each network configuration runs ``--repeats`` times (2; 1 with ``--quick``), each in a fresh process
   from an empty cache: epoch 1 is the median of the runs (each listed), the cache and local epochs are
   pooled. Each run also checks that every sample arrived exactly once per epoch.

Targets (the issue's): epoch 1 >= 0.85x the link rate; cache epochs >= 0.8x local disk.

Run::

    python -m benchmarks.bench_remote            # about 1 GB each of fastio shards and tars; ~6 minutes
    python -m benchmarks.bench_remote --quick    # 24 MB each, about a minute: a smoke test; writes no results

Needs root and ``ip``/``tc`` (netlab); without them it says why and measures nothing.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness, netlab
from benchmarks.harness import RESULTS_DIR, Row, kill_process_groups, markdown_table, write_results

__all__ = ["RangeFileServer", "main", "plot_results"]

SAMPLE_SHAPE = (3, 64, 64)
SAMPLE_BYTES = int(np.prod(SAMPLE_SHAPE))
BATCH = 256
LINK_RATE = "1gbit"
EPOCH1_TARGET = 0.85
CACHE_TARGET = 0.8
_REPO_ROOT = Path(__file__).resolve().parent.parent
_RESULT_TAG = "BENCH_REMOTE_RESULT "


# -- the server (runs inside the namespace) ---------------------------------------------------------------
class RangeFileServer(ThreadingHTTPServer):
    """Serves the files under ``root`` over HTTP/1.1: ``GET`` and ``HEAD``, single ``Range: bytes=`` ranges
    (206, or 416 past the end), directory listings as HTML links, and ``/__stats``: JSON of the requests and
    bytes sent per path. Bodies go out with ``sendfile``.

    Example::

        server = RangeFileServer(("127.0.0.1", 0), "/data")
        threading.Thread(target=server.serve_forever, daemon=True).start()
        # curl -r 0-99 http://127.0.0.1:{server.server_address[1]}/shard-000000.tar
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self.lock = threading.Lock()
        self.served: dict[str, dict[str, int]] = {}
        super().__init__(address, _RangeHandler)

    def count(self, path: str, nbytes: int) -> None:
        with self.lock:
            entry = self.served.setdefault(path, {"requests": 0, "bytes": 0})
            entry["requests"] += 1
            entry["bytes"] += nbytes


class _RangeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RangeFileServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        return

    def do_HEAD(self) -> None:  # noqa: N802 (the base class's naming)
        self._respond(send_body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._respond(send_body=True)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _respond(self, send_body: bool) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        if path == "/__stats":
            with self.server.lock:
                body = json.dumps(self.server.served).encode()
            self._send(200, body, "application/json")
            return
        target = (self.server.root / path.lstrip("/")).resolve()
        if not target.is_relative_to(self.server.root) or not target.exists():
            self._send(404, f"not found: {path}".encode(), "text/plain")
            return
        if target.is_dir():
            names = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
            links = "".join(f'<a href="{html.escape(n)}">{html.escape(n)}</a>\n' for n in names)
            self._send(200, f"<html><body>\n{links}</body></html>\n".encode(), "text/html")
            return
        size = target.stat().st_size
        start, end, status = 0, size - 1, 200
        wanted = self.headers.get("Range")
        if wanted:
            match = re.fullmatch(r"bytes=(\d*)-(\d*)", wanted.strip())
            if not match or match.groups() == ("", ""):
                self._send(416, f"unsupported range {wanted!r}".encode(), "text/plain")
                return
            first, last = match.groups()
            if first == "":  # a suffix: the last N bytes
                start = max(0, size - int(last))
            else:
                start, end = int(first), min(size - 1, int(last)) if last else size - 1
            if start >= size or start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        length = end - start + 1
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if not send_body:
            return
        self.wfile.flush()
        with open(target, "rb") as fh:
            try:
                sent = self.connection.sendfile(fh, offset=start, count=length)
            except ConnectionError:
                self.close_connection = True
                sent = 0
        self.server.count(path, sent)


def _serve(root: str, port: int) -> None:
    """Serve ``root`` on ``port`` (0: any free port) until killed; print ``ready <port>`` once bound."""
    server = RangeFileServer(("0.0.0.0", port), root)
    print(f"ready {server.server_address[1]}", flush=True)
    server.serve_forever()


# -- data ----------------------------------------------------------------------------------------------
def _write_data(root: Path, gigabytes: float, shard_mb: float) -> dict[str, Any]:
    """fastio shards under ``root/fixed`` and tar shards under ``root/tar``, the same samples in both."""
    import webdataset as wds

    import fastio

    n = max(BATCH, int(gigabytes * 1e9) // (SAMPLE_BYTES + 8))
    shard_bytes = int(shard_mb * 1e6)
    rng = np.random.default_rng(0)
    chunk = max(1, min(8192, shard_bytes // SAMPLE_BYTES))  # the writer cuts shards between write_many calls
    (root / "tar").mkdir(parents=True)
    with (
        fastio.ShardWriter(
            root / "fixed",
            schema={"x": ("uint8", SAMPLE_SHAPE), "y": ("int64", ())},
            max_samples=n,
            max_bytes=shard_bytes,
        ) as writer,
        wds.ShardWriter(
            str(root / "tar" / "shard-%06d.tar"), maxcount=n, maxsize=shard_bytes, verbose=0
        ) as sink,
    ):
        for start in range(0, n, chunk):
            k = min(chunk, n - start)
            x = np.frombuffer(rng.bytes(k * SAMPLE_BYTES), np.uint8).reshape(k, *SAMPLE_SHAPE)
            ids = np.arange(start, start + k, dtype=np.int64)
            writer.write_many({"x": x, "y": ids})
            for i in range(k):
                sink.write({"__key__": f"s{start + i:09d}", "x.bin": x[i].tobytes(), "cls": int(ids[i])})
    tars = sorted(p.name for p in (root / "tar").iterdir() if p.name.endswith(".tar"))
    # The local baseline reads hard links elsewhere: fastio writes its tar index (.fidx) beside the tars it
    # reads, and the served tars must stay as a WebDataset publisher has them, without one.
    # A second served copy, as a publisher who ran fastio.index_tar has it: each tar with its .fidx sidecar.
    (root / "local" / "tar").mkdir(parents=True)
    (root / "tar-indexed").mkdir()
    for name in tars:
        os.link(root / "tar" / name, root / "local" / "tar" / name)
        os.link(root / "tar" / name, root / "tar-indexed" / name)
        fastio.index_tar(root / "tar-indexed" / name)
    return {
        "num_samples": n,
        "fixed_bytes": sum(p.stat().st_size for p in (root / "fixed").iterdir()),
        "fixed_shards": sum(1 for p in (root / "fixed").iterdir() if p.name != "index.json"),
        "tar_bytes": sum((root / "tar" / t).stat().st_size for t in tars),
        "tar_shards": len(tars),
        "tar_pattern": f"tar/shard-{{000000..{len(tars) - 1:06d}}}.tar",
    }


# -- measuring (each run in a child process) -------------------------------------------------------------
def _served_bytes(stats_url: str | None) -> int | None:
    if stats_url is None:
        return None
    with urllib.request.urlopen(stats_url, timeout=10) as response:
        return sum(entry["bytes"] for entry in json.load(response).values())


def _fastio_pass(loader: Any, epoch: int, spec: dict[str, Any], served: int | None, start: float) -> dict:
    loader.set_epoch(epoch)
    ids: list[Any] = []
    for batch in loader:
        ids.append(np.array(batch[spec["id_field"]]))  # a copy: the loader reuses its buffers
    return _epoch_record(spec, ids, time.perf_counter() - start, served, loader.stats())


def _fastio_epochs(spec: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Epoch 1 of ``spec["target"]`` from an empty cache, then its cache epochs taking turns with epochs of
    the same shards on local disk (``spec["local"]``, after a warm-up epoch), so a change in the machine's
    load hits both alike."""
    import fastio

    options = {"batch_size": BATCH, "shuffle": "shard", "seed": 0, "num_workers": spec["workers"]}
    local = fastio.StreamLoader(spec["local"], **options)
    _fastio_pass(local, 0, spec, None, time.perf_counter())
    served = _served_bytes(spec["stats_url"])
    start = time.perf_counter()  # epoch 1 includes opening: a remote set's index, sizes and tar indexes
    remote = fastio.StreamLoader(spec["target"], cache_dir=spec["cache_dir"], **options)
    open_s = time.perf_counter() - start
    epochs = [_fastio_pass(remote, 0, spec, served, start)]
    epochs[0]["open_s"] = open_s
    local_epochs = []
    for epoch in range(1, spec["epochs"]):
        local_epochs.append(_fastio_pass(local, epoch, spec, None, time.perf_counter()))
        served = _served_bytes(spec["stats_url"])
        epochs.append(_fastio_pass(remote, epoch, spec, served, time.perf_counter()))
    return {"epochs": epochs, "local_epochs": local_epochs}


def _webdataset_epochs(spec: dict[str, Any]) -> list[dict[str, Any]]:
    import webdataset as wds

    dataset = (
        wds.WebDataset(spec["target"], shardshuffle=False, empty_check=False)
        .to_tuple("__key__", "x.bin", "cls")
        .batched(BATCH, collation_fn=lambda samples: [s[0] for s in samples], partial=True)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=spec["workers"])
    epochs = []
    for _ in range(spec["epochs"]):
        served = _served_bytes(spec.get("stats_url"))
        ids: list[Any] = []
        start = time.perf_counter()
        for keys in loader:
            ids.append(keys)
        seconds = time.perf_counter() - start
        epochs.append(_epoch_record(spec, ids, seconds, served, None))
    return epochs


def _epoch_record(
    spec: dict[str, Any], ids: list[Any], seconds: float, served_before: int | None, stats: Any
) -> dict[str, Any]:
    flat = np.concatenate([np.asarray(b).reshape(-1) for b in ids]) if ids else np.empty(0)
    record: dict[str, Any] = {
        "seconds": seconds,
        "samples": int(len(flat)),
        "exactly_once": bool(len(flat) == spec["num_samples"] and len(np.unique(flat)) == len(flat)),
        "mb_per_s": spec["dataset_bytes"] / seconds / 1e6,
    }
    if served_before is not None:
        record["served_mb"] = (_served_bytes(spec["stats_url"]) - served_before) / 1e6
    if isinstance(stats, dict):
        nested = stats.get("source") if isinstance(stats.get("source"), dict) else {}
        flat = {**stats, **{f"source.{k}": v for k, v in nested.items()}}
        record["stats"] = {k: v for k, v in flat.items() if isinstance(v, (int, float, str))}
    return record


def _child(spec: dict[str, Any]) -> None:
    load = os.getloadavg()[0]
    result = _fastio_epochs(spec) if spec["kind"] == "fastio" else {"epochs": _webdataset_epochs(spec)}
    print(_RESULT_TAG + json.dumps({**result, "loadavg_1m": load}), flush=True)


def _run_child(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one measurement in its own process group, killed at ``timeout_s``; its result or its error."""
    command = [sys.executable, "-m", "benchmarks.bench_remote", "--child", json.dumps(spec)]
    proc = subprocess.Popen(
        command,
        cwd=_REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_process_groups([proc])
        return {"error": f"killed after {timeout_s:.0f} s (hung or too slow)"}
    except BaseException:
        kill_process_groups([proc])
        raise
    for line in reversed(out.splitlines()):
        if line.startswith(_RESULT_TAG):
            return json.loads(line[len(_RESULT_TAG) :])
    tail = err.strip().splitlines()[-1] if err.strip() else f"exit code {proc.returncode}"
    return {"error": tail[-300:]}


# -- the link ------------------------------------------------------------------------------------------
def _start_server(link: netlab.HostLink, root: Path, timeout_s: float = 20.0) -> tuple[subprocess.Popen, str]:
    command = [*link.exec_prefix(0), sys.executable, "-m", "benchmarks.bench_remote", "--serve", str(root)]
    proc = subprocess.Popen(
        command, cwd=_REPO_ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not ready or not ready[0].startswith("ready "):
        kill_process_groups([proc])
        raise RuntimeError(f"the HTTP server in {link.namespaces[0]} did not start within {timeout_s:.0f} s")
    return proc, f"http://{link.addresses[1]}:{int(ready[0].split()[1])}"


def _link_rate(url: str, nbytes: int, repeat: int = 3) -> float:
    """Best MB/s of ``repeat`` plain downloads of ``url`` (curl if present, else urllib)."""
    rates = []
    for _ in range(repeat):
        if shutil.which("curl"):
            out = subprocess.run(
                ["curl", "-sf", "-o", "/dev/null", "-w", "%{size_download} %{time_total}", url],
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            ).stdout.split()
            size, seconds = int(out[0]), float(out[1])
        else:
            start = time.perf_counter()
            with urllib.request.urlopen(url, timeout=30) as response:
                size = 0
                while chunk := response.read(1 << 20):
                    size += len(chunk)
            seconds = time.perf_counter() - start
        if size != nbytes:
            raise RuntimeError(f"link probe {url}: got {size} bytes, expected {nbytes}")
        rates.append(size / seconds / 1e6)
    return max(rates)


# -- rows ----------------------------------------------------------------------------------------------
def _median(values: Sequence[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def _combine(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from repeated runs of a configuration (each from an empty cache): epoch 1 is the median
    run's (its MB/s the median of the runs', each run's listed), the later and the local epochs pooled."""
    for result in results:
        if "error" in result:
            return result
    firsts = sorted((r["epochs"][0] for r in results), key=lambda e: e["mb_per_s"])
    first = {
        **firsts[(len(firsts) - 1) // 2],
        "mb_per_s": _median([e["mb_per_s"] for e in firsts]),
        "samples_per_s": _median([e["samples"] / e["seconds"] for e in firsts]),
        "runs_mb_per_s": [r["epochs"][0]["mb_per_s"] for r in results],
        "exactly_once": all(e["exactly_once"] for e in firsts),
    }
    return {
        "epochs": [first, *(e for r in results for e in r["epochs"][1:])],
        "local_epochs": [e for r in results for e in r.get("local_epochs", [])],
        "epochs_per_run": len(results[0]["epochs"]),
        "loadavg_1m": float(np.mean([r["loadavg_1m"] for r in results])),
    }


def _epoch_rows(
    case: str, label: str, result: dict[str, Any], link_mb_s: float, local_mb_s: float | None
) -> list[Row]:
    """Epoch 1 (over the link) and, when the run read more epochs, the cache epochs' median."""
    if "error" in result:
        return [
            Row(case, label, "MB/s over the link", float("nan"), "MB/s", extra={"error": result["error"]})
        ]
    first, rest = result["epochs"][0], result["epochs"][1:]
    extra = {
        "samples/s": f"{first.get('samples_per_s', first['samples'] / first['seconds']):,.0f}",
        "exactly_once": first["exactly_once"],
        "epoch1_runs_MB/s": " / ".join(f"{v:.0f}" for v in first.get("runs_mb_per_s", [])),
        "served_MB": f"{first.get('served_mb', float('nan')):,.0f}",
        "open_s": f"{first['open_s']:.2f}" if "open_s" in first else "",
        "network_wait_s": _stat(first, "network_wait_s"),
        "loadavg_1m": f"{result['loadavg_1m']:.2f}",
    }
    ratio = first["mb_per_s"] / link_mb_s
    if label.startswith("fastio"):  # the targets are fastio's; the other rows are measured beside
        extra["target"] = f">= {EPOCH1_TARGET}x link"
        extra["pass"] = "yes" if ratio >= EPOCH1_TARGET else "no"
    rows = [
        Row(
            case,
            f"{label} epoch 1",
            "MB/s over the link",
            first["mb_per_s"],
            "MB/s",
            ratio,
            "link rate",
            extra,
        )
    ]
    if rest:
        rate = _median([e["mb_per_s"] for e in rest])
        cache_extra = {
            "samples/s": f"{rate * 1e6 / (SAMPLE_BYTES + 8):,.0f}",
            "exactly_once": all(e["exactly_once"] for e in rest),
            "served_MB": f"{sum(e.get('served_mb', 0.0) for e in rest):,.0f}",
            "loadavg_1m": f"{result['loadavg_1m']:.2f}",
            "target": f">= {CACHE_TARGET}x local",
        }
        row = Row(
            case,
            f"{label} cache epochs 2-{result.get('epochs_per_run', len(rest) + 1)}",
            "MB/s local",
            rate,
            "MB/s",
            extra=cache_extra,
        )
        if local_mb_s:
            row.ratio, row.ratio_to = rate / local_mb_s, "local disk"
            cache_extra["pass"] = "yes" if row.ratio >= CACHE_TARGET else "no"
        rows.append(row)
    return rows


def _stat(epoch: dict[str, Any], name: str) -> str:
    value = epoch.get("stats", {}).get(name)
    return f"{value:.2f}" if isinstance(value, (int, float)) else ""


def _local_row(case: str, label: str, result: dict[str, Any]) -> tuple[Row, float | None]:
    """The local-disk epochs that took turns with a remote run's cache epochs, and their median MB/s."""
    if "error" in result:
        return Row(case, label, "MB/s local", float("nan"), "MB/s", extra={"error": result["error"]}), None
    local = result["local_epochs"]
    rate = _median([e["mb_per_s"] for e in local])
    extra = {
        "samples/s": f"{rate * 1e6 / (SAMPLE_BYTES + 8):,.0f}",
        "exactly_once": all(e["exactly_once"] for e in local),
        "loadavg_1m": f"{result['loadavg_1m']:.2f}",
    }
    last = result.get("epochs_per_run", len(local) + 1)
    return Row(case, f"{label} epochs 2-{last}", "MB/s local", rate, "MB/s", extra=extra), rate


def _measure_all(
    root: Path, base: str, data: dict[str, Any], link_mb_s: float, args: argparse.Namespace
) -> list[Row]:
    n = data["num_samples"]
    stats_url = f"{base}/__stats"
    per_run_s = args.timeout or 120.0 + 6 * (data["fixed_bytes"] + data["tar_bytes"]) / (link_mb_s * 1e6)
    cache_epochs = 2 if args.quick else 3
    repeats = args.repeats or (1 if args.quick else 2)
    sets = {
        "fastio shards": ("fixed", f"{base}/fixed/", str(root / "fixed"), data["fixed_bytes"], "y"),
        "tar shards": (
            "tar",
            f"{base}/{data['tar_pattern']}",
            str(root / "local" / data["tar_pattern"]),
            data["tar_bytes"],
            "__key__",
        ),
        "tar shards + .fidx": (
            "tar",
            f"{base}/{data['tar_pattern'].replace('tar/', 'tar-indexed/')}",
            str(root / "local" / data["tar_pattern"]),
            data["tar_bytes"],
            "__key__",
        ),
    }
    rows: list[Row] = []
    for case, (_, url, local, nbytes, id_field) in sets.items():
        common = {"num_samples": n, "dataset_bytes": nbytes, "id_field": id_field}
        for workers in (0, 2):
            results = []
            for run in range(repeats):
                cache_dir = root / f"cache-{len(rows)}-{run}"
                spec = {
                    "kind": "fastio",
                    "target": url,
                    "local": local,
                    "workers": workers,
                    "epochs": 1 + cache_epochs,
                    "cache_dir": str(cache_dir),
                    "stats_url": stats_url,
                    **common,
                }
                results.append(_run_child(spec, per_run_s))
                shutil.rmtree(cache_dir, ignore_errors=True)
            result = _combine(results)
            local_row, local_rate = _local_row(case, f"fastio local disk workers={workers}", result)
            new = _epoch_rows(case, f"fastio http workers={workers}", result, link_mb_s, local_rate)
            new += [] if "error" in result else [local_row]
            _print_rows(new)
            rows += new
        if case == "tar shards":
            for workers in (0, 2):
                spec = {
                    "kind": "webdataset",
                    "target": url,
                    "workers": workers,
                    "epochs": 1,
                    "stats_url": stats_url,
                    **common,
                }
                label = f"webdataset.WebDataset http workers={workers}"
                result = _combine([_run_child(spec, per_run_s) for _ in range(repeats)])
                new = _epoch_rows(case, label, result, link_mb_s, None)
                _print_rows(new)
                rows += new
    return rows


def _print_rows(rows: Sequence[Row]) -> None:
    for row in rows:
        ratio = f" ({row.ratio:.2f}x {row.ratio_to})" if row.ratio is not None else ""
        print(
            f"[bench_remote] {row.case} | {row.backend}: {row.value:,.1f} {row.unit}{ratio}",
            file=sys.stderr,
            flush=True,
        )


# -- main ----------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark, write ``bench_remote.*`` to ``harness.output_dir()`` (not ``--quick``); the table.

    Example::

        print(main(["--quick"]))
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="24 MB of each shard kind in 2 MB shards; prints the table, writes no results",
    )
    parser.add_argument("--gigabytes", type=float, default=None, help="size of each shard set (default 1.0)")
    parser.add_argument("--shard-mb", type=float, default=None, help="shard size in MB (default 64)")
    parser.add_argument("--probe-mb", type=int, default=None, help="link probe file size (default 256 MB)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per measured run")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs of each network configuration, each from an empty cache (default 2; quick 1)",
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="redraw bench_remote.png from the existing bench_remote.json; run nothing",
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.serve:
        _serve(args.serve, 0)
        return ""
    if args.child:
        _child(json.loads(args.child))
        return ""
    if args.replot:
        payload = json.loads((RESULTS_DIR / "bench_remote.json").read_text())
        rows = [
            Row(**{**r, "value": float("nan") if r["value"] is None else r["value"]}) for r in payload["rows"]
        ]
        plot_results(rows, RESULTS_DIR / "bench_remote.png")
        return (RESULTS_DIR / "bench_remote.md").read_text()
    gigabytes = args.gigabytes or (0.024 if args.quick else 1.0)
    repeats = args.repeats or (1 if args.quick else 2)
    shard_mb = args.shard_mb or (2.0 if args.quick else 64.0)
    probe_mb = args.probe_mb or (16 if args.quick else 256)

    reason = netlab.unavailable_reason()
    if reason:
        message = f"bench_remote: skipped, {reason}"
        print(f"[bench_remote] {message}", file=sys.stderr, flush=True)
        return message
    load_start = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="bench_remote_"))
    server: subprocess.Popen | None = None
    try:
        start = time.perf_counter()
        data = _write_data(root, gigabytes, shard_mb)
        write_s = time.perf_counter() - start
        (root / "probe.bin").write_bytes(np.random.default_rng(1).bytes(probe_mb << 20))
        with netlab.HostLink(rate=LINK_RATE) as link:
            server, base = _start_server(link, root)
            link_mb_s = _link_rate(f"{base}/probe.bin", probe_mb << 20)
            print(f"[bench_remote] link rate {link_mb_s:.1f} MB/s (curl, {probe_mb} MB)", file=sys.stderr)
            rows = [
                Row(
                    "link",
                    f"curl download of {probe_mb} MB (link rate)",
                    "MB/s over the link",
                    link_mb_s,
                    "MB/s",
                    extra={"target": "tbf 1gbit each way"},
                )
            ]
            rows += _measure_all(root, base, data, link_mb_s, args)
            kill_process_groups([server])
            server = None
    finally:
        if server is not None:
            kill_process_groups([server])
        shutil.rmtree(root, ignore_errors=True)
    load_end = os.getloadavg()
    notes = [
        f"data: {data['num_samples']:,} samples of {SAMPLE_SHAPE} uint8 + int64 id, as "
        f"{data['fixed_shards']} fastio shards ({data['fixed_bytes'] / 1e6:,.0f} MB) and "
        f"{data['tar_shards']} tar shards ({data['tar_bytes'] / 1e6:,.0f} MB, x.bin + cls), "
        f"written in {write_s:.0f} s",
        f"link: {netlab.HostLink.__name__} veth between the root namespace (loaders) and a namespace (the "
        f"HTTP server: ThreadingHTTPServer with Range, sendfile, HTTP/1.1), tbf {LINK_RATE} each way; link "
        f"rate = best of 3 curl downloads of one {probe_mb} MB file from that server: {link_mb_s:.1f} MB/s",
        f"each network configuration ran {repeats} time(s), each in a fresh process from an empty cache: "
        "epoch 1 = the median of the runs (each in epoch1_runs_MB/s), cache and local epochs pooled",
        "MB/s = the set's bytes on the server / the epoch's wall time; epoch 1 starts from an empty cache "
        "and is timed from constructing the StreamLoader (open_s: opening the remote set, its index, object "
        "sizes and tar indexes) to the last batch, the others from iter() to the last batch; the cache "
        "epochs are the median of the epochs after epoch 1; served_MB = bytes the server sent during those "
        "epochs (0: read from the cache alone); network_wait_s: stats()['network_wait_s'] of epoch 1",
        "tar shards: the served tars have no .fidx sidecar (as a WebDataset publisher has them), so fastio "
        "downloads each at open to index it; tar shards + .fidx: the same tars served with the sidecar "
        "fastio.index_tar writes (opening costs one small request per shard); the local tar rows read "
        "hard links of the tars in a third directory",
        f"fastio: StreamLoader(batch_size={BATCH}, shuffle='shard', seed=0); local disk rows: the same "
        "shards on local disk in the same process, page cache warm (a warm-up epoch), each epoch taking "
        "its turn with a cache epoch of the remote loader (medians compared)",
        "webdataset.WebDataset: its http support (a curl pipe per shard), shardshuffle=False, no decode, "
        f"batched({BATCH}), WebLoader(batch_size=None); one epoch",
        f"targets: epoch 1 >= {EPOCH1_TARGET}x the link rate, cache epochs >= {CACHE_TARGET}x local disk",
        f"machine load: os.getloadavg() {tuple(round(v, 2) for v in load_start)} at the start and "
        f"{tuple(round(v, 2) for v in load_end)} at the end ({os.cpu_count()} CPUs; other jobs shared them); "
        "loadavg_1m per row: at the start of that run",
    ]
    for note in notes:
        print(f"[bench_remote] {note}", file=sys.stderr, flush=True)
    if args.quick:
        return markdown_table(rows) + "\n\n" + "\n".join(f"- {n}" for n in notes)
    table = write_results("bench_remote", rows, notes=notes, plot_metric="MB/s over the link")
    plot_results(rows, harness.output_dir() / "bench_remote.png")  # replaces the harness's one-panel figure
    return table


def plot_results(rows: Sequence[Row], path: Path) -> None:
    """Two panels: epoch 1 over the link (the link rate as a line), and cache epochs beside local disk."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    link = next((r.value for r in rows if r.case == "link"), None)
    panels = (
        (
            "epoch 1 over the 1 Gbit/s link",
            [r for r in rows if r.metric == "MB/s over the link" and r.case != "link"],
        ),
        ("from the cache vs local disk", [r for r in rows if r.metric == "MB/s local"]),
    )
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, (title, chosen) in zip(axes, panels, strict=True):
        values = [0.0 if r.value != r.value else r.value for r in chosen]
        colours = [
            "#a5a5a5" if "local disk" in r.backend else "#4472c4" if "fastio" in r.backend else "#ed7d31"
            for r in chosen
        ]
        ax.bar(range(len(chosen)), values, color=colours)
        for i, r in enumerate(chosen):
            label = "no result" if r.value != r.value else f"{r.value:,.0f}"
            if r.ratio is not None:
                label += f"\n{r.ratio:.2f}x"
            ax.text(i, values[i], label, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(
            range(len(chosen)),
            [f"{r.case}\n{r.backend}" for r in chosen],
            rotation=60,
            ha="right",
            fontsize=7,
        )
        ax.set_ylabel("MB/s")
        ax.margins(y=0.15)
        ax.set_title(title, fontsize=10)
        if link is not None and chosen is panels[0][1]:
            ax.axhline(link, color="grey", linestyle="--", linewidth=1)
            ax.axhline(EPOCH1_TARGET * link, color="grey", linestyle=":", linewidth=1)
            ax.text(
                len(chosen) - 0.5,
                link,
                f"link rate {link:.0f} MB/s (curl); dotted: {EPOCH1_TARGET}x",
                ha="right",
                va="bottom",
                fontsize=7,
            )
    fig.suptitle(
        "bench_remote: StreamLoader over HTTP behind tbf 1gbit (ratio: to the link rate, or to local disk)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    print(main())
