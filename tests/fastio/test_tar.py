"""WebDataset tar shards read in place: index, sample-for-sample equality with webdataset, faults."""

from __future__ import annotations

import io
import os
import shutil

import numpy as np
import pytest
import torch

import fastio
from fastio.files.paths import expand_pattern
from fastio.format.tar.index import INDEX_SUFFIX, load_tar_index

wds = pytest.importorskip("webdataset")

NUM, PER_SHARD = 47, 13


def _sample(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "__key__": f"dir/s{i:05d}",
        "x.npy": rng.standard_normal((3, 4)).astype(np.float32),
        "tok.npy": np.arange(1 + i % 5, dtype=np.int64) * i,
        "cls": i % 10,
        "txt": f"text {i} ü",
        "json": {"i": i, "sq": i * i},
        "bin": bytes([i % 256]) * (i % 4),
    }


@pytest.fixture(scope="module")
def tar_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tars")
    with wds.ShardWriter(str(directory / "shard-%06d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
        for i in range(NUM):
            sink.write(_sample(i))
    return directory


def _pattern(directory) -> str:
    return str(directory / "shard-{000000..000003}.tar")


def test_expand_pattern():
    assert expand_pattern("a-{008..011}.tar") == ["a-008.tar", "a-009.tar", "a-010.tar", "a-011.tar"]
    assert expand_pattern("{x,y}-{1..2}") == ["x-1", "x-2", "y-1", "y-2"]


def test_index_tar_groups_members_by_key(tar_dir):
    index = fastio.index_tar(tar_dir / "shard-000001.tar")
    assert index.num_samples == PER_SHARD
    assert index.keys[0] == f"dir/s{PER_SHARD:05d}"
    assert set(index.fields) == {"x.npy", "tok.npy", "cls", "txt", "json", "bin"}
    assert os.path.exists(str(tar_dir / "shard-000001.tar") + INDEX_SUFFIX)
    raw = (tar_dir / "shard-000001.tar").read_bytes()
    j = index.fields.index("txt")
    start, size = index.offsets[2, j], index.sizes[2, j]
    assert raw[start : start + size].decode() == f"text {PER_SHARD + 2} ü"


def test_reads_back_what_webdataset_reads(tar_dir):
    reference = {}
    for sample in wds.WebDataset(_pattern(tar_dir), shardshuffle=False).decode():
        reference[sample["__key__"]] = sample
    assert len(reference) == NUM
    loader = fastio.StreamLoader(_pattern(tar_dir), batch_size=6, shuffle=True, seed=0, num_workers=2)
    seen = []
    for batch in loader:
        assert batch["x.npy"].shape[1:] == (3, 4) and batch["cls"].dtype == torch.int64
        for row, key in enumerate(batch["__key__"]):
            ref = reference[key]
            np.testing.assert_array_equal(batch["x.npy"][row].numpy(), ref["x.npy"])
            np.testing.assert_array_equal(batch["tok.npy"][row].numpy(), ref["tok.npy"])
            assert batch["cls"][row].item() == ref["cls"]
            assert batch["txt"][row] == ref["txt"]
            assert batch["json"][row] == ref["json"]
            assert batch["bin"][row] == ref["bin"]
            seen.append(key)
    assert sorted(seen) == sorted(reference)


def test_user_decode_and_images(tmp_path):
    from PIL import Image

    with wds.TarWriter(str(tmp_path / "img.tar")) as sink:
        for i in range(5):
            buf = io.BytesIO()
            Image.fromarray(np.full((4, 6, 3), 40 * i, np.uint8)).save(buf, format="PNG")
            sink.write({"__key__": f"k{i}", "png": buf.getvalue(), "cls": i})
    pil = next(
        iter(
            fastio.StreamLoader(
                str(tmp_path / "img.tar"), batch_size=5, shuffle=False, read=fastio.ReadOptions(decode="pil")
            )
        )
    )
    assert [img.shape for img in pil["png"]] == [(4, 6, 3)] * 5
    assert [int(img[0, 0, 0]) for img in pil["png"]] == [0, 40, 80, 120, 160]
    raw = next(iter(fastio.StreamLoader(str(tmp_path / "img.tar"), batch_size=5, shuffle=False)))
    assert raw["png"][0].startswith(b"\x89PNG")
    custom = next(
        iter(
            fastio.StreamLoader(
                str(tmp_path / "img.tar"),
                batch_size=5,
                shuffle=False,
                read=fastio.ReadOptions(decode=lambda field, data: (field, len(data))),
            )
        )
    )
    assert custom["cls"][3] == ("cls", 1)


def test_missing_and_stale_sidecar(tmp_path, tar_dir):
    shard = tmp_path / "a.tar"
    shutil.copy(tar_dir / "shard-000000.tar", shard)
    with pytest.raises(fastio.MissingIndexError, match=r"a\.tar\.fidx"):
        load_tar_index(shard, build=False)
    assert load_tar_index(shard).num_samples == PER_SHARD  # built on demand
    shutil.copy(tar_dir / "shard-000002.tar", shard)  # a different tar under the same name
    with pytest.raises(fastio.MissingIndexError, match="stale"):
        load_tar_index(shard, build=False)
    index = load_tar_index(shard)
    assert index.keys[0] == f"dir/s{2 * PER_SHARD:05d}"


def test_truncated_and_corrupt_tar(tmp_path, tar_dir):
    data = (tar_dir / "shard-000000.tar").read_bytes()
    (tmp_path / "short.tar").write_bytes(data[: len(data) // 2 + 7])
    with pytest.raises(fastio.CorruptShardError, match=r"short\.tar"):
        fastio.index_tar(tmp_path / "short.tar")
    bad = bytearray(data)
    bad[3] ^= 0x55  # inside the first header's name: its checksum no longer matches
    (tmp_path / "bad.tar").write_bytes(bytes(bad))
    with pytest.raises(fastio.CorruptShardError, match=r"bad\.tar"):
        fastio.StreamLoader(str(tmp_path / "bad.tar"), batch_size=4)


def test_npy_members_of_equal_size_but_another_dtype_are_not_stacked(tmp_path):
    with wds.TarWriter(str(tmp_path / "mixed.tar")) as sink:
        for i in range(6):
            dtype = np.int32 if i == 4 else np.float32  # same byte size, another header
            sink.write({"__key__": f"k{i}", "x.npy": np.full((3, 4), i, dtype)})
    batch = next(iter(fastio.StreamLoader(str(tmp_path / "mixed.tar"), batch_size=6, shuffle=False)))
    assert isinstance(batch["x.npy"], list)
    assert [t.dtype for t in batch["x.npy"]] == [torch.float32] * 4 + [torch.int32, torch.float32]
    assert [int(t[2, 3]) for t in batch["x.npy"]] == list(range(6))
