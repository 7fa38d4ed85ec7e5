"""The benchmarks and examples build their StreamLoaders in the current keyword forms: DataLoader's names
flat, fastio's own grouped (``fastio.OrderOptions``, ``RemoteOptions``, ``BatchOptions``...). An old flat
name (``cache_dir=``, ``rank=``, ``stages=``) warns, and the warning is an error here; each loader is built
by the function its benchmark calls, on tiny data, and reads a batch or an epoch."""

from __future__ import annotations

import argparse
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

import fastio
from benchmarks import bench_images, bench_loader_cases, bench_loader_timing, bench_remote_runs, bench_shuffle
from benchmarks.http_server import HttpServer
from examples import lm_data

# fastio's deprecation messages all start with the call they name; third-party warnings stay warnings
pytestmark = pytest.mark.filterwarnings("error:StreamLoader:DeprecationWarning")

SHARD_SAMPLES = 4  # bench_shuffle's 16 shards of this many samples


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bench_shuffle's class-sorted set (fields ``x``, ``y``, ``id``) under ``<root>/www/train``."""
    return bench_shuffle._write_set(tmp_path_factory.mktemp("forms"), SHARD_SAMPLES)


def test_the_old_flat_form_fails_here(shards: Path) -> None:
    with pytest.raises(DeprecationWarning, match=r"StreamLoader\(rank=\.\.\.\)"):
        fastio.StreamLoader(str(shards), batch_size=4, rank=0)


@pytest.mark.parametrize("options", [{"shuffle": True}, {"shuffle": True, "whole_shards": True},
                                     {"shuffle": "shard", "window": 2}])  # fmt: skip
def test_bench_shuffle_remote_loaders(shards: Path, tmp_path: Path, options: dict) -> None:
    with HttpServer(shards.parent) as server:
        loader = bench_shuffle._remote(server.url("train/"), tmp_path / "cache", 1 << 30, **options)
        try:
            assert len(next(iter(loader))["id"]) == bench_shuffle.BATCH
        finally:
            loader._source.close()


def test_bench_remote_fastio_run(shards: Path, tmp_path: Path) -> None:
    with HttpServer(shards.parent) as server:
        spec = {"target": server.url("train/"), "local": str(shards), "workers": 0, "epochs": 1,
                "cache_dir": str(tmp_path / "cache"), "stats_url": None, "id_field": "id",
                "num_samples": bench_shuffle.SHARDS * SHARD_SAMPLES, "dataset_bytes": 1}  # fmt: skip
        result = bench_remote_runs._fastio_epochs(spec)
    assert result["epochs"][0]["exactly_once"]


def test_bench_loader_stream_epochs(shards: Path) -> None:
    rate, _, _ = bench_loader_timing.stream_epochs(str(shards), 16, 1, shuffle=True, num_workers=0)
    assert rate > 0


def test_bench_loader_mixing(tmp_path: Path) -> None:
    args = argparse.Namespace(mix_samples=48, mix_epochs=1, batch=16)
    rows = bench_loader_cases.bench_mixing(tmp_path, args, [])
    assert len(rows) == 4


def test_bench_images_fastio_loader(tmp_path: Path) -> None:
    from PIL import Image

    with tarfile.open(tmp_path / "imgs-000000.tar", "w") as tar:
        for i in range(2):
            image = io.BytesIO()
            Image.fromarray(np.full((40, 56, 3), 60 * i, np.uint8)).save(image, format="JPEG")
            for name, payload in ((f"{i}.jpg", image.getvalue()), (f"{i}.cls", str(i).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    loader = bench_images._fastio(str(tmp_path / "imgs-000000.tar"), False, 2, 0)
    (batch,) = list(loader)
    assert tuple(batch["image"].shape) == (2, bench_images.SIZE, bench_images.SIZE, 3)


def test_the_lm_example_loader(shards: Path) -> None:
    loader = lm_data.loader(shards, batch_size=4, seed=0, rank=1, world=2)
    assert len(loader) == bench_shuffle.SHARDS * SHARD_SAMPLES // 2 // 4
