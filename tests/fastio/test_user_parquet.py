"""Parquet read in place as a user meets it (fastio.format.parquet): the cases a hunt for silent wrong data,
hangs and unhelpful errors found, each failing before its fix."""

from __future__ import annotations

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
