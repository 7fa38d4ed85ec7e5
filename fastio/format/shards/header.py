"""A fastio shard's prefix and header, read and checked (:func:`read_header`) through any way of reading its
bytes: a mapped local file (:class:`fastio.format.shards.reader.ShardReader`) or byte ranges of a remote
object (:mod:`fastio.format.shards.parts`, which needs the header to know where a part's samples lie).

Checks (see :mod:`fastio.format.shards.layout` for the layout): the magic, the version, the file size the
prefix claims against the real one, the header's crc32, its JSON, every section inside the data area, each
fixed section ``num_samples`` rows long and each offsets array ``num_samples + 1`` entries long;
:func:`check_offsets` checks an offsets array once read. Each error names the file, the field and expected
vs actual.

Example::

    head = read_header(path, size, lambda start, stop: data[start:stop])
    print(head.num_samples, head.sections["x"]["data"])
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from fastio.errors import CorruptShardError
from fastio.format.shards.layout import MAGIC, PREFIX, VERSION
from fastio.format.shards.schema import Schema, schema_from_json

__all__ = ["ShardHeader", "check_offsets", "get_field", "parse_json", "parse_schema", "read_header"]


@dataclasses.dataclass(frozen=True)
class ShardHeader:
    """A shard's header, checked: its samples, schema and ``sections`` (``{field: {"data": [offset,
    nbytes, crc32], "offsets": [...]}}``, offsets from the file's start), and the file's size."""

    num_samples: int
    schema: Schema
    sections: dict[str, dict[str, list[int]]]
    file_nbytes: int


def read_header(path: str, size: int, read: Callable[[int, int], bytes]) -> ShardHeader:
    """The checked header of the ``size``-byte shard ``path``, whose bytes ``[start, stop)`` ``read(start,
    stop)`` returns (see the module docstring for the checks; each raises :class:`fastio.CorruptShardError`).

    Example::

        head = read_header("shard-000000.fio", n, lambda a, b: raw[a:b].tobytes())
    """
    if size < PREFIX.size:
        raise CorruptShardError(path, "prefix", f">= {PREFIX.size} bytes", f"{size} bytes")
    magic, version, header_nbytes, header_crc, _, file_nbytes = PREFIX.unpack(read(0, PREFIX.size))
    if magic != MAGIC:
        raise CorruptShardError(path, "magic", MAGIC, magic, "not a fastio shard")
    if version != VERSION:
        raise CorruptShardError(path, "version", VERSION, version, "written by another fastio version")
    if file_nbytes != size:
        raise CorruptShardError(
            path, "file size", f"{file_nbytes} bytes", f"{size} bytes", "truncated or appended to"
        )
    header_bytes = read(max(0, file_nbytes - header_nbytes), file_nbytes)
    if zlib.crc32(header_bytes) != header_crc:
        raise CorruptShardError(
            path, "header", f"crc32 {header_crc:#010x}", f"crc32 {zlib.crc32(header_bytes):#010x}"
        )
    header = parse_json(path, "header", header_bytes)
    num_samples = get_field(path, header, "num_samples", int)
    schema = parse_schema(path, get_field(path, header, "schema", dict))
    sections = _sections(path, get_field(path, header, "sections", dict), schema)
    if num_samples < 0:
        raise CorruptShardError(path, "num_samples", ">= 0", num_samples)
    data_end = file_nbytes - header_nbytes
    for name, field in schema.items():
        for part, (start, nbytes, _) in sections[name].items():
            if start < 0 or nbytes < 0 or start + nbytes > data_end:
                raise CorruptShardError(
                    path, f"{name}.{part}", f"bytes [{start}, {start + nbytes}) inside the data area",
                    f"data area ends at {data_end}",
                )  # fmt: skip
        if field.kind == "fixed" and sections[name]["data"][1] != num_samples * field.row_nbytes:
            expected = num_samples * field.row_nbytes
            raise CorruptShardError(path, name, f"{expected} bytes", f"{sections[name]['data'][1]} bytes")
        if field.kind != "fixed" and sections[name]["offsets"][1] != 8 * (num_samples + 1):
            found, expected = sections[name]["offsets"][1], 8 * (num_samples + 1)
            raise CorruptShardError(path, f"{name}.offsets", f"{expected} bytes", f"{found} bytes")
    return ShardHeader(num_samples, schema, sections, file_nbytes)


def check_offsets(path: str, name: str, offsets: np.ndarray, nbytes: int) -> None:
    """Raise :class:`fastio.CorruptShardError` unless variable field ``name``'s ``offsets`` run monotone from
    0 to its payload's ``nbytes``.

    Example::

        check_offsets("shard-000000.fio", "text", np.array([0, 3, 7]), 7)
    """
    if offsets[0] != 0 or offsets[-1] != nbytes or (np.diff(offsets) < 0).any():
        raise CorruptShardError(
            path, f"{name}.offsets", f"monotone from 0 to {nbytes}", f"from {offsets[0]} to {offsets[-1]}"
        )


def parse_json(path: str, field: str, raw: bytes) -> Any:
    """``raw`` as JSON, or :class:`fastio.CorruptShardError` naming ``field`` of ``path``.

    Example::

        index = parse_json("train/index.json", "index", raw)
    """
    try:
        return json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
        raise CorruptShardError(path, field, "UTF-8 JSON", f"{type(exc).__name__}: {exc}") from None


def get_field(path: str, mapping: dict[str, Any], key: str, kind: type) -> Any:
    """``mapping[key]``, which must exist and be a ``kind`` (a bool is no int here).

    Example::

        n = get_field("train/index.json", entry, "num_samples", int)
    """
    if key not in mapping:
        raise CorruptShardError(path, key, f"a {kind.__name__}", "no such key")
    value = mapping[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptShardError(path, key, f"a {kind.__name__}", f"{type(value).__name__} {value!r:.60}")
    return value


def parse_schema(path: str, data: dict[str, Any]) -> Schema:
    """A schema from its JSON, or :class:`fastio.CorruptShardError` naming ``path``.

    Example::

        schema = parse_schema("train/index.json", index["schema"])
    """
    try:
        return schema_from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptShardError(path, "schema", "{field: {kind, dtype, shape}}", f"{exc!r:.200}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sections(path: str, data: dict[str, Any], schema: Schema) -> dict[str, dict[str, list[int]]]:
    for name, field in schema.items():
        parts = ("data",) if field.kind == "fixed" else ("data", "offsets")
        sec = data.get(name)
        ok = isinstance(sec, dict) and all(
            isinstance(sec.get(p), list) and len(sec[p]) == 3 and all(map(_is_int, sec[p])) for p in parts
        )
        if not ok:
            expected = "{" + ", ".join(f"{p!r}: [offset, nbytes, crc32]" for p in parts) + "}"
            raise CorruptShardError(path, f"sections.{name}", expected, f"{sec!r:.120}")
    return data
