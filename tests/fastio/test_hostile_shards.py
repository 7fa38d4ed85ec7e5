"""Damaged fastio shard sets, and values their writer must refuse: an index.json or a shard header that
lies, and values a field's dtype cannot hold. Each must raise a named fastio error that names the file (or
the field) and says what was expected and what was found."""

from __future__ import annotations

import json
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import fastio
from fastio.format.shards.layout import PREFIX
from fastio.format.shards.reader import ShardReader, ShardSet

sys.path.insert(0, str(Path(__file__).parent))
from _hostile_inputs import rng_for  # noqa: E402

# -- 5. and 7. index.json and shard headers --------------------------------------------------------------


@pytest.fixture
def fresh_set(tmp_path, shard_dir):
    target = tmp_path / "set"
    shutil.copytree(shard_dir, target)
    return target


def _edit_index(directory: Path, edit) -> None:
    index_path = directory / "index.json"
    index = json.loads(index_path.read_text())
    edit(index)
    index_path.write_text(json.dumps(index))


def _escape_symlink(directory: Path, index: dict) -> None:
    outside = directory.parent / "outside.fio"
    shutil.copyfile(directory / index["shards"][0]["file"], outside)
    (directory / "link.fio").symlink_to(outside)
    index["shards"][0]["file"] = "link.fio"


INDEX_CASES = {
    "shard listed twice": (
        lambda d, ix: ix["shards"].__setitem__(1, dict(ix["shards"][0])),
        r"shards\[1\]\.file.*each shard listed once",
    ),
    "parent directory": (
        lambda d, ix: ix["shards"][0].__setitem__("file", "../set/" + ix["shards"][0]["file"]),
        None,  # resolves inside: allowed
    ),
    "leaves the directory": (lambda d, ix: ix["shards"][0].__setitem__("file", "../x.fio"), r"a file inside"),
    "absolute path": (
        lambda d, ix: ix["shards"][0].__setitem__("file", str(d / ix["shards"][0]["file"])),
        r"a file inside",
    ),
    "symlink out": (_escape_symlink, r"shards\[0\]\.file.*a file inside"),
    "no shards key": (lambda d, ix: ix.pop("shards"), r"field 'shards': expected a list, found no such key"),
    "file is a number": (
        lambda d, ix: ix["shards"][0].__setitem__("file", 5),
        r"field 'file': expected a str",
    ),
    "num_samples is text": (
        lambda d, ix: ix["shards"][0].__setitem__("num_samples", "13"),
        r"field 'num_samples': expected a int",
    ),
    "schema is a list": (lambda d, ix: ix.__setitem__("schema", [1]), r"field 'schema': expected a dict"),
    "schema field lacks dtype": (lambda d, ix: ix["schema"]["x"].pop("dtype"), r"field 'schema'"),
}


@pytest.mark.parametrize("case", INDEX_CASES)
def test_damaged_index_json(fresh_set, case):
    edit, message = INDEX_CASES[case]
    _edit_index(fresh_set, lambda index: edit(fresh_set, index))
    if message is None:
        assert ShardSet(fresh_set).num_samples == 117
        return
    with pytest.raises(fastio.CorruptShardError, match=rf"index\.json.*{message}"):
        ShardSet(fresh_set)


def test_index_json_that_is_not_utf8(fresh_set):
    (fresh_set / "index.json").write_bytes(b'{"format": "fastio-shards\xff"}')
    with pytest.raises(fastio.CorruptShardError, match=r"index\.json.*UTF-8 JSON.*UnicodeDecodeError"):
        ShardSet(fresh_set)


def _rewrite_shard_header(path: Path, header: bytes) -> None:
    """Replace a shard's JSON header, fixing the prefix (length, crc32, size): only its content is bad."""
    data = path.read_bytes()
    _, version, header_nbytes, _, reserved, file_nbytes = PREFIX.unpack(data[: PREFIX.size])
    body = data[: file_nbytes - header_nbytes] + header
    prefix = PREFIX.pack(b"FASTIOSH", version, len(header), zlib.crc32(header), reserved, len(body))
    path.write_bytes(prefix + body[PREFIX.size :])


SHARD_HEADER_CASES = {
    "not UTF-8": (lambda h: h.replace(b'"num_samples"', b'"num_s\xffmples"'), r"header.*UTF-8 JSON"),
    "no num_samples": (lambda h: h.replace(b'"num_samples"', b'"count"'), r"num_samples.*no such key"),
    "section missing": (lambda h: h.replace(b'"sections": {"x"', b'"sections": {"z"'), r"sections\.x"),
    "negative dim": (lambda h: h.replace(b"[3, 5]", b"[-1, 5]", 1), r"schema.*non-negative"),
}


@pytest.mark.parametrize("case", SHARD_HEADER_CASES)
def test_damaged_shard_header(fresh_set, case):
    edit, message = SHARD_HEADER_CASES[case]
    victim = fresh_set / "shard-000002.fio"
    reader = ShardReader(victim)
    raw = bytes(reader.file.array[-reader.file.size + PREFIX.size :])
    del reader
    header_nbytes = PREFIX.unpack(victim.read_bytes()[: PREFIX.size])[2]
    header = raw[-header_nbytes:]
    assert edit(header) != header
    _rewrite_shard_header(victim, edit(header))
    with pytest.raises(fastio.CorruptShardError, match=rf"shard-000002\.fio.*{message}"):
        ShardReader(victim)


# -- 8. the writer refuses values its dtype cannot hold ----------------------------------------------------

WRITER_CASES = {
    "int64 50000 into int16": (
        "int16",
        np.array([5, 50000, -3]),
        r"int16 values in \[-32768, 32767\].*50000",
    ),
    "uint64 2**63 into int64": (
        "int64",
        np.array([1, 2**63], np.uint64),
        r"int64 values in \[-9223372036854775808, 9223372036854775807\].*9223372036854775808",
    ),
    "float64 1e6 into float16": ("float16", np.array([1.0, 1e6]), r"float16 values within.*1000000.*inf"),
    "float64 1e300 into float32": ("float32", np.array([1e300]), r"float32 values within"),
}


@pytest.mark.parametrize("case", WRITER_CASES)
@pytest.mark.parametrize("many", [False, True])
def test_writer_refuses_values_that_do_not_fit(tmp_path, case, many):
    dtype, values, message = WRITER_CASES[case]
    writer = fastio.ShardWriter(tmp_path / "s", schema={"v": (dtype, (len(values),))})
    with pytest.raises(fastio.SchemaMismatchError, match=rf"field 'v'.*{message}"):
        writer.write_many({"v": values[None]}) if many else writer.write({"v": values})


def test_writer_keeps_exact_casts_that_fit(tmp_path):
    rng = rng_for("fitting casts")
    ints = rng.integers(-32768, 32768, size=(7, 3))
    halves = rng.standard_normal((7, 2)) * 100
    halves[0, 0] = np.inf  # an inf stays an inf: not an overflow
    with fastio.ShardWriter(tmp_path / "s", schema={"i": ("int16", (3,)), "h": ("float16", (2,))}) as writer:
        writer.write({"i": np.int64(5) + np.zeros(3, np.int64), "h": halves[0]})
        writer.write_many({"i": ints, "h": halves})
    reader = ShardSet(tmp_path / "s").readers[0]
    np.testing.assert_array_equal(reader.fixed("i")[0], [5, 5, 5])
    np.testing.assert_array_equal(reader.fixed("i")[1:], ints.astype(np.int16))
    np.testing.assert_array_equal(reader.fixed("h")[1:], halves.astype(np.float16))
