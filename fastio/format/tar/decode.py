"""Decoders for WebDataset member extensions, and a zero-copy ``.npy`` header parser.

Example::

    value = decode_default("cls", b"7")               # 7
    image = decode_default("jpg", data, images="pil")  # uint8 HWC tensor (needs Pillow)
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import torch

from fastio.errors import CorruptShardError
from fastio.format.tar.npy import NPY_HEADER_LOCK

__all__ = ["IMAGE_EXTENSIONS", "INT_EXTENSIONS", "decode_default", "npy_header", "npy_layout"]

INT_EXTENSIONS = frozenset({"cls", "cls2", "class", "count", "index", "inx", "id"})
TEXT_EXTENSIONS = frozenset({"txt", "text", "transcript"})
JSON_EXTENSIONS = frozenset({"json", "jsn"})
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "ppm", "pgm", "pbm", "bmp", "webp", "tif", "tiff"})


def last_extension(ext: str) -> str:
    """The part of a WebDataset field name that picks its decoder: ``"x.npy"`` -> ``"npy"``.

    Example::

        last_extension("seg.PNG") == "png"
    """
    return ext.rsplit(".", 1)[-1].lower()


def npy_header(data: bytes | memoryview | np.ndarray) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """(dtype, shape, fortran_order, data offset) of a ``.npy`` payload, from its first bytes only.

    Example::

        dtype, shape, fortran, start = npy_header(open("a.npy", "rb").read(256))
    """
    head = bytes(memoryview(data)[:16])
    if head[:6] != b"\x93NUMPY":
        raise ValueError("not a .npy payload (bad magic)")
    major = head[6]
    length = (
        int.from_bytes(head[8:10], "little") + 10 if major == 1 else int.from_bytes(head[8:12], "little") + 12
    )
    fp = io.BytesIO(bytes(memoryview(data)[:length]))
    version = np.lib.format.read_magic(fp)
    with NPY_HEADER_LOCK:  # literal_eval in worker threads (fastio.format.tar.npy)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
    return np.dtype(dtype), tuple(shape), bool(fortran), fp.tell()


def _short(raw: bytes) -> str:
    return repr(raw[:40]) + (f" ... ({len(raw)} bytes)" if len(raw) > 40 else "")


def npy_layout(
    head: bytes | memoryview | np.ndarray, size: int, path: str, member: str
) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """:func:`npy_header` of a ``.npy`` member of ``size`` bytes whose first bytes are ``head``, checked:
    a header that does not parse, or a payload that is not exactly ``prod(shape) * itemsize`` bytes, raises
    :class:`fastio.CorruptShardError` naming ``path`` and ``member``.

    Example::

        dtype, shape, fortran, start = npy_layout(data, len(data), "a.tar", "k0.x.npy")
    """
    try:
        dtype, shape, fortran, start = npy_header(head)
    except ValueError as exc:
        raise CorruptShardError(path, member, "a .npy header", str(exc)) from None
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size - start != expected:
        raise CorruptShardError(
            path,
            member,
            f"{expected} bytes of {dtype} {tuple(shape)} after the {start}-byte .npy header",
            f"{size - start} bytes",
        )
    return dtype, shape, fortran, start


def _npy(data: np.ndarray, path: str, member: str) -> torch.Tensor:
    dtype, shape, fortran, start = npy_layout(data, len(data), path, member)
    if dtype.hasobject:
        raise ValueError(".npy with object dtype is refused (it would need pickle)")
    arr = data[start:].view(dtype)
    arr = np.ascontiguousarray(arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape))
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(
            'decode="pil" needs Pillow, which is not installed: pip install "fastcomm[image]" '
            f"(or pip install Pillow); {exc}"
        ) from exc
    return Image


def decode_default(
    ext: str,
    data: bytes | memoryview | np.ndarray,
    images: str | None = None,
    path: str = "<bytes>",
    member: str | None = None,
) -> Any:
    """Decode one tar member by its extension.

    ``.npy`` -> tensor; ``cls``/``index``/... -> int; ``txt`` -> str; ``json`` -> object; images -> uint8
    ``[H, W, C]`` tensor when ``images="pil"`` (Pillow), else bytes; anything else (``pyd``/``pickle``
    included: never unpickled) -> bytes.

    A member whose bytes do not hold what its extension says (a ``.npy`` payload shorter or longer than its
    header's shape, an int that is not decimal digits, text or JSON that is not UTF-8) raises
    :class:`fastio.CorruptShardError` naming ``path`` and ``member`` (default: the extension).

    Example::

        decode_default("x.npy", open("x.npy", "rb").read()).shape
    """
    kind = last_extension(ext)
    if kind == "npy":
        arr = data if isinstance(data, np.ndarray) else np.frombuffer(bytes(data), np.uint8)
        return _npy(arr, path, member or ext)
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    try:
        if kind in INT_EXTENSIONS:
            return int(raw)
        if kind in TEXT_EXTENSIONS:
            return raw.decode("utf-8")
        if kind in JSON_EXTENSIONS:
            return json.loads(raw)
    except ValueError as exc:  # int(), UnicodeDecodeError and JSONDecodeError are all ValueErrors
        what = (
            "JSON" if kind in JSON_EXTENSIONS else "UTF-8 text" if kind in TEXT_EXTENSIONS else "an integer"
        )
        raise CorruptShardError(path, member or ext, what, f"{_short(raw)} ({type(exc).__name__})") from None
    if kind in IMAGE_EXTENSIONS and images == "pil":
        image = _pil()
        with image.open(io.BytesIO(raw)) as img:
            arr = np.asarray(img.convert("RGB") if img.mode not in ("L", "RGB", "RGBA") else img)
        return torch.from_numpy(np.array(arr, copy=True))
    return raw
