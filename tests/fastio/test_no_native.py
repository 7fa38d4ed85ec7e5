"""The loader without fastio._C (run by `make test` with FASTIO_NO_NATIVE=1): same data, order and resume.

Run under FASTIO_NO_NATIVE=1 these check the torch-op gather and the tarfile index; run with the native
module present they check the same behaviour there, so the file passes both ways.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import fastio
from fastio import _native


def test_backend_honours_the_switch():
    if os.environ.get("FASTIO_NO_NATIVE") == "1":
        assert not _native.native()
        assert fastio.backend().reason == "FASTIO_NO_NATIVE=1 is set"
    else:
        assert fastio.backend().native == _native.native()


@pytest.mark.parametrize("workers", [0, 2])
def test_data_order_and_resume(shard_dir, fio, workers):
    loader = fastio.StreamLoader(
        shard_dir, batch_size=9, seed=7, num_workers=workers, order=fastio.OrderOptions(rank=1, world_size=2)
    )
    full = []
    for batch in loader:
        fio.check_batch(batch)
        full.append(batch["y"].tolist())
    other = [
        b["y"].tolist()
        for b in fastio.StreamLoader(
            shard_dir, batch_size=9, seed=7, order=fastio.OrderOptions(rank=0, world_size=2)
        )
    ]
    assert sorted({y for b in full + other for y in b}) == list(range(fio.NUM_SAMPLES))
    for k in (0, 3, len(full)):
        it = iter(loader)
        head = [next(it)["y"].tolist() for _ in range(k)]
        state = loader.state_dict()
        resumed = fastio.StreamLoader(
            shard_dir, batch_size=9, seed=7, num_workers=1, order=fastio.OrderOptions(rank=1, world_size=2)
        )
        resumed.load_state_dict(state)
        assert head + [b["y"].tolist() for b in resumed] == full


def test_tar_without_native(tmp_path):
    wds = pytest.importorskip("webdataset")
    with wds.TarWriter(str(tmp_path / "a.tar")) as sink:
        for i in range(11):
            sink.write({"__key__": f"k{i:03d}", "x.npy": np.full((2, 3), i, np.int32), "cls": i})
    loader = fastio.StreamLoader(str(tmp_path / "a.tar"), batch_size=4, seed=0)
    seen = []
    for batch in loader:
        assert (batch["x.npy"][:, 1, 2] == batch["cls"]).all()
        assert batch["__key__"] == [f"k{c:03d}" for c in batch["cls"].tolist()]
        seen += batch["cls"].tolist()
    assert sorted(seen) == list(range(11))
