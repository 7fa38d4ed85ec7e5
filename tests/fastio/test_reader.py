"""Faults injected on purpose into shard sets: each must raise a named error that says where and what."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import fastio
from fastio.format.shards.reader import ShardReader, ShardSet


@pytest.fixture
def fresh_set(tmp_path, shard_dir):
    target = tmp_path / "set"
    shutil.copytree(shard_dir, target)
    return target


def test_clean_set_opens_and_verifies(fresh_set, fio):
    shards = ShardSet(fresh_set, verify=True)
    assert shards.num_samples == fio.NUM_SAMPLES
    assert shards.shard_sizes == [13] * 9
    np.testing.assert_array_equal(shards.readers[2].fixed("x")[4], fio.make_sample(30)["x"])


def test_truncated_shard(fresh_set):
    victim = fresh_set / "shard-000003.fio"
    data = victim.read_bytes()
    victim.write_bytes(data[:-100])
    with pytest.raises(fastio.CorruptShardError, match=r"shard-000003\.fio.*file size.*expected") as info:
        ShardSet(fresh_set)
    assert info.value.path.endswith("shard-000003.fio")
    with pytest.raises(
        fastio.CorruptShardError, match=rf"file size.*{len(data)} bytes.*{len(data) - 100} bytes"
    ):
        ShardReader(victim)


def test_flipped_data_byte_caught_lazily_and_with_verify(fresh_set, fio):
    victim = fresh_set / "shard-000005.fio"
    reader = ShardReader(victim)
    start = reader.sections["x"]["data"][0]
    del reader
    data = bytearray(victim.read_bytes())
    data[start + 17] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(fastio.CorruptShardError, match=r"shard-000005\.fio: field 'x': expected crc32"):
        ShardSet(fresh_set, verify=True)
    loader = fastio.StreamLoader(fresh_set, batch_size=16, shuffle=False)  # lazily: opens fine
    with pytest.raises(fastio.CorruptShardError, match="field 'x'"):
        for _ in loader:
            pass
    threaded = fastio.StreamLoader(fresh_set, batch_size=16, shuffle=True, num_workers=2)
    with pytest.raises(fastio.CorruptShardError, match="shard-000005"):  # from a worker thread, no hang
        for _ in threaded:
            pass
    unchecked = fastio.StreamLoader(
        fresh_set, batch_size=16, shuffle=False, read=fastio.ReadOptions(verify=False)
    )
    assert sum(len(b["y"]) for b in unchecked) == fio.NUM_SAMPLES


def test_flipped_header_byte(fresh_set):
    victim = fresh_set / "shard-000000.fio"
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(fastio.CorruptShardError, match=r"shard-000000\.fio: field 'header'"):
        ShardSet(fresh_set)


def test_not_a_shard(fresh_set):
    victim = fresh_set / "shard-000001.fio"
    size = victim.stat().st_size
    victim.write_bytes(b"garbage!" * (size // 8) + b"g" * (size % 8))
    with pytest.raises(fastio.CorruptShardError, match="magic"):
        ShardSet(fresh_set)


def test_missing_index(fresh_set):
    (fresh_set / "index.json").unlink()
    with pytest.raises(fastio.MissingIndexError, match=r"index\.json"):
        fastio.StreamLoader(fresh_set, batch_size=4)


def test_missing_shard_file(fresh_set):
    (fresh_set / "shard-000004.fio").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard-000004\.fio: listed in .*index\.json but missing"):
        ShardSet(fresh_set)


def test_wrong_schema_in_index(fresh_set):
    index = json.loads((fresh_set / "index.json").read_text())
    index["schema"]["x"]["shape"] = [5, 3]
    (fresh_set / "index.json").write_text(json.dumps(index))
    with pytest.raises(fastio.SchemaMismatchError, match=r"shard-000000\.fio: field 'x'.*\(5, 3\).*\(3, 5\)"):
        ShardSet(fresh_set)


def test_shard_from_another_set(tmp_path, fresh_set):
    with fastio.ShardWriter(tmp_path / "other", schema={"x": ("int16", (3, 5)), "z": "bytes"}) as writer:
        for i in range(13):
            writer.write({"x": np.full((3, 5), i, np.int16), "z": b"x"})
    index = json.loads((fresh_set / "index.json").read_text())
    shutil.copy(tmp_path / "other" / "shard-000000.fio", fresh_set / "shard-000002.fio")
    index["shards"][2]["file_nbytes"] = (fresh_set / "shard-000002.fio").stat().st_size
    (fresh_set / "index.json").write_text(json.dumps(index))
    with pytest.raises(fastio.SchemaMismatchError, match=r"shard-000002\.fio: field 'y'.*no such field"):
        ShardSet(fresh_set)


def test_stale_temp_file_is_ignored(fresh_set, fio):
    (fresh_set / ".shard-000009.fio.tmp-4242").write_bytes(b"half a shard")
    loader = fastio.StreamLoader(fresh_set, batch_size=50, shuffle=False)
    assert sorted(y for b in loader for y in fio.check_batch(b)) == list(range(fio.NUM_SAMPLES))


def test_empty_dir_and_nonexistent_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(fastio.EmptySourceError, match="empty directory"):
        fastio.StreamLoader(tmp_path / "empty", batch_size=4)
    with pytest.raises(FileNotFoundError, match="no such shard directory"):
        fastio.StreamLoader(tmp_path / "nope", batch_size=4)
    with pytest.raises(FileNotFoundError, match="no such tar shard"):
        fastio.StreamLoader(str(tmp_path / "nope-{000..002}.tar"), batch_size=4)
    with pytest.raises(fastio.EmptySourceError, match="matches no file"):
        fastio.StreamLoader(str(tmp_path / "nope-*.tar"), batch_size=4)
