"""benchmarks/bench_remote*.py: repeated runs combined and judged against the link rate and local disk on
made-up results, and one measured run in its child process over a loopback server (no shaped link)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import bench_remote_rows as rows
from benchmarks import bench_remote_runs as runs
from benchmarks.http_server import STATS_PATH, HttpServer


def _epoch(mb_per_s: float, served_mb: float = 0.0, exactly_once: bool = True) -> dict:
    return {"seconds": 1.0, "samples": 100, "exactly_once": exactly_once, "mb_per_s": mb_per_s,
            "served_mb": served_mb}  # fmt: skip


def _run(first: float, cache: list[float], local: list[float], load: float = 1.0) -> dict:
    return {
        "epochs": [_epoch(first, served_mb=50.0), *(_epoch(c) for c in cache)],
        "local_epochs": [_epoch(v) for v in local],
        "loadavg_1m": load,
    }


def test_repeated_runs_give_the_median_epoch_1_and_pool_the_later_epochs():
    combined = rows.combine([_run(90.0, [800.0], [900.0], 1.0), _run(110.0, [700.0], [1000.0], 3.0),
                             _run(100.0, [600.0], [950.0], 2.0)])  # fmt: skip
    first = combined["epochs"][0]
    assert first["mb_per_s"] == 100.0 and first["runs_mb_per_s"] == [90.0, 110.0, 100.0]
    assert [e["mb_per_s"] for e in combined["epochs"][1:]] == [800.0, 700.0, 600.0]
    assert [e["mb_per_s"] for e in combined["local_epochs"]] == [900.0, 1000.0, 950.0]
    assert combined["epochs_per_run"] == 2 and combined["loadavg_1m"] == pytest.approx(2.0)


def test_a_failed_run_is_the_result_of_its_configuration():
    failed = {"error": "killed after 60 s (hung or too slow)"}
    assert rows.combine([_run(90.0, [], []), failed]) is failed
    (row,) = rows.epoch_rows("fastio shards", "fastio http workers=0", failed, 110.0, None)
    assert math.isnan(row.value) and row.extra["error"] == failed["error"]
    local, rate = rows.local_row("fastio shards", "fastio local disk workers=0", failed)
    assert math.isnan(local.value) and rate is None


@pytest.mark.parametrize(("first", "cache", "verdicts"), [(99.0, 850.0, ("yes", "yes")),
                                                          (90.0, 750.0, ("no", "no"))])  # fmt: skip
def test_epoch_1_is_judged_against_the_link_and_the_cache_epochs_against_local_disk(first, cache, verdicts):
    result = rows.combine([_run(first, [cache, cache], [1000.0, 1000.0])])
    disk, local_rate = rows.local_row("fastio shards", "fastio local disk workers=0", result)
    assert local_rate == 1000.0 and disk.backend == "fastio local disk workers=0 epochs 2-3"
    epoch1, cached = rows.epoch_rows("fastio shards", "fastio http workers=0", result, 110.0, local_rate)
    assert epoch1.ratio == pytest.approx(first / 110.0) and epoch1.ratio_to == "link rate"
    assert cached.ratio == pytest.approx(cache / 1000.0) and cached.backend.endswith("cache epochs 2-3")
    assert (epoch1.extra["pass"], cached.extra["pass"]) == verdicts
    assert epoch1.extra["served_MB"] == "50" and cached.extra["served_MB"] == "0"


def test_a_peer_row_is_measured_beside_the_targets_not_judged():
    result = rows.combine([_run(50.0, [], [])])
    (row,) = rows.epoch_rows("tar shards", "webdataset.WebDataset http workers=0", result, 110.0, None)
    assert row.ratio == pytest.approx(50.0 / 110.0) and "pass" not in row.extra


@pytest.mark.slow
def test_one_measured_run_reads_every_sample_once_and_counts_the_servers_bytes(tmp_path: Path):
    data = runs.write_data(tmp_path, gigabytes=0.004, shard_mb=1.0)
    with HttpServer(tmp_path) as server:
        spec = {"kind": "fastio", "target": server.url("fixed/"), "local": str(tmp_path / "fixed"),
                "workers": 0, "epochs": 2, "cache_dir": str(tmp_path / "cache"),
                "stats_url": server.url(STATS_PATH), "num_samples": data["num_samples"],
                "dataset_bytes": data["fixed_bytes"], "id_field": "y"}  # fmt: skip
        result = runs.run_child(spec, timeout_s=240.0)
    assert "error" not in result, result
    (first, cached), (local,) = result["epochs"], result["local_epochs"]
    assert first["exactly_once"] and cached["exactly_once"] and local["exactly_once"]
    assert first["served_mb"] * 1e6 == pytest.approx(data["fixed_bytes"], rel=0.05)
    assert cached["served_mb"] == 0.0  # the second epoch reads the cache alone
