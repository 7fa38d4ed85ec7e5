"""The native gather and tar scan against their torch / tarfile twins (skipped when fastio._C is absent)."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import torch

import fastio
from fastio import _native
from fastio.files import gather
from fastio.files.mapped import MappedFile, MappedTable
from fastio.format.tar import scan as tarscan

pytestmark = pytest.mark.skipif(not _native.native(), reason=f"fastio._C not in use: {fastio.backend()}")


@pytest.fixture
def table(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for s, size in enumerate([1000, 37, 4099]):
        path = tmp_path / f"f{s}.bin"
        path.write_bytes(rng.integers(0, 256, size=size, dtype=np.uint8).tobytes())
        paths.append(path)
    return MappedTable([MappedFile(p) for p in paths])


def _with_fallback(monkeypatch, fn):
    native = fn()
    monkeypatch.setattr(_native, "_C", None)
    return native, fn()


@pytest.mark.parametrize("row", [1, 7, 33])
@pytest.mark.parametrize("threads", [1, 3])
def test_gather_rows_matches_fallback(monkeypatch, table, row, threads):
    rng = np.random.default_rng(row)
    ids = rng.integers(0, 3, size=50).astype(np.int32)
    offsets = np.array([rng.integers(0, table.limits[i] - row + 1) for i in ids], dtype=np.int64)

    def run():
        out = torch.empty(50, row, dtype=torch.uint8)
        gather.gather_rows(table, ids, offsets, row, out, threads)
        return out

    native, reference = _with_fallback(monkeypatch, run)
    expected = np.stack([table.files[i].array[o : o + row] for i, o in zip(ids, offsets, strict=True)])
    np.testing.assert_array_equal(native.numpy(), expected)
    np.testing.assert_array_equal(reference.numpy(), expected)


def test_gather_ranges_matches_fallback(monkeypatch, table):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 3, size=40).astype(np.int32)
    lengths = rng.integers(0, 30, size=40).astype(np.int64)
    offsets = np.array(
        [rng.integers(0, table.limits[i] - n + 1) for i, n in zip(ids, lengths, strict=True)], dtype=np.int64
    )

    def run():
        out = torch.zeros(int(lengths.sum()), dtype=torch.uint8)
        starts = gather.gather_ranges(table, ids, offsets, lengths, out, 2)
        return out, starts

    (native, starts), (reference, _) = _with_fallback(monkeypatch, run)
    pieces = zip(ids, offsets, lengths, strict=True)
    expected = b"".join(table.files[i].array[o : o + n].tobytes() for i, o, n in pieces)
    assert native.numpy().tobytes() == expected == reference.numpy().tobytes()
    assert starts[0] == 0 and starts[-1] == lengths[:-1].sum()


def test_out_of_bounds_raises_instead_of_reading(table):
    out = torch.empty(2, 10, dtype=torch.uint8)
    with pytest.raises(IndexError, match="maps only 37 bytes"):
        gather.gather_rows(table, np.array([0, 1], np.int32), np.array([0, 30], np.int64), 10, out, 1)
    with pytest.raises(IndexError, match="shard 5"):
        gather.gather_rows(table, np.array([5, 1], np.int32), np.array([0, 0], np.int64), 10, out, 1)
    with pytest.raises(ValueError, match="output holds"):
        gather.gather_rows(table, np.array([0, 0], np.int32), np.array([0, 0], np.int64), 10, out[:1], 1)


def test_scan_tar_matches_tarfile(tmp_path):
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as archive:
        for name, size in [("a/short.txt", 3), ("b/" + "long" * 40 + ".x.npy", 1000), ("c.bin", 0)]:
            info = tarfile.TarInfo(name)
            info.size = size
            archive.addfile(info, io.BytesIO((bytes(range(256)) * (size // 256 + 1))[:size]))
    with tarfile.open(path, "a", format=tarfile.PAX_FORMAT) as archive:
        info = tarfile.TarInfo("pax/" + "p" * 120 + ".cls")
        info.size = 2
        archive.addfile(info, io.BytesIO(b"42"))
    scan = tarscan.scan_tar(str(path))
    with tarfile.open(path) as archive:
        members = [m for m in archive if m.isfile()]
    assert [n.decode() for n in scan.names] == [m.name for m in members]
    assert scan.offsets.tolist() == [m.offset_data for m in members]
    assert scan.sizes.tolist() == [m.size for m in members]
    assert scan.problem == ""
    reference = tarscan._scan_tar_reference(str(path))
    assert (reference.names, reference.problem) == (scan.names, scan.problem)
    assert reference.offsets.tolist() == scan.offsets.tolist()
    assert reference.sizes.tolist() == scan.sizes.tolist()


def test_parallel_gather_from_many_threads(tmp_path):
    """Big enough to split across helper threads, called from several Python threads at once."""
    import threading

    rng = np.random.default_rng(3)
    path = tmp_path / "big.bin"
    path.write_bytes(rng.integers(0, 256, size=3_000_000, dtype=np.uint8).tobytes())
    table = MappedTable([MappedFile(path)])
    row, batch = 4099, 300
    errors = []

    def run(seed: int) -> None:
        local = np.random.default_rng(seed)
        for _ in range(5):
            offsets = local.integers(0, table.limits[0] - row, size=batch).astype(np.int64)
            out = torch.empty(batch, row, dtype=torch.uint8)
            gather.gather_rows(table, np.zeros(batch, np.int32), offsets, row, out, 3)
            expected = np.stack([table.files[0].array[o : o + row] for o in offsets])
            if not np.array_equal(out.numpy(), expected):
                errors.append(seed)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_many_small_parallel_gathers(tmp_path):
    """Jobs of two or three chunks, back to back: the caller often takes the last chunk while a helper is
    waking up for it (a helper that found the job used up once dereferenced nothing)."""
    rng = np.random.default_rng(4)
    path = tmp_path / "mid.bin"
    path.write_bytes(rng.integers(0, 256, size=1_000_000, dtype=np.uint8).tobytes())
    table = MappedTable([MappedFile(path)])
    row, batch = 1024, 300  # 300 KiB: just above the two-chunk threshold
    ids = np.zeros(batch, np.int32)
    out = torch.empty(batch, row, dtype=torch.uint8)
    for k in range(20_000):
        offsets = ((np.arange(batch, dtype=np.int64) * 7919 + k * 31) % (table.limits[0] - row)).astype(
            np.int64
        )
        gather.gather_rows(table, ids, offsets, row, out, 2 + k % 3)
        if k % 2000 == 0:
            np.testing.assert_array_equal(
                out[-1].numpy(), table.files[0].array[offsets[-1] : offsets[-1] + row]
            )
