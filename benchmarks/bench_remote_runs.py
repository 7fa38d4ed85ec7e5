"""bench_remote's measurements: its data, its server, and each measured run in a child process.

1. :func:`write_data`: the same random samples as fastio shards and as WebDataset tars (the served copies,
   a copy with ``.fidx`` sidecars, and hard links for the local baseline).
2. :func:`start_server`: :mod:`benchmarks.http_server` inside the link's namespace, on its end of the veth.
3. :func:`link_rate`: what one plain client (``curl``) gets over the link.
4. :func:`run_child`: one measured configuration in its own process group with a time limit; run as
   ``python -m benchmarks.bench_remote_runs SPEC`` (SPEC: the JSON of :func:`run_child`'s ``spec``), the
   child prints one result line. fastio runs read epoch 1 over the link, then cache epochs taking turns with
   epochs of the same shards on local disk; WebDataset runs read one epoch. Each epoch checks that every
   sample arrived exactly once, and counts the server's bytes (its ``/__stats``).

Example::

    data = write_data(root, gigabytes=0.024, shard_mb=2.0)
    with netlab.HostLink(rate="1gbit") as link:
        server, base = start_server(link, root)
        print(link_rate(f"{base}/probe.bin", 16 << 20))
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import netlab
from benchmarks.harness import kill_process_groups

__all__ = [
    "BATCH",
    "SAMPLE_BYTES",
    "SAMPLE_SHAPE",
    "link_rate",
    "run_child",
    "start_server",
    "write_data",
]

SAMPLE_SHAPE = (3, 64, 64)
SAMPLE_BYTES = int(np.prod(SAMPLE_SHAPE))
BATCH = 256
_REPO_ROOT = Path(__file__).resolve().parent.parent
_RESULT_TAG = "BENCH_REMOTE_RESULT "


# -- data ----------------------------------------------------------------------------------------------
def write_data(root: Path, gigabytes: float, shard_mb: float) -> dict[str, Any]:
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
        ids.append(batch[spec["id_field"]].numpy().copy())  # a copy: the loader reuses its buffers
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
    cache = fastio.RemoteOptions(cache_dir=spec["cache_dir"])
    remote = fastio.StreamLoader(spec["target"], remote=cache, **options)
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


def run_child(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one measurement in its own process group, killed at ``timeout_s``; its result or its error."""
    command = [sys.executable, "-m", "benchmarks.bench_remote_runs", json.dumps(spec)]
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


# -- the link -----------------------------------------------------------------------------------------
def start_server(link: netlab.HostLink, root: Path, timeout_s: float = 20.0) -> tuple[subprocess.Popen, str]:
    """:mod:`benchmarks.http_server` over ``root`` inside ``link``'s namespace, listening on its end of the
    veth pair; the process and the base URL the root namespace reaches it at."""
    host = link.addresses[1]
    server = [sys.executable, "-m", "benchmarks.http_server", str(root), "--host", host]
    command = [*link.exec_prefix(0), *server]
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
    return proc, f"http://{host}:{int(ready[0].split()[1])}"


def link_rate(url: str, nbytes: int, repeat: int = 3) -> float:
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


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
