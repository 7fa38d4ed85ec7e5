"""How a Parquet set's selected columns come out of a batch (:class:`ParquetLayout`), decided once over every
file from their schemas and footers, and the named errors of a missing column or of a schema that differs
between files.

1. A column of integers, floats or booleans that no row group's statistics report a null in is a tensor
   ``[B]``; a fixed-size list of them (``pa.list_(pa.float32(), 8)``, nested too) a tensor ``[B, 8]``.
2. A list of integers or floats of any length (``input_ids``) is a list of 1-D tensors (``None`` for a null
   list); ``pack=`` packs it.
3. Everything else (strings, binary, structs, a numeric column with nulls) is a list of Python values, as
   ``pyarrow``'s ``to_pylist`` gives them (``str``, ``bytes``, ``dict``, ``None``).

Example::

    layout = decide_layout(schema, ["input_ids", "label"], null_free=lambda column: True)
    layout.fixed_specs()   # {"label": (torch.int64, ())}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fastio.errors import SchemaMismatchError
from fastio.sources.base import torch_dtype

__all__ = [
    "ParquetLayout",
    "check_same_schema",
    "decide_layout",
    "decode_columns",
    "leaf_columns",
    "null_free",
    "select_columns",
]


def _numeric(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def _fixed_shape(kind: pa.DataType) -> tuple[pa.DataType, tuple[int, ...]] | None:
    """The value type and per-row shape of a numeric type or a (nested) fixed-size list of one."""
    shape: list[int] = []
    while pa.types.is_fixed_size_list(kind):
        shape.append(kind.list_size)
        kind = kind.value_type
    return (kind, tuple(shape)) if _numeric(kind) else None


def _is_array(kind: pa.DataType) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and (
        pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)
    )


@dataclasses.dataclass(frozen=True)
class ParquetLayout:
    """The selected columns of a set and how each comes out (see the module docstring).

    Attributes:
        columns: the selected top-level columns, in the order given (default: the first file's).
        types: each column's Arrow type (the same in every file).
        fixed: tensor columns -> ``(numpy dtype, per-row shape)``.
        arrays: columns of variable-length numeric lists (a list of 1-D tensors per batch).
        objects: the other columns (a list of Python values per batch).

    Example::

        layout.fixed   # {"label": (dtype('int64'), ())}
    """

    columns: tuple[str, ...]
    types: tuple[pa.DataType, ...]
    fixed: dict[str, tuple[np.dtype, tuple[int, ...]]]
    arrays: tuple[str, ...]
    objects: tuple[str, ...]

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The batch buffers a source of this layout fills.

        Example::

            layout.fixed_specs()   # {"label": (torch.int64, ()), "embedding": (torch.float32, (8,))}
        """
        return {name: (torch_dtype(dtype), shape) for name, (dtype, shape) in self.fixed.items()}

    def type_of(self, column: str) -> pa.DataType:
        """The Arrow type of a selected column."""
        return self.types[self.columns.index(column)]


def select_columns(name: str, schema: pa.Schema, columns: Sequence[str] | None) -> list[str]:
    """The columns to read: ``columns`` (each checked against the file's schema), or every column of it.

    Example::

        select_columns("a.parquet", schema, ["text"])   # ["text"]
    """
    present = list(schema.names)
    if columns is None:
        return present
    if isinstance(columns, str):
        raise TypeError(
            f"columns must be a list of column names, got the string {columns!r}; use [{columns!r}]"
        )
    for column in columns:
        if column not in present:
            raise SchemaMismatchError(
                name, column, "a column of the file", f"no such column (it has {present})"
            )
    if len(set(columns)) != len(columns):
        raise ValueError(f"columns names a column twice: {list(columns)}")
    return list(columns)


def check_same_schema(
    first: str, first_schema: pa.Schema, name: str, schema: pa.Schema, columns: Sequence[str]
) -> None:
    """Raise :class:`fastio.SchemaMismatchError` naming ``name`` and the column where ``schema`` differs from
    the first file's on a selected column (missing, or another type).

    Example::

        check_same_schema("a.parquet", schema_a, "b.parquet", schema_b, ["text", "label"])
    """
    for column in columns:
        expected = first_schema.field(column).type
        if column not in schema.names:
            raise SchemaMismatchError(
                name, column, f"{expected} (as in {first})", f"no such column (it has {list(schema.names)})"
            )
        found = schema.field(column).type
        if found != expected:
            raise SchemaMismatchError(name, column, f"{expected} (as in {first})", str(found))


def leaf_columns(meta: pq.FileMetaData, columns: Sequence[str]) -> list[int]:
    """The leaf column indices (column chunks) of the top-level ``columns`` in a file.

    Example::

        leaf_columns(meta, ["input_ids"])   # [1]: "input_ids.list.element"
    """
    schema = meta.schema

    def of(path: str) -> bool:  # a leaf's dotted path: the column itself, or a field inside it
        return any(path == c or path.startswith(f"{c}.") for c in columns)

    return [i for i in range(len(schema)) if of(schema.column(i).path)]


def null_free(meta: pq.FileMetaData, leaves: Sequence[int]) -> bool:
    """True when every row group's statistics of these leaf columns report no null (False when one lacks the
    count: a null may be there). A row group of no rows holds no null, whatever its statistics say (pyarrow
    writes none for an empty file's one row group).

    Example::

        null_free(meta, leaf_columns(meta, ["label"]))
    """
    for g in range(meta.num_row_groups):
        if meta.row_group(g).num_rows == 0:
            continue
        for c in leaves:
            stats = meta.row_group(g).column(c).statistics
            if stats is None or not stats.has_null_count or stats.null_count:
                return False
    return True


def decide_layout(
    schema: pa.Schema, columns: Sequence[str], null_free: Callable[[str], bool]
) -> ParquetLayout:
    """How each of ``columns`` comes out (see the module docstring); ``null_free(column)``: no file's
    statistics report a null in it.

    Example::

        layout = decide_layout(schema, ["text", "label"], null_free=lambda column: True)
    """
    fixed: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    arrays, objects = [], []
    for column in columns:
        kind = schema.field(column).type
        shape = _fixed_shape(kind)
        if shape is not None and null_free(column):
            fixed[column] = (np.dtype(shape[0].to_pandas_dtype()), shape[1])
        elif _is_array(kind):
            arrays.append(column)
        else:
            objects.append(column)
    types = tuple(schema.field(c).type for c in columns)
    return ParquetLayout(tuple(columns), types, fixed, tuple(arrays), tuple(objects))


def _one_chunk(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(column, pa.ChunkedArray):
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column


def decode_columns(table: pa.Table, layout: ParquetLayout, name: str, row_group: int) -> dict[str, Any]:
    """A decoded row group's columns in the form batches are cut from: fixed columns as numpy ``[N, *shape]``,
    array columns as ``(offsets int64 [N + 1], values, valid bool [N])``, the others as one Arrow array.

    Example::

        table = parquet_file.read_row_group(0, columns=list(layout.columns))
        columns = decode_columns(table, layout, path, 0)
    """
    out: dict[str, Any] = {}
    for column in layout.columns:
        values = _one_chunk(table.column(column))
        where = f"{column} (row group {row_group})"
        if column in layout.fixed:
            dtype, shape = layout.fixed[column]
            if values.null_count:
                raise SchemaMismatchError(
                    name, where, "no nulls (no footer statistic reported one)", f"{values.null_count} nulls"
                )
            for _ in shape:
                values = values.flatten()
            flat = values.to_numpy(zero_copy_only=False)
            out[column] = flat.astype(dtype, copy=False).reshape(len(table), *shape)
        elif column in layout.arrays:
            inner = values.flatten()
            if inner.null_count:
                raise SchemaMismatchError(
                    name, where, "lists of numbers without nulls", f"{inner.null_count} null elements"
                )
            offsets = values.offsets.to_numpy().astype(np.int64)
            valid = (
                np.ones(len(values), dtype=bool)
                if not values.null_count
                else values.is_valid().to_numpy(zero_copy_only=False)
            )
            flat = inner.to_numpy(zero_copy_only=False)
            # Rows come out as tensors viewing this array: a writable copy (Arrow's memory is read-only).
            flat = flat if flat.flags.writeable else flat.copy()
            out[column] = (offsets - offsets[0], flat, valid)
        else:
            out[column] = values
    return out
