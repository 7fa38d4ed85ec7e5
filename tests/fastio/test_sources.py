"""The built-in sources over part of a set's shards (what a remote cache holds): ShardSet.from_readers,
TarShardSet.from_parts and TarSource(layout=) give the batches the whole set gives for those samples."""

from __future__ import annotations

import io
import tarfile
import zlib

import numpy as np
import pytest
import torch

import fastio
from fastio.format.shards.reader import ShardSet
from fastio.format.shards.source import ShardSource
from fastio.format.tar.index import TarShardSet, load_tar_index
from fastio.format.tar.source import TarSource
from fastio.sources import BatchBuffers, StageTimes


def _fetch(source, indices):
    indices = np.asarray(indices, dtype=np.int64)
    return source.fetch(indices, BatchBuffers(source.fixed_specs(), len(indices), pin=False), 1, StageTimes())


def _write_tar(path, samples):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            for field, data in members.items():
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _npy(array) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


@pytest.fixture
def tars(tmp_path):
    """Three tars: x.npy is float32 (3,) in the first two, (4,) in the third, so the set has no fixed x."""
    rng = np.random.default_rng(zlib.crc32(b"tars"))
    paths, rows = [], []
    for shard, (count, width) in enumerate([(5, 3), (7, 3), (3, 4)]):
        samples = []
        for i in range(count):
            x = rng.standard_normal(width).astype(np.float32)
            rows.append(x)
            key = f"s{shard}-{i:02d}"
            samples.append(
                (key, {"x.npy": _npy(x), "cls": str(shard * 10 + i).encode(), "txt": key.encode()})
            )
        path = str(tmp_path / f"shard-{shard}.tar")
        _write_tar(path, samples)
        paths.append(path)
    return paths, rows


def test_shard_subset_reads_the_same_samples_as_the_set(shard_dir, fio):
    full = ShardSet(shard_dir)
    part = ShardSource(ShardSet.from_readers(full.directory, full.schema, full.readers[3:5]))
    assert part.shard_sizes == full.shard_sizes[3:5]
    local = np.array([0, 25, 13, 7])
    batch = _fetch(part, local)
    assert batch["y"].tolist() == (local + 3 * fio.SHARD_SAMPLES).tolist()
    fio.check_batch(batch)


def test_shard_subset_of_no_readers_is_refused(shard_dir):
    full = ShardSet(shard_dir)
    with pytest.raises(fastio.EmptySourceError, match="no samples"):
        ShardSet.from_readers(full.directory, full.schema, [])


def test_tar_subset_with_the_set_layout_gives_the_set_types(tars):
    paths, rows = tars
    whole = TarSource(TarShardSet(paths))
    assert "x.npy" not in whole.layout.npy_fixed and whole.layout.ints == ("cls",)
    parts = TarShardSet.from_parts(paths[:2], [load_tar_index(p) for p in paths[:2]])
    alone = TarSource(parts)
    assert "x.npy" in alone.layout.npy_fixed  # uniform by chance in these two shards
    subset = TarSource(parts, layout=whole.layout)
    indices = [6, 0, 11]
    got, expected = _fetch(subset, indices), _fetch(whole, indices)
    assert set(got) == set(expected)
    assert isinstance(got["x.npy"], list)
    for a, b, i in zip(got["x.npy"], expected["x.npy"], indices, strict=True):
        assert torch.equal(a, b) and np.array_equal(a.numpy(), rows[i])
    assert torch.equal(got["cls"], expected["cls"]) and got["__key__"] == expected["__key__"]


def test_tar_subset_that_breaks_the_layout_is_refused(tars):
    paths, _ = tars
    fixed = TarSource(TarShardSet(paths[:2])).layout
    with pytest.raises(fastio.SchemaMismatchError, match=r"x\.npy.*\(3,\)"):
        TarSource(TarShardSet.from_parts(paths[2:], [load_tar_index(paths[2])]), layout=fixed)


def test_tar_from_parts_needs_one_index_per_path(tars):
    paths, _ = tars
    with pytest.raises(ValueError, match="2 paths but 1 indexes"):
        TarShardSet.from_parts(paths[:2], [load_tar_index(paths[0])])
