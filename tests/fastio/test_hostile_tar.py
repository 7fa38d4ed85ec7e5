"""Hostile tar archives: malformed header fields and pax records, a damaged end of archive, a .fidx sidecar
that does not fit its tar, and member names that are not UTF-8. Each must raise a named fastio error that
names the file and says what was expected and what was found; the native and the reference scan agree,
and neither hangs, allocates without bound or crashes."""

from __future__ import annotations

import io
import os
import re
import shutil
import sys
import tarfile
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import fastio
from fastio import _native
from fastio.format.tar import scan as tarscan
from fastio.format.tar.index import INDEX_SUFFIX, TarShardSet, index_tar, load_tar_index
from fastio.registry import open_source

sys.path.insert(0, str(Path(__file__).parent))
from _hostile_inputs import END, NATIVE, octal_field, rng_for, tar_header, tar_member  # noqa: E402


def _base256(n: int) -> bytes:
    """GNU base-256: the top bit of the first byte set, then the number in two's complement, big-endian."""
    raw = bytearray((n % (1 << 96)).to_bytes(12, "big"))
    raw[0] |= 0x80
    return bytes(raw)


def _members(case: object, count: int) -> list[bytes]:
    rng = rng_for(case)
    return [
        tar_member(f"k{i:03d}.bin".encode(), rng.integers(0, 256, 300 + 100 * i, dtype=np.uint8).tobytes())
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
    "negative base-256 size": (tar_member(b"a.bin", b"x" * 600, _base256(-1023)), "negative base-256"),
    "base-256 size beyond int64": (
        tar_member(b"a.bin", b"x" * 10, b"\x80" + b"\xff" * 11),
        "overflows int64",
    ),
    "non-octal size": (tar_member(b"a.bin", b"x" * 10, b"0000001a012\0"), "non-octal bytes"),
    "pax record shorter than its text": (tar_member(b"pax", b"5 path=abc\n", kind=b"x"), "bad length"),
    "pax record length not a number": (tar_member(b"pax", b"zz path=abc\n", kind=b"x"), "bad length"),
    "pax record longer than the header": (tar_member(b"pax", b"99999 path=abc\n", kind=b"x"), "bad length"),
}


@pytest.mark.parametrize("backend", SCANNERS.values())
@pytest.mark.parametrize("case", HEADER_CASES)
def test_malformed_tar_header_field_is_refused(tmp_path, monkeypatch, backend, case):
    if backend == "reference":
        monkeypatch.setattr(_native, "_C", None)
    blob, message = HEADER_CASES[case]
    path = tmp_path / "bad.tar"
    path.write_bytes(blob + tar_member(b"b.bin", b"y" * 7) + END)
    with pytest.raises(fastio.CorruptShardError, match=rf"bad\.tar.*{message}.* at byte 0"):
        index_tar(path, write=False)


@pytest.mark.parametrize("backend", SCANNERS.values())
def test_pax_size_and_path_records_apply_to_the_next_member(tmp_path, backend):
    records = b"".join(
        b"%d %s\n" % (len(r) + len(str(len(r) + 3)) + 2, r) for r in (b"path=long/" + b"n" * 150 + b".bin",)
    )
    path = tmp_path / "pax.tar"
    path.write_bytes(tar_member(b"pax", records, kind=b"x") + tar_member(b"short.bin", b"z" * 9) + END)
    scan = _scan(backend, path)
    assert scan.names == [b"long/" + b"n" * 150 + b".bin"] and scan.sizes.tolist() == [9]


@pytest.mark.parametrize("backend", SCANNERS.values())
def test_old_signed_checksum_is_accepted(tmp_path, backend):
    """Some old tars summed the header as signed bytes; tarfile reads them, so do we."""
    header = bytearray(tar_header("é.bin".encode(), octal_field(3)))
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(b - 256 if b >= 0x80 else b for b in header)
    path = tmp_path / "signed.tar"
    path.write_bytes(bytes(header) + b"abc".ljust(512, b"\0") + END)
    assert _scan(backend, path).names == ["é.bin".encode()]


def test_reference_scan_agrees_with_the_native_one_on_real_archives(tmp_path):
    if not _native.native():
        pytest.skip(f"needs fastio._C: {fastio.backend()}")
    path = tmp_path / "t.tar"
    rng = rng_for("real archives")
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
    rng = rng_for(case)
    blob = b"".join(
        tar_member(f"{k}.x".encode(), rng.integers(0, 256, 700, dtype=np.uint8).tobytes())
        + tar_member(f"{k}.cls".encode(), b"%d" % (i % 10))
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


@pytest.mark.parametrize("backend", SCANNERS.values())
def test_member_name_that_is_not_utf8(tmp_path, backend, monkeypatch):
    if backend == "reference":
        monkeypatch.setattr(_native, "_C", None)
    path = tmp_path / "a.tar"
    path.write_bytes(tar_member(b"k0.cls", b"1") + tar_member(b"k\xff1.cls", b"2") + END)
    with pytest.raises(fastio.CorruptShardError, match=r"a\.tar.*member name at byte 1024.*UTF-8"):
        index_tar(path)


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
        tar_member(b"a.bin", b"A" * 700)
        + tar_member(b"pax", pax, kind=b"x")
        + tar_member(b"b.txt", b"B" * 20)
        + END
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
