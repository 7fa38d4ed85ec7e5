"""The schema of a shard set: field name -> :class:`Field` (a fixed-shape array, or a variable-length one).

Example::

    schema = normalize_schema({"x": ("uint8", (3, 32, 32)), "y": ("int64", ()), "tokens": ("int32", None),
                               "text": "bytes"})
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["Field", "Schema", "infer_schema", "normalize_schema", "schema_from_json", "schema_to_json"]

KINDS = ("fixed", "array", "bytes", "str")


@dataclasses.dataclass(frozen=True)
class Field:
    """One column of a shard.

    ``kind`` is ``"fixed"`` (every sample an array of ``dtype`` and exactly ``shape``, stored as one
    contiguous ``[N, *shape]`` array), ``"array"`` (a ``dtype`` array whose first dimension varies,
    trailing dims ``shape``; stored as int64 byte offsets plus a payload), ``"bytes"`` or ``"str"``
    (offsets plus payload).

    Example::

        Field.fixed("uint8", (3, 32, 32)); Field.array("int32"); Field.binary(); Field.text()
    """

    kind: str
    dtype: str = "|u1"
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Field kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "dtype", np.dtype(self.dtype).str)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d < 0 for d in self.shape):
            raise ValueError(f"Field shape must have non-negative dims, got {self.shape}")
        if np.dtype(self.dtype).hasobject:
            raise ValueError("Field dtype must be a plain numeric dtype, got object")

    @classmethod
    def fixed(cls, dtype: Any, shape: tuple[int, ...] = ()) -> Field:
        return cls("fixed", np.dtype(dtype).str, tuple(shape))

    @classmethod
    def array(cls, dtype: Any, trailing_shape: tuple[int, ...] = ()) -> Field:
        return cls("array", np.dtype(dtype).str, tuple(trailing_shape))

    @classmethod
    def binary(cls) -> Field:
        return cls("bytes")

    @classmethod
    def text(cls) -> Field:
        return cls("str")

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @functools.cached_property
    def row_nbytes(self) -> int:
        """Bytes of one sample of a fixed field (of one leading-dim step of an ``array`` field)."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.np_dtype.itemsize

    @property
    def is_variable(self) -> bool:
        return self.kind != "fixed"

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.np_dtype.name} {self.shape}"
        if self.kind == "array":
            return (
                f"{self.np_dtype.name} (*, {', '.join(map(str, self.shape))})"
                if self.shape
                else (f"{self.np_dtype.name} (*,)")
            )
        return self.kind


Schema = dict[str, Field]


def _field_from_spec(name: str, spec: Any) -> Field:
    if isinstance(spec, Field):
        return spec
    if spec in ("bytes", bytes):
        return Field.binary()
    if spec in ("str", str):
        return Field.text()
    if isinstance(spec, tuple) and len(spec) == 2:
        dtype, shape = spec
        return Field.array(dtype) if shape is None else Field.fixed(dtype, tuple(shape))
    raise ValueError(
        f"schema field {name!r}: expected a Field, (dtype, shape), (dtype, None) or 'bytes'/'str', "
        f"got {spec!r}"
    )


def normalize_schema(spec: Mapping[str, Any]) -> Schema:
    """A schema from its user forms: ``Field``, ``(dtype, shape)``, ``(dtype, None)``, ``"bytes"``, ``"str"``.

    Example::

        normalize_schema({"x": ("float32", (4,)), "text": "str"})["x"].kind == "fixed"
    """
    if not spec:
        raise ValueError("schema must name at least one field")
    return {str(name): _field_from_spec(str(name), s) for name, s in spec.items()}


def infer_field(name: str, value: Any) -> Field:
    """The field a first sample's value implies: arrays and scalars are fixed, bytes and str variable.

    Example::

        infer_field("y", 3) == Field.fixed("int64", ())
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Field.binary()
    if isinstance(value, str):
        return Field.text()
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, bool):
        return Field.fixed(np.bool_, ())
    if isinstance(value, int):
        return Field.fixed(np.int64, ())
    if isinstance(value, float):
        return Field.fixed(np.float64, ())
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
        if arr.dtype.hasobject or arr.dtype.kind in "USV":
            raise ValueError(f"field {name!r}: numpy dtype {arr.dtype} cannot be stored; use bytes or str")
        return Field.fixed(arr.dtype, arr.shape)
    raise ValueError(
        f"field {name!r}: cannot infer a field from {type(value).__name__}; pass schema= to ShardWriter"
    )


def infer_schema(sample: Mapping[str, Any]) -> Schema:
    """The schema implied by a first sample (fixed shapes for arrays, see :func:`infer_field`).

    Example::

        infer_schema({"x": np.zeros((2, 3), np.float32), "text": b"hi"})
    """
    if not sample:
        raise ValueError("cannot infer a schema from an empty sample")
    return {str(k): infer_field(str(k), v) for k, v in sample.items()}


def schema_to_json(schema: Schema) -> dict[str, Any]:
    """The JSON form stored in shard headers and ``index.json``.

    Example::

        schema_from_json(schema_to_json(s)) == s
    """
    return {name: {"kind": f.kind, "dtype": f.dtype, "shape": list(f.shape)} for name, f in schema.items()}


def schema_from_json(data: Mapping[str, Any]) -> Schema:
    """Inverse of :func:`schema_to_json`.

    Example::

        schema = schema_from_json(json.load(open("index.json"))["schema"])
    """
    return {name: Field(d["kind"], d["dtype"], tuple(d["shape"])) for name, d in data.items()}
