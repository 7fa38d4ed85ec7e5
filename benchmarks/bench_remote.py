"""StreamLoader reading shards from an HTTP server behind a shaped 1 Gbit/s link, then from its cache.

The question: how close does fastio's remote source come to the link's own rate in its first epoch, and to
local disk once the shards are in its cache? And how does ``webdataset.WebDataset``, reading the same tars
from the same server, compare?

1. Data (in a temp dir, removed at the end): random ``uint8`` samples of 3x64x64 (12,288 bytes) with an
   ``int64`` id, written twice: as fastio shards (``fastio.ShardWriter``) and as WebDataset tar shards
   (``webdataset.ShardWriter``, members ``x.bin`` + ``cls``), about ``--gigabytes`` each (1.0 by default, in
   shards of ``--shard-mb`` MB).
2. The server: :mod:`benchmarks.http_server` (the one the remote tests use: ``Range`` and ``HEAD``,
   ``sendfile``, HTTP/1.1 keep-alive), run inside a network namespace (:class:`benchmarks.netlab.HostLink`)
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

Needs root and ``ip``/``tc`` (netlab); without them it says why and measures nothing. The pieces: the data,
the server and the measured runs in :mod:`benchmarks.bench_remote_runs`, the rows and the figure in
:mod:`benchmarks.bench_remote_rows`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness, netlab
from benchmarks.bench_remote_rows import (
    CACHE_TARGET,
    EPOCH1_TARGET,
    combine,
    epoch_rows,
    local_row,
    plot_results,
    print_rows,
)
from benchmarks.bench_remote_runs import BATCH, SAMPLE_SHAPE, link_rate, run_child, start_server, write_data
from benchmarks.harness import RESULTS_DIR, Row, kill_process_groups, markdown_table, write_results
from benchmarks.http_server import STATS_PATH

__all__ = ["main"]

LINK_RATE = "1gbit"


def _measure_all(
    root: Path, base: str, data: dict[str, Any], link_mb_s: float, args: argparse.Namespace
) -> list[Row]:
    """Every configuration: fastio over HTTP (each shard kind, workers 0 and 2, ``--repeats`` runs from an
    empty cache) beside local disk, and WebDataset over the served tars; their rows, printed as they come."""
    n = data["num_samples"]
    stats_url = base + STATS_PATH
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
                results.append(run_child(spec, per_run_s))
                shutil.rmtree(cache_dir, ignore_errors=True)
            result = combine(results)
            disk_row, local_rate = local_row(case, f"fastio local disk workers={workers}", result)
            new = epoch_rows(case, f"fastio http workers={workers}", result, link_mb_s, local_rate)
            new += [] if "error" in result else [disk_row]
            print_rows(new)
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
                result = combine([run_child(spec, per_run_s) for _ in range(repeats)])
                new = epoch_rows(case, label, result, link_mb_s, None)
                print_rows(new)
                rows += new
    return rows


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
    args = parser.parse_args(list(argv) if argv is not None else None)
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
        data = write_data(root, gigabytes, shard_mb)
        write_s = time.perf_counter() - start
        (root / "probe.bin").write_bytes(np.random.default_rng(1).bytes(probe_mb << 20))
        with netlab.HostLink(rate=LINK_RATE) as link:
            server, base = start_server(link, root)
            link_mb_s = link_rate(f"{base}/probe.bin", probe_mb << 20)
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


if __name__ == "__main__":
    print(main())
