"""Hostile and damaged input: every case must raise a named fastio error that names the file and says what
was expected and what was found. Nothing may hang, allocate without bound, crash the process, or return data
the file does not hold."""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zlib
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import fastio
from fastio import _native
from fastio.format.shards.layout import PREFIX
from fastio.format.shards.reader import ShardReader, ShardSet
from fastio.format.tar import scan as tarscan
from fastio.format.tar.decode import decode_default
from fastio.format.tar.index import INDEX_SUFFIX, TarShardSet, index_tar, load_tar_index
from fastio.registry import open_source

NATIVE = pytest.mark.skipif(not _native.native(), reason=f"needs fastio._C: {fastio.backend()}")


def _rng(case: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(case).encode()))


# -- raw tar bytes --------------------------------------------------------------------------------------


def _octal(n: int) -> bytes:
    return b"%011o\0" % n


def _base256(n: int) -> bytes:
    """GNU base-256: the top bit of the first byte set, then the number in two's complement, big-endian."""
    raw = bytearray((n % (1 << 96)).to_bytes(12, "big"))
    raw[0] |= 0x80
    return bytes(raw)


def _header(name: bytes, size_field: bytes, kind: bytes = b"0") -> bytes:
    h = bytearray(512)
    h[: len(name)] = name
    h[100:124] = b"0000644\0" + b"0000000\0" * 2
    h[124:136] = size_field
    h[136:148] = b"00000000000\0"
    h[156:157] = kind
    h[257:265] = b"ustar\x0000"
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def _member(name: bytes, data: bytes, size_field: bytes | None = None, kind: bytes = b"0") -> bytes:
    pad = b"\0" * (-len(data) % 512)
    return _header(name, size_field or _octal(len(data)), kind) + data + pad


END = b"\0" * 1024


def _members(case: object, count: int) -> list[bytes]:
    rng = _rng(case)
    return [
        _member(f"k{i:03d}.bin".encode(), rng.integers(0, 256, 300 + 100 * i, dtype=np.uint8).tobytes())
        for i in range(count)
    ]


SCANNERS = {
    "native": pytest.param("native", marks=NATIVE),
    "reference": pytest.param("reference"),
}


def _scan(backend: str, path: Path) -> tarscan.TarScan:
    if backend == "reference":
        try:
            return tarscan._scan_tar_reference(str(path))
        except ValueError as exc:  # what scan_tar turns into CorruptShardError
            raise fastio.CorruptShardError(str(path), "tar header", "a well-formed tar", str(exc)) from None
    return tarscan.scan_tar(str(path))


# -- 1. tar header fields ---------------------------------------------------------------------------------

HEADER_CASES = {
    # -1023 keeps the next header where it is: the scan once looped here, appending until bad_alloc.
    "negative base-256 size": (_member(b"a.bin", b"x" * 600, _base256(-1023)), "negative base-256"),
    "base-256 size beyond int64": (_member(b"a.bin", b"x" * 10, b"\x80" + b"\xff" * 11), "overflows int64"),
    "non-octal size": (_member(b"a.bin", b"x" * 10, b"0000001a012\0"), "non-octal bytes"),
    "pax record shorter than its text": (_member(b"pax", b"5 path=abc\n", kind=b"x"), "bad length"),
    "pax record length not a number": (_member(b"pax", b"zz path=abc\n", kind=b"x"), "bad length"),
    "pax record longer than the header": (_member(b"pax", b"99999 path=abc\n", kind=b"x"), "bad length"),
}


@pytest.mark.parametrize("backend", SCANNERS.values())
@pytest.mark.parametrize("case", HEADER_CASES)
def test_malformed_tar_header_field_is_refused(tmp_path, monkeypatch, backend, case):
    if backend == "reference":
        monkeypatch.setattr(_native, "_C", None)
    blob, message = HEADER_CASES[case]
    path = tmp_path / "bad.tar"
    path.write_bytes(blob + _member(b"b.bin", b"y" * 7) + END)
    with pytest.raises(fastio.CorruptShardError, match=rf"bad\.tar.*{message}.* at byte 0"):
        index_tar(path, write=False)


@pytest.mark.parametrize("backend", SCANNERS.values())
def test_pax_size_and_path_records_apply_to_the_next_member(tmp_path, backend):
    records = b"".join(
        b"%d %s\n" % (len(r) + len(str(len(r) + 3)) + 2, r) for r in (b"path=long/" + b"n" * 150 + b".bin",)
    )
    path = tmp_path / "pax.tar"
    path.write_bytes(_member(b"pax", records, kind=b"x") + _member(b"short.bin", b"z" * 9) + END)
    scan = _scan(backend, path)
    assert scan.names == [b"long/" + b"n" * 150 + b".bin"] and scan.sizes.tolist() == [9]


@pytest.mark.parametrize("backend", SCANNERS.values())
def test_old_signed_checksum_is_accepted(tmp_path, backend):
    """Some old tars summed the header as signed bytes; tarfile reads them, so do we."""
    header = bytearray(_header("é.bin".encode(), _octal(3)))
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(b - 256 if b >= 0x80 else b for b in header)
    path = tmp_path / "signed.tar"
    path.write_bytes(bytes(header) + b"abc".ljust(512, b"\0") + END)
    assert _scan(backend, path).names == ["é.bin".encode()]


def test_reference_scan_agrees_with_the_native_one_on_real_archives(tmp_path):
    if not _native.native():
        pytest.skip(f"needs fastio._C: {fastio.backend()}")
    path = tmp_path / "t.tar"
    rng = _rng("real archives")
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as archive:
        for i, size in enumerate([0, 1, 511, 512, 513, 5000]):
            info = tarfile.TarInfo(f"d/{'ü' * (i * 30)}{i}.bin")
            info.size = size
            archive.addfile(info, io.BytesIO(rng.integers(0, 256, size, dtype=np.uint8).tobytes()))
    native, reference = tarscan.scan_tar(str(path)), tarscan._scan_tar_reference(str(path))
    assert native.names == reference.names and native.problem == reference.problem == ""
    assert native.offsets.tolist() == reference.offsets.tolist()
    assert native.sizes.tolist() == reference.sizes.tolist()


# -- 3. the end of the archive -------------------------------------------------------------------------


def _zeroed_second_header(members: list[bytes]) -> bytes:
    return members[0] + b"\0" * 512 + members[1][512:] + b"".join(members[2:]) + END


ENDINGS = {
    "zeroed header": (_zeroed_second_header, r"zero block at byte 1024 followed by non-zero data", 1),
    "concatenated archives": (
        lambda m: m[0] + END + b"".join(m[1:]) + END,
        r"zero block at byte 1024 followed by a member header at byte 2048",
        1,
    ),
    "cut at a block boundary": (
        lambda m: b"".join(m[:2]),
        r"no end-of-archive marker: file ends at 2048 after 2 members",
        2,
    ),
}


@pytest.mark.parametrize("backend", SCANNERS.values())
@pytest.mark.parametrize("case", ENDINGS)
def test_damaged_end_of_archive_is_reported(tmp_path, backend, case):
    build, message, kept = ENDINGS[case]
    path = tmp_path / "a.tar"
    path.write_bytes(build(_members(case, 3)))
    scan = _scan(backend, path)
    assert scan.problem and len(scan.names) == kept
    assert re.search(message, scan.problem), scan.problem


@pytest.mark.parametrize("case", ENDINGS)
def test_strict_by_default_and_strict_false_serves_what_is_before(tmp_path, case):
    build, message, kept = ENDINGS[case]
    path = tmp_path / "a.tar"
    path.write_bytes(build(_members(case, 3)))
    with pytest.raises(fastio.CorruptShardError, match=rf"a\.tar.*end of archive.*{message}.*strict=False"):
        index_tar(path)
    with pytest.raises(fastio.CorruptShardError, match=message):  # the sidecar remembers, no rescan
        TarShardSet(str(path))
    assert TarShardSet(str(path), strict=False).num_samples == kept
    assert open_source(str(path), tar_strict=False).num_samples == kept
    with pytest.raises(fastio.CorruptShardError, match=message):
        open_source(str(path))
    with pytest.raises(fastio.CorruptShardError, match=message):
        fastio.StreamLoader(str(path))
    loader = fastio.StreamLoader(str(path), batch_size=8, read=fastio.ReadOptions(tar_strict=False))
    assert sum(len(batch["__key__"]) for batch in loader) == kept


@pytest.mark.parametrize("padding", [0, 1, 18])
def test_clean_endings_are_accepted(tmp_path, padding):
    """GNU tar ends with two zero blocks and pads to a 10 KiB record; one zero block is also a marker."""
    path = tmp_path / "a.tar"
    path.write_bytes(b"".join(_members(padding, 3)) + b"\0" * 512 * (1 + padding))
    assert index_tar(path).num_samples == 3


def test_tarfile_archive_is_clean(tmp_path):
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w") as archive:
        for i in range(3):
            info = tarfile.TarInfo(f"s{i}.cls")
            info.size = 1
            archive.addfile(info, io.BytesIO(b"%d" % i))
    assert index_tar(path).num_samples == 3


# -- 4. the .fidx sidecar ------------------------------------------------------------------------------


def _tar(path: Path, keys: list[str], case: object) -> Path:
    rng = _rng(case)
    blob = b"".join(
        _member(f"{k}.x".encode(), rng.integers(0, 256, 700, dtype=np.uint8).tobytes())
        + _member(f"{k}.cls".encode(), b"%d" % (i % 10))
        for i, k in enumerate(keys)
    )
    path.write_bytes(blob + END)
    return path


def _rewrite_sidecar(path: Path, **changes: np.ndarray) -> None:
    sidecar = str(path) + INDEX_SUFFIX
    with np.load(sidecar) as data:
        arrays = {k: data[k] for k in data.files}
    arrays.update(changes)
    with open(sidecar, "wb") as fh:
        np.savez(fh, **arrays)


SIDECAR_CASES = {
    "negative offset": lambda o, s: (np.where(np.arange(o.size).reshape(o.shape) == 3, -512, o), s),
    "unaligned offset": lambda o, s: (o + np.eye(*o.shape, dtype=np.int64) * 7, s),
    "overlapping members": lambda o, s: (np.where(np.arange(o.size).reshape(o.shape) == 2, o[0, 0], o), s),
    "member past the end": lambda o, s: (o, s + np.eye(*s.shape, dtype=np.int64) * 10**9),
}


@pytest.mark.parametrize("case", SIDECAR_CASES)
def test_sidecar_offsets_the_tar_cannot_hold_are_refused(tmp_path, case):
    path = _tar(tmp_path / "a.tar", [f"k{i}" for i in range(5)], case)
    index = index_tar(path)
    offsets, sizes = SIDECAR_CASES[case](index.offsets, index.sizes)
    _rewrite_sidecar(path, offsets=offsets, sizes=sizes)
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar\.fidx: field '(offsets|sizes)'"):
        load_tar_index(path)
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar\.fidx"):
        fastio.StreamLoader(str(path), batch_size=2)


def test_stale_sidecar_of_a_same_size_tar_with_copied_mtime(tmp_path):
    old = _tar(tmp_path / "a.tar", [f"k{i}" for i in range(5)], "old")
    index_tar(old)
    stamp = os.stat(old).st_mtime_ns
    new = _tar(tmp_path / "b.tar", [f"j{i}" for i in range(5)], "new")
    assert new.stat().st_size == old.stat().st_size
    shutil.copyfile(new, old)
    os.utime(old, ns=(stamp, stamp))
    with pytest.raises(fastio.MissingIndexError, match="stale"):
        load_tar_index(old, build=False)
    assert load_tar_index(old).keys.tolist() == [f"j{i}" for i in range(5)]


# -- 2. .npy members shorter than their header says --------------------------------------------------------


def _npy(array: np.ndarray, cut: int = 0) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()[: len(buf.getvalue()) - cut]


def test_short_npy_members_of_one_size_are_refused_at_open(tmp_path):
    rng = _rng("short uniform npy")
    path = tmp_path / "a.tar"
    blob = b"".join(
        _member(f"k{i}.x.npy".encode(), _npy(rng.standard_normal((3, 4)).astype(np.float32), cut=8))
        for i in range(4)
    )
    path.write_bytes(blob + END)
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar.*k0\.x\.npy.*expected 48 bytes.*found 40"):
        fastio.StreamLoader(str(path), batch_size=2)


def test_short_npy_member_among_others_is_refused_when_read(tmp_path):
    rng = _rng("short ragged npy")
    path = tmp_path / "a.tar"
    blob = b"".join(
        _member(f"k{i}.x.npy".encode(), _npy(rng.standard_normal(3 + i), cut=4 if i == 2 else 0))
        for i in range(4)
    )
    path.write_bytes(blob + END)
    loader = fastio.StreamLoader(str(path), batch_size=4)
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar.*k2\.x\.npy.*expected 40 bytes.*found 36"):
        next(iter(loader))


@pytest.mark.parametrize("extra", [-1, 1])
def test_decode_default_checks_the_npy_payload_size(extra):
    data = _npy(np.arange(6, dtype=np.int16))
    data = data[:-1] if extra < 0 else data + b"\x07"
    with pytest.raises(fastio.CorruptShardError, match=r"expected 12 bytes"):
        decode_default("x.npy", data)


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
        b"".join(_member(f"k{i}.cls".encode(), b"7" if i != 2 else b"seven") for i in range(4)) + END
    )
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar.*k2\.cls.*integer.*b'seven'"):
        fastio.StreamLoader(str(path), batch_size=2)


def test_json_member_that_is_not_json(tmp_path):
    path = tmp_path / "a.tar"
    path.write_bytes(b"".join(_member(f"k{i}.json".encode(), b"{" if i else b"{}") for i in range(3)) + END)
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar.*k1\.json.*JSON"):
        next(iter(fastio.StreamLoader(str(path), batch_size=3)))


@pytest.mark.parametrize("backend", SCANNERS.values())
def test_member_name_that_is_not_utf8(tmp_path, backend, monkeypatch):
    if backend == "reference":
        monkeypatch.setattr(_native, "_C", None)
    path = tmp_path / "a.tar"
    path.write_bytes(_member(b"k0.cls", b"1") + _member(b"k\xff1.cls", b"2") + END)
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar.*member name at byte 1024.*UTF-8"):
        index_tar(path)


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
    rng = _rng("fitting casts")
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


# -- 6. a shard truncated while mapped ---------------------------------------------------------------------


def _run_child(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fastio.__file__).parents[1]), *sys.path])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


TRUNCATE_WHILE_ITERATING = """
    import os, sys
    import fastio
    loader = fastio.StreamLoader(
        {source!r}, batch_size=4, num_workers={workers}, worker_mode={mode!r}, prefetch=1
    )
    it = iter(loader)
    next(it)
    os.truncate({victim!r}, 600)
    try:
        for _ in it:
            pass
    except fastio.CorruptShardError as err:
        print("caught:", err)
        sys.exit(0)
    print("no error")
    sys.exit(3)
"""


def _fio_set(tmp_path: Path) -> tuple[str, str]:
    with fastio.ShardWriter(
        tmp_path / "s", max_samples=64, schema={"x": ("uint8", (512,)), "t": "bytes"}
    ) as w:
        rng = _rng("truncate fio")
        for i in range(128):
            w.write({"x": rng.integers(0, 256, 512, dtype=np.uint8), "t": b"%d" % i * 40})
    return str(tmp_path / "s"), str(tmp_path / "s" / "shard-000000.fio")


def _tar_set(tmp_path: Path) -> tuple[str, str]:
    rng = _rng("truncate tar")
    blob = b"".join(
        _member(f"k{i:03d}.x.npy".encode(), _npy(rng.standard_normal(64)))
        + _member(f"k{i:03d}.txt".encode(), b"t")
        for i in range(64)
    )
    (tmp_path / "a.tar").write_bytes(blob + END)
    return str(tmp_path / "a.tar"), str(tmp_path / "a.tar")


# Workers gather ahead of the consumer, so the truncation can land inside a copy: only the native guard
# turns that into an error (the torch fallback checks the size before each copy, which closes the window
# only when nothing gathers concurrently, as with num_workers=0).
@pytest.mark.parametrize(
    ("workers", "mode"),
    [(0, "thread"), pytest.param(2, "thread", marks=NATIVE), pytest.param(2, "process", marks=NATIVE)],
)
@pytest.mark.parametrize("kind", ["fio", "tar"])
def test_shard_truncated_while_iterating_raises_instead_of_sigbus(tmp_path, kind, workers, mode):
    source, victim = (_fio_set if kind == "fio" else _tar_set)(tmp_path)
    script = TRUNCATE_WHILE_ITERATING.format(source=source, victim=victim, workers=workers, mode=mode)
    child = _run_child(script, tmp_path)
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr[-3000:])
    assert "truncated while mapped" in child.stdout and Path(victim).name in child.stdout


@NATIVE
@pytest.mark.parametrize("threads", [1, 3])
def test_native_gather_turns_sigbus_into_an_error(tmp_path, threads):
    """The fstat check is bypassed, so the copy itself faults: the guard must name the file."""
    path = tmp_path / "big.bin"
    path.write_bytes(_rng(("sigbus", threads)).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    script = f"""
        import os, sys
        import numpy as np, torch
        import fastio
        from fastio.files import gather, mapped
        f = mapped.MappedFile({str(path)!r})
        table = mapped.MappedTable([f])
        f.check_size = lambda: None
        os.truncate({str(path)!r}, 4096)
        offsets = np.arange(200, dtype=np.int64) * 4096
        out = torch.empty(200, 4096, dtype=torch.uint8)
        try:
            gather.gather_rows(table, np.zeros(200, np.int32), offsets, 4096, out, {threads})
        except fastio.CorruptShardError as err:
            print("caught:", err)
        lengths = np.full(200, 4096, np.int64)
        try:
            gather.gather_ranges(table, np.zeros(200, np.int32), offsets, lengths, out.view(-1), {threads})
        except fastio.CorruptShardError as err:
            print("caught:", err)
    """
    child = _run_child(script, tmp_path)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert child.stdout.count("SIGBUS reading sample 1 at byte 4096") == 2, child.stdout
    assert "big.bin" in child.stdout


@NATIVE
def test_sigbus_in_the_output_is_not_blamed_on_the_shard(tmp_path):
    source, target = tmp_path / "src.bin", tmp_path / "out.bin"
    source.write_bytes(_rng("output fault").integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    target.write_bytes(b"\0" * (1 << 20))
    script = f"""
        import mmap, os
        import numpy as np, torch
        import fastio
        from fastio.files import gather, mapped
        table = mapped.MappedTable([mapped.MappedFile({str(source)!r})])
        with open({str(target)!r}, "r+b") as fh:
            shared = mmap.mmap(fh.fileno(), 0)
        out = torch.frombuffer(shared, dtype=torch.uint8).view(256, 4096)
        os.truncate({str(target)!r}, 4096)
        offsets = np.arange(256, dtype=np.int64) * 4096
        try:
            gather.gather_rows(table, np.zeros(256, np.int32), offsets, 4096, out, 1)
        except fastio.CorruptShardError as err:
            print("blamed the shard:", err)
        except RuntimeError as err:
            print("caught:", err)
    """
    child = _run_child(script, tmp_path)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert "caught:" in child.stdout and "output buffer's memory faulted" in child.stdout, child.stdout


@NATIVE
@pytest.mark.parametrize("faulthandler", [False, True])
def test_sigbus_outside_a_guarded_copy_still_kills(tmp_path, faulthandler):
    """The guard chains: a SIGBUS it did not cause reaches the handler before it (or the default)."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\x01" * 8192)
    script = f"""
        import os, signal
        {"import faulthandler; faulthandler.enable()" if faulthandler else ""}
        import numpy as np, torch
        from fastio.files import gather, mapped
        table = mapped.MappedTable([mapped.MappedFile({str(path)!r})])
        out = torch.empty(8, dtype=torch.uint8)
        gather.gather_rows(table, np.zeros(1, np.int32), np.zeros(1, np.int64), 8, out)
        os.kill(os.getpid(), signal.SIGBUS)
        print("survived")
    """
    child = _run_child(script, tmp_path)
    assert child.returncode == -7 and "survived" not in child.stdout, (child.returncode, child.stdout)
    if faulthandler:
        assert "Bus error" in child.stderr


def test_checksum_pass_over_a_shard_truncated_since_open(tmp_path):
    source, victim = _fio_set(tmp_path)
    script = f"""
        import os
        import fastio
        from fastio.format.shards.reader import ShardReader
        reader = ShardReader({victim!r})
        os.truncate({victim!r}, 4096)
        try:
            reader.ensure_verified()
        except fastio.CorruptShardError as err:
            print("caught:", err)
    """
    child = _run_child(script, tmp_path)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert "shard-000000.fio" in child.stdout and "truncated while mapped" in child.stdout


@NATIVE
@hypothesis.settings(max_examples=150, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(
    edits=st.lists(st.tuples(st.integers(0, 4 * 1024 - 1), st.integers(0, 255)), min_size=1, max_size=4),
    fix_checksums=st.booleans(),
)
def test_native_and_reference_scans_agree_on_damaged_archives(tmp_path_factory, edits, fix_checksums):
    """Random byte edits (with checksums fixed, so the numeric fields and pax records are reached): both
    scanners refuse, or both return the same members and the same problem; neither hangs nor crashes."""
    pax = b"34 path=pax/" + b"p" * 17 + b".bin\n"
    blob = bytearray(
        _member(b"a.bin", b"A" * 700) + _member(b"pax", pax, kind=b"x") + _member(b"b.txt", b"B" * 20) + END
    )
    original = bytes(blob)
    for at, value in edits:
        blob[at % len(blob)] = value
    if fix_checksums:
        for start in range(0, len(blob), 512):
            header = blob[start : start + 512]
            if any(header) and header[257:262] == b"ustar":
                header[148:156] = b" " * 8
                blob[start + 148 : start + 156] = b"%06o\0 " % sum(header)
    directory = tmp_path_factory.mktemp("fuzz")
    clean, path = directory / "clean.tar", directory / "f.tar"
    clean.write_bytes(bytes(original))
    path.write_bytes(bytes(blob))
    assert len(pax) == 34 and tarscan._scan_tar_reference(str(clean)).names[1] == pax[8:-1]
    outcomes = []
    for scan in (lambda: tarscan.scan_tar(str(path)), lambda: tarscan._scan_tar_reference(str(path))):
        try:
            found = scan()
            outcomes.append((found.names, found.offsets.tolist(), found.sizes.tolist(), found.problem))
        except (fastio.CorruptShardError, ValueError):
            outcomes.append("refused")
    assert outcomes[0] == outcomes[1]
