"""Parquet read in place as a user meets it (fastio.format.parquet): the cases a hunt for silent wrong data,
hangs and unhelpful errors found, each failing before its fix."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow", reason="the parquet extra (pyarrow) is not installed")
pq = pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")

import fastio  # noqa: E402


def _write(folder: Path, sizes: list[int]) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("y", pa.int64()), ("x", pa.float32()), ("s", pa.string())])
    first = 0
    for f, n in enumerate(sizes):
        ys = np.arange(first, first + n, dtype=np.int64)
        table = pa.table({"y": ys, "x": ys.astype(np.float32) / 2, "s": [f"r{i}" for i in ys]}, schema=schema)
        pq.write_table(table, folder / f"part-{f}.parquet", row_group_size=4)
        first += n
    return first


def test_an_empty_file_leaves_numeric_columns_tensors(tmp_path: Path) -> None:
    # A file of 0 rows (one row group, no statistics) made every numeric column of the set a list of ints.
    total = _write(tmp_path / "d", [9, 0, 6])
    batches = list(fastio.StreamLoader(tmp_path / "d", batch_size=5))
    assert all(isinstance(b["y"], torch.Tensor) and isinstance(b["x"], torch.Tensor) for b in batches)
    assert torch.cat([b["y"] for b in batches]).tolist() == list(range(total))
    assert torch.cat([b["x"] for b in batches]).tolist() == [i / 2 for i in range(total)]


def test_a_file_rewritten_at_the_same_size_is_refused(tmp_path: Path) -> None:
    # A file rewritten between epochs at the same size was read through the old footer's offsets (here: the
    # new rows, silently; with another layout, whatever bytes lay there).
    from fastio.errors import CorruptShardError
    from fastio.format.parquet.opening import parquet_source

    _write(tmp_path / "d", [8, 8])
    path = tmp_path / "d" / "part-1.parquet"
    size, mtime = path.stat().st_size, path.stat().st_mtime_ns
    loader = fastio.StreamLoader(parquet_source(str(tmp_path / "d"), memory_limit=1), batch_size=4)
    assert torch.cat([b["y"] for b in loader]).tolist() == list(range(16))
    table = pq.read_table(path)
    pq.write_table(
        table.set_column(0, "y", pa.array(np.arange(108, 116, dtype=np.int64))), path, row_group_size=4
    )
    assert path.stat().st_size == size
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
    with pytest.raises(CorruptShardError, match="part-1.parquet.*rewritten"):
        list(loader)
