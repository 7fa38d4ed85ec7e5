"""The row plan of token packing (:mod:`fastio.assembly.pack`, steps 3 and 5): which ``(document, offset,
length)`` runs, copied where, make each fixed-length row of a rank's token stream, computed with numpy from
the documents' lengths alone.

Example::

    plan = EpochPlan(epoch=0, docs=order, starts=starts, rows=rows)
    runs = plan_rows(plan, docs, seq_len=1024, row_len=1025, eos=0, first=0, rows=8)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fastio.sources import TokenDocuments

__all__ = ["EpochPlan", "RowRuns", "plan_rows"]


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """This rank's token stream of one epoch."""

    epoch: int
    docs: np.ndarray  # int64: this rank's documents, in stream order
    starts: np.ndarray  # int64 [len(docs) + 1]: stream position of each document's first token
    rows: int  # rows every rank yields this epoch


@dataclasses.dataclass(frozen=True)
class RowRuns:
    """The runs of rows ``[first, first + rows)`` of a stream: run ``i`` copies ``nbytes[i]`` bytes from
    ``(shard[i], src[i])`` to token ``dst[i]`` (counted from the first row's start) and spans ``length[i]``
    tokens there (its eos included); ``row_runs[k]``/``row_eos[k]``: the first run/eos slot of row ``k``."""

    first: int
    shard: np.ndarray  # int32
    src: np.ndarray  # int64 bytes
    nbytes: np.ndarray  # int64
    dst: np.ndarray  # int64 tokens
    length: np.ndarray  # int64 tokens
    run_in_row: np.ndarray  # int32: the document's number within its row
    row_runs: np.ndarray  # int64 [rows + 1]
    eos_at: np.ndarray  # int64 tokens
    row_eos: np.ndarray  # int64 [rows + 1]


def plan_rows(
    plan: EpochPlan, docs: TokenDocuments, seq_len: int, row_len: int, eos: int | None, first: int, rows: int
) -> RowRuns:
    """Every run of rows ``[first, first + rows)`` (rows of ``row_len`` tokens starting every ``seq_len``
    tokens of the stream, ``eos`` after each document when not None): vectorized, no token read.

    Example::

        runs = plan_rows(plan, docs, seq_len=1024, row_len=1025, eos=0, first=0, rows=8)
    """
    width, cs = row_len, plan.starts
    row_start = (first + np.arange(rows, dtype=np.int64)) * seq_len
    first_doc = np.searchsorted(cs, row_start, "right") - 1
    runs_per_row = np.searchsorted(cs, row_start + width, "left") - first_doc
    run_row = np.repeat(np.arange(rows, dtype=np.int64), runs_per_row)
    first_run = np.cumsum(runs_per_row) - runs_per_row
    pos = first_doc[run_row] + (np.arange(len(run_row)) - first_run[run_row])
    begin = np.maximum(cs[pos], row_start[run_row])
    end = np.minimum(cs[pos + 1], row_start[run_row] + width)
    if (end <= begin).any():  # empty documents without eos inside a row take no place and no number
        keep = end > begin
        run_row, pos, begin, end = run_row[keep], pos[keep], begin[keep], end[keep]
    doc = plan.docs[pos]
    offset = begin - cs[pos]  # of the run within its document
    count = docs.tokens[doc]
    copied = np.minimum(end - cs[pos], count) - offset  # 0 for a run that is only the eos
    dst = run_row * width + (begin - row_start[run_row])
    size = docs.dtype.itemsize
    row_runs = np.searchsorted(run_row, np.arange(rows + 1), "left")
    run_in_row = (np.arange(len(run_row)) - row_runs[run_row]).astype(np.int32)
    if eos is not None:
        ends = end - cs[pos] == count + 1
        eos_at = dst[ends] + copied[ends]
    else:
        eos_at = np.zeros(0, dtype=np.int64)
    row_eos = np.searchsorted(eos_at, np.arange(rows + 1) * width, "left")
    return RowRuns(
        first, docs.shard[doc], docs.src[doc] + offset * size, copied * size, dst, end - begin, run_in_row,
        row_runs, eos_at, row_eos,
    )  # fmt: skip
