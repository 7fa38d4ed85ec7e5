"""Tiny odd-sized datasets shared by the fastio tests: 117 samples in shards of 13."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fastio
from benchmarks.http_server import HttpServer

NUM_SAMPLES = 117
SHARD_SAMPLES = 13
SCHEMA = {"x": ("int16", (3, 5)), "y": ("int64", ()), "tokens": ("int32", None), "text": "bytes"}


def make_sample(i: int) -> dict:
    """Sample ``i``: every field encodes ``i`` differently, so a mix-up between fields or samples shows."""
    return {
        "x": (np.arange(15, dtype=np.int16).reshape(3, 5) * 7 + i).astype(np.int16),
        "y": i,
        "tokens": np.arange(1 + (i * 37) % 29, dtype=np.int32) + 1000 * i,
        "text": f"sample-{i}".encode() * (1 + i % 3),
    }


def write_set(directory: Path, num_samples: int = NUM_SAMPLES, shard_samples: int = SHARD_SAMPLES) -> Path:
    with fastio.ShardWriter(directory, schema=SCHEMA, max_samples=shard_samples) as writer:
        for i in range(num_samples):
            writer.write(make_sample(i))
    return directory


def check_batch(batch: dict) -> list[int]:
    """Assert every field of every sample of ``batch`` is the sample its ``y`` names; return the ys."""
    ys = batch["y"].tolist()
    for row, i in enumerate(ys):
        expected = make_sample(i)
        np.testing.assert_array_equal(batch["x"][row].numpy(), expected["x"])
        np.testing.assert_array_equal(batch["tokens"][row].numpy(), expected["tokens"])
        assert batch["text"][row] == expected["text"]
    return ys


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_set(tmp_path_factory.mktemp("fastio") / "train")


class Helpers:
    """The helpers above, as a fixture (``--import-mode=importlib`` lets no test import conftest)."""

    NUM_SAMPLES = NUM_SAMPLES
    SHARD_SAMPLES = SHARD_SAMPLES
    SCHEMA = SCHEMA
    make_sample = staticmethod(make_sample)
    write_set = staticmethod(write_set)
    check_batch = staticmethod(check_batch)


@pytest.fixture(scope="session")
def fio() -> type[Helpers]:
    return Helpers


@pytest.fixture(autouse=True)
def _no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process group another test file left initialised must not split these tests' data across ranks."""
    import torch

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)


@pytest.fixture
def server(shard_dir: Path):
    """An HTTP server (benchmarks/http_server.py) over the folder that holds ``shard_dir``."""
    with HttpServer(shard_dir.parent) as running:
        yield running
