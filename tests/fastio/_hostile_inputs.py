"""What the hostile-input tests (tests/fastio/test_hostile_*.py) build their damaged files from: tar members
written byte by byte (so a test can put any value in any header field), ``.npy`` payloads that can be cut
short, and inputs seeded from the case that uses them.

Example::

    blob = tar_member(b"a.bin", b"x" * 600, size_field=octal_field(9)) + tar_member(b"k.x.npy", npy_bytes(a))
    path.write_bytes(blob + END)
"""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest

import fastio
from fastio import _native

__all__ = ["END", "NATIVE", "npy_bytes", "octal_field", "rng_for", "tar_header", "tar_member"]

NATIVE = pytest.mark.skipif(not _native.native(), reason=f"needs fastio._C: {fastio.backend()}")

END = b"\0" * 1024  # the two zero blocks that end a tar


def rng_for(case: object) -> np.random.Generator:
    """A generator seeded from ``repr(case)``: the same inputs in every process and every run."""
    return np.random.default_rng(zlib.crc32(repr(case).encode()))


def octal_field(n: int) -> bytes:
    """A tar size field: 11 octal digits and a NUL."""
    return b"%011o\0" % n


def tar_header(name: bytes, size_field: bytes, kind: bytes = b"0") -> bytes:
    """A ustar header block with a correct checksum, whatever ``size_field`` holds."""
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


def tar_member(name: bytes, data: bytes, size_field: bytes | None = None, kind: bytes = b"0") -> bytes:
    """A header and ``data`` padded to 512 bytes; ``size_field`` replaces the true size when given."""
    pad = b"\0" * (-len(data) % 512)
    return tar_header(name, size_field or octal_field(len(data)), kind) + data + pad


def npy_bytes(array: np.ndarray, cut: int = 0) -> bytes:
    """``array`` as a ``.npy`` file, less its last ``cut`` bytes."""
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()[: len(buf.getvalue()) - cut]
