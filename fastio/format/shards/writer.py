"""``ShardWriter``: samples in, memory-mappable columnar shards plus an ``index.json`` out.

Example::

    with fastio.ShardWriter("data/train", max_samples=50_000) as w:
        for i in range(100_000):
            w.write({"x": np.full((3, 32, 32), i % 255, np.uint8), "y": i % 10, "text": b"..."})
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastio.errors import SchemaMismatchError
from fastio.format.shards.layout import ALIGN, INDEX_NAME, MAGIC, PREFIX, VERSION, align, shard_name
from fastio.format.shards.schema import Field, Schema, infer_schema, normalize_schema, schema_to_json

__all__ = ["ShardWriter"]


def _atomic_write_json(path: Path, payload: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def _check_fits(where: str, name: str, arr: np.ndarray, dtype: np.dtype) -> None:
    """Refuse values that a same-kind cast to ``dtype`` would change: integers outside its range (int64 50000
    into int16 would wrap to -15536), finite floats beyond its largest value (1e6 into float16 would become
    inf). Exact casts that fit (int64 5 into int16) pass; NaN and inf stay what they are."""
    if arr.dtype == dtype or arr.size == 0:
        return
    if dtype.kind in "iu" and arr.dtype.kind in "iub":
        info = np.iinfo(dtype)
        low, high = arr.min(), arr.max()
        if low < info.min or high > info.max:
            raise SchemaMismatchError(
                where,
                name,
                f"{dtype.name} values in [{info.min}, {info.max}]",
                f"{arr.dtype.name} in [{low}, {high}]",
            )
    elif dtype.kind in "fc" and arr.dtype.kind in "iufc":
        finite = np.isfinite(arr)
        with np.errstate(over="ignore", invalid="ignore"):
            overflow = finite & ~np.isfinite(arr.astype(dtype))
        if overflow.any():
            largest = np.finfo(dtype).max
            worst = np.abs(arr[overflow]).max()
            raise SchemaMismatchError(
                where,
                name,
                f"{dtype.name} values within +-{largest}",
                f"{arr.dtype.name} value of magnitude {worst} (would become inf)",
            )


class ShardWriter:
    """Writes samples (dicts of field -> value) into shards of at most ``max_samples`` / ``max_bytes``.

    1. The schema is ``schema`` (see :func:`fastio.format.shards.schema.normalize_schema`), or inferred
       from the first sample: arrays and numbers become fixed-shape fields, ``bytes``/``str``
       variable-length ones. For variable-length arrays pass ``schema={"tokens": ("int32", None)}``.
    2. Every sample is checked against the schema (a :class:`fastio.SchemaMismatchError` names the field):
       its dtype must cast to the field's within the same kind, and its values must fit the field's dtype
       (an int64 50000 does not fit int16, a float64 1e6 does not fit float16; an int64 5 fits int16).
    3. A full shard is written to a temp file in the same directory, then renamed into place, so a crash
       leaves no half-written ``shard-*.fio``. ``close()`` writes ``index.json`` the same way; a set without
       an index is not readable, so a writer that fails midway leaves nothing a reader would trust.

    Args:
        directory: where the shards and ``index.json`` go (created if missing).
        schema: field specs, or None to infer from the first sample.
        max_samples: samples per shard.
        max_bytes: approximate payload bytes per shard (a shard closes once it reaches this).
        prefix: shard file name prefix.
        overwrite: allow writing into a directory that already has an ``index.json``.

    Example::

        w = fastio.ShardWriter("data/val", schema={"x": ("float32", (8,)), "y": ("int64", ())})
        w.write({"x": np.ones(8, np.float32), "y": 1})
        w.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        schema: Mapping[str, Any] | None = None,
        max_samples: int = 100_000,
        max_bytes: int = 1 << 30,
        prefix: str = "shard",
        overwrite: bool = False,
    ) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if (self.directory / INDEX_NAME).exists() and not overwrite:
            raise FileExistsError(
                f"{self.directory / INDEX_NAME} exists; pass overwrite=True to replace the set"
            )
        self.schema: Schema | None = normalize_schema(schema) if schema is not None else None
        self.max_samples, self.max_bytes, self.prefix = int(max_samples), int(max_bytes), prefix
        self._columns: dict[str, list[Any]] = {}
        self._pending_samples = 0
        self._pending_bytes = 0
        self._shards: list[dict[str, Any]] = []
        self._closed = False

    # -- writing samples -------------------------------------------------------------------------------
    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample; flushes a shard when it is full.

        Example::

            w.write({"x": np.zeros(4, np.float32) + 1, "y": 7})
        """
        self._check_open(sample)
        assert self.schema is not None
        for name, field in self.schema.items():
            stored = self._coerce(name, field, sample[name])
            if field.kind == "fixed":
                stored = stored[None]
            self._columns[name].append(stored)
            self._pending_bytes += len(stored) if isinstance(stored, bytes) else stored.nbytes
        self._pending_samples += 1
        if self._pending_samples >= self.max_samples or self._pending_bytes >= self.max_bytes:
            self._flush()

    def write_many(self, columns: Mapping[str, Any]) -> None:
        """Append ``n`` samples given column-wise: ``[n, *shape]`` arrays for fixed fields, length-``n``
        sequences for variable ones. Same result as ``n`` calls of :meth:`write`, without a Python step per
        sample for fixed fields.

        Example::

            w.write_many({"x": np.ones((1000, 3, 32, 32), np.uint8), "y": np.arange(1000)})
        """
        if self.schema is None:
            self.schema = infer_schema({k: v[0] for k, v in columns.items()})
        self._check_open(columns)
        lengths = {name: len(value) for name, value in columns.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"write_many: columns differ in length: {lengths}")
        total, done = next(iter(lengths.values())), 0
        while done < total:
            take = min(total - done, self.max_samples - self._pending_samples)
            for name, field in self.schema.items():
                part = columns[name][done : done + take]
                if field.kind == "fixed":
                    stored = self._coerce(name, field, part, leading=True)
                    self._columns[name].append(stored)
                    self._pending_bytes += stored.nbytes
                else:
                    for value in part:
                        stored = self._coerce(name, field, value)
                        self._columns[name].append(stored)
                        self._pending_bytes += len(stored) if isinstance(stored, bytes) else stored.nbytes
            self._pending_samples += take
            done += take
            if self._pending_samples >= self.max_samples or self._pending_bytes >= self.max_bytes:
                self._flush()

    def _check_open(self, sample: Mapping[str, Any]) -> None:
        if self._closed:
            raise ValueError("ShardWriter is closed")
        if self.schema is None:
            self.schema = infer_schema(sample)
        if set(sample) != set(self.schema):
            missing, extra = sorted(set(self.schema) - set(sample)), sorted(set(sample) - set(self.schema))
            raise SchemaMismatchError(
                str(self.directory),
                ", ".join(missing + extra) or "?",
                f"fields {sorted(self.schema)}",
                f"fields {sorted(sample)}",
            )
        if not self._columns:
            self._columns = {name: [] for name in self.schema}

    def _coerce(self, name: str, field: Field, value: Any, leading: bool = False) -> Any:
        if field.kind == "bytes":
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise SchemaMismatchError(str(self.directory), name, "bytes", type(value).__name__)
            return bytes(value)
        if field.kind == "str":
            if not isinstance(value, str):
                raise SchemaMismatchError(str(self.directory), name, "str", type(value).__name__)
            return value.encode("utf-8")
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        arr = np.asarray(value)
        dtype = field.np_dtype
        if arr.dtype != dtype and not np.can_cast(arr.dtype, dtype, casting="same_kind"):
            raise SchemaMismatchError(
                str(self.directory), name, field.describe(), f"{arr.dtype.name} {arr.shape}"
            )
        if field.kind == "fixed":
            if (arr.shape[1:] if leading else arr.shape) != field.shape or (leading and arr.ndim == 0):
                raise SchemaMismatchError(
                    str(self.directory), name, field.describe(), f"{arr.dtype.name} {arr.shape}"
                )
        elif arr.ndim < 1 or arr.shape[1:] != field.shape:
            raise SchemaMismatchError(
                str(self.directory), name, field.describe(), f"{arr.dtype.name} {arr.shape}"
            )
        _check_fits(str(self.directory), name, arr, dtype)
        return np.ascontiguousarray(arr, dtype=dtype)

    # -- writing shards --------------------------------------------------------------------------------
    def _flush(self) -> None:
        if not self._pending_samples:
            return
        assert self.schema is not None
        number = len(self._shards)
        name = shard_name(self.prefix, number)
        final = self.directory / name
        tmp = self.directory / f".{name}.tmp-{os.getpid()}"
        sections: dict[str, dict[str, list[int]]] = {}
        try:
            with open(tmp, "wb") as fh:
                fh.write(b"\0" * ALIGN)
                for fname, field in self.schema.items():
                    values = self._columns[fname]
                    if field.kind == "fixed":
                        sections[fname] = {"data": self._write_section(fh, values)}
                    else:
                        lengths = np.array(
                            [len(v) if isinstance(v, bytes) else v.nbytes for v in values], np.int64
                        )
                        offsets = np.zeros(len(values) + 1, dtype=np.int64)
                        np.cumsum(lengths, out=offsets[1:])
                        sections[fname] = {"offsets": self._write_section(fh, [offsets])}
                        sections[fname]["data"] = self._write_section(fh, values)
                header = json.dumps(
                    {
                        "num_samples": self._pending_samples,
                        "schema": schema_to_json(self.schema),
                        "sections": sections,
                    }
                ).encode("utf-8")
                fh.write(header)
                file_nbytes = fh.tell()
                fh.seek(0)
                fh.write(PREFIX.pack(MAGIC, VERSION, len(header), zlib.crc32(header), 0, file_nbytes))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._shards.append({"file": name, "num_samples": self._pending_samples, "file_nbytes": file_nbytes})
        self._columns = {n: [] for n in self.schema}
        self._pending_samples = 0
        self._pending_bytes = 0

    @staticmethod
    def _write_section(fh: Any, chunks: list[Any]) -> list[int]:
        start = fh.tell()
        padded = align(start)
        if padded != start:
            fh.write(b"\0" * (padded - start))
        nbytes, crc = 0, 0
        for chunk in chunks:
            view = memoryview(chunk if isinstance(chunk, bytes) else np.ascontiguousarray(chunk)).cast("B")
            fh.write(view)
            nbytes += len(view)
            crc = zlib.crc32(view, crc)
        return [padded, nbytes, crc]

    def close(self) -> None:
        """Flush the last shard and write ``index.json``. Idempotent.

        Example::

            w.close()
        """
        if self._closed:
            return
        self._flush()
        self._closed = True
        if self.schema is None:
            raise ValueError(f"{self.directory}: ShardWriter closed without any sample; no index written")
        _atomic_write_json(
            self.directory / INDEX_NAME,
            {
                "format": "fastio-shards",
                "version": VERSION,
                "num_samples": sum(s["num_samples"] for s in self._shards),
                "schema": schema_to_json(self.schema),
                "shards": self._shards,
            },
        )

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True  # the set is incomplete: leave no index behind
