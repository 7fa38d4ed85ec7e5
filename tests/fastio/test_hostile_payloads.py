"""Sample payloads that do not decode: .npy members shorter than their header says, .cls, .json and str
values that are not what their type promises, and an image decode without Pillow. Each must raise a named
error that names the file and the sample, never return data the file does not hold."""

from __future__ import annotations

import builtins
import sys
from pathlib import Path

import numpy as np
import pytest

import fastio
from fastio.format.shards.reader import ShardReader
from fastio.format.tar.decode import decode_default

sys.path.insert(0, str(Path(__file__).parent))
from _hostile_inputs import END, npy_bytes, rng_for, tar_member  # noqa: E402

# -- 2. .npy members shorter than their header says --------------------------------------------------------


def test_short_npy_members_of_one_size_are_refused_at_open(tmp_path):
    rng = rng_for("short uniform npy")
    path = tmp_path / "a.tar"
    blob = b"".join(
        tar_member(f"k{i}.x.npy".encode(), npy_bytes(rng.standard_normal((3, 4)).astype(np.float32), cut=8))
        for i in range(4)
    )
    path.write_bytes(blob + END)
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar.*k0\.x\.npy.*expected 48 bytes.*found 40"):
        fastio.StreamLoader(str(path), batch_size=2)


def test_short_npy_member_among_others_is_refused_when_read(tmp_path):
    rng = rng_for("short ragged npy")
    path = tmp_path / "a.tar"
    blob = b"".join(
        tar_member(f"k{i}.x.npy".encode(), npy_bytes(rng.standard_normal(3 + i), cut=4 if i == 2 else 0))
        for i in range(4)
    )
    path.write_bytes(blob + END)
    loader = fastio.StreamLoader(str(path), batch_size=4)
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar.*k2\.x\.npy.*expected 40 bytes.*found 36"):
        next(iter(loader))


@pytest.mark.parametrize("extra", [-1, 1])
def test_decode_default_checks_the_npy_payload_size(extra):
    data = npy_bytes(np.arange(6, dtype=np.int16))
    data = data[:-1] if extra < 0 else data + b"\x07"
    with pytest.raises(fastio.CorruptShardError, match=r"expected 12 bytes"):
        decode_default("x.npy", data)


def test_text_field_that_is_not_utf8(tmp_path):
    with fastio.ShardWriter(tmp_path / "s", schema={"t": "str", "y": ("int64", ())}) as writer:
        for i in range(5):
            writer.write({"t": f"text-{i}", "y": i})
    victim = tmp_path / "s" / "shard-000000.fio"
    start = ShardReader(victim).sections["t"]["data"][0]
    data = bytearray(victim.read_bytes())
    data[start + len("text-0") + 2] = 0xFF  # inside sample 1
    victim.write_bytes(bytes(data))
    loader = fastio.StreamLoader(tmp_path / "s", batch_size=5, read=fastio.ReadOptions(verify=False))
    with pytest.raises(fastio.CorruptShardError, match=r"shard-000000\.fio.*'t\[1\]'.*UTF-8"):
        next(iter(loader))
    with pytest.raises(fastio.CorruptShardError, match=r"'t\[1\]'"):
        ShardReader(victim, verify=False).variable("t", 1)


def test_cls_member_that_is_not_a_number(tmp_path):
    path = tmp_path / "a.tar"
    path.write_bytes(
        b"".join(tar_member(f"k{i}.cls".encode(), b"7" if i != 2 else b"seven") for i in range(4)) + END
    )
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar.*k2\.cls.*integer.*b'seven'"):
        fastio.StreamLoader(str(path), batch_size=2)


def test_json_member_that_is_not_json(tmp_path):
    path = tmp_path / "a.tar"
    path.write_bytes(
        b"".join(tar_member(f"k{i}.json".encode(), b"{" if i else b"{}") for i in range(3)) + END
    )
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar.*k1\.json.*JSON"):
        next(iter(fastio.StreamLoader(str(path), batch_size=3)))


# -- 9. Pillow ---------------------------------------------------------------------------------------------


def test_pil_decode_without_pillow_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_pillow(name, *args, **kwargs):
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError("No module named 'PIL'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pillow)
    with pytest.raises(ImportError, match=r'pip install "fastcomm\[image\]"'):
        decode_default("png", b"\x89PNG....", images="pil")
