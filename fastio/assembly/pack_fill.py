"""How packed batches are filled (:mod:`fastio.assembly.pack`, steps 5 and 6): :class:`PackProducer` makes
batch ``j`` of a pass. Small batches are filled a group at a time, so that the per-batch cost is a few tensor
slices and not a gather, a buffer hand-out and the bookkeeping around them:

1. Rows are planned a chunk at a time (:func:`fastio.assembly.pack_rows.plan_rows` over ~4096 rows, the last
   few chunks kept).
2. Consecutive batches form a group of about :attr:`PackProducer.GROUP_BYTES` (4 MiB) of output (one
   batch when a batch is that large already); a group never crosses a chunk. The first job of a group to
   run fills the whole group with one native gather into one set of reused buffers (eos slots,
   ``document_ids`` and ``positions`` after it, all vectorized); the jobs of its other batches, on any
   worker thread, wait for that fill and take their rows as views of it.
3. A group's buffers are refilled only when no batch of it is held any more
   (:meth:`fastio.sources.BatchBuffers.held` counts the views), as for one batch: a batch kept by the
   consumer keeps its whole group's memory (a fresh set is then used), not its rows only.

Batches are the same rows, in the same order, whatever the group size, ``num_workers`` or resume row: groups
are counted from the pass's first row.

Example::

    producer = PackProducer(pack, docs, plan, specs, start_row=0, batch_size=8, threads=1, pin=False, keep=4)
    batch, rows = producer(0)
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from fastio.assembly.pack_options import Pack
from fastio.assembly.pack_rows import EpochPlan, RowRuns, plan_rows
from fastio.files.gather import gather_ranges
from fastio.sources import BufferPool, StageTimes, TokenDocuments

__all__ = ["PackProducer"]

Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


class _Group:
    """One group of batches: filled once (``ready`` set after), then handed out batch by batch."""

    def __init__(self, batches: int) -> None:
        self.ready = threading.Event()
        self.out: dict[str, torch.Tensor] = {}
        self.rows = 0
        self.error: BaseException | None = None
        self.left = batches  # batches of it not handed out yet


class PackProducer:
    """Fills batch ``job`` of a pass (rows ``start_row + job * batch_size`` on) from views of its group (see
    the module docstring) in buffers of ``specs`` (with the stored-dtype staging buffer :attr:`RAW` when the
    tokens are converted); holds no reference to the iterator. Thread-safe: worker threads call it for
    different jobs at once.

    Example::

        producer = PackProducer(pack, docs, plan, specs, start_row=0, batch_size=8, threads=1, pin=False,
                                keep=4)
        batch, rows = producer(0)
    """

    RAW = "__stored_tokens__"
    CHUNK_ROWS = 4096  # rows planned at once
    KEEP_CHUNKS = 4  # planned chunks kept (workers ahead and behind)
    GROUP_BYTES = 1 << 22  # output bytes filled at once: one gather for many small batches

    def __init__(
        self,
        pack: Pack,
        docs: TokenDocuments,
        plan: EpochPlan,
        specs: Specs,
        *,
        start_row: int,
        batch_size: int,
        threads: int,
        pin: bool,
        keep: int,
    ) -> None:
        self.pack, self.docs, self.plan, self.start_row = pack, docs, plan, start_row
        self.batch_size, self.threads = batch_size, threads
        self.convert = self.RAW in specs
        width = pack.row_len
        row_bytes = sum(dtype.itemsize * int(np.prod(shape)) for dtype, shape in specs.values())
        batch_bytes = batch_size * row_bytes
        chunk_batches = max(1, self.CHUNK_ROWS // batch_size)
        self.group_batches = max(1, min(self.GROUP_BYTES // batch_bytes, chunk_batches))
        self.chunk_batches = max(1, chunk_batches // self.group_batches) * self.group_batches
        group_rows = self.group_batches * batch_size
        self.pool = BufferPool(specs, group_rows, pin, keep)
        self.times = StageTimes()
        self.arange = np.arange(group_rows * width, dtype=np.int64) if pack.positions else None
        self._chunks: dict[int, RowRuns] = {}
        self._chunk_lock = threading.Lock()
        self._groups: dict[int, _Group] = {}
        self._group_lock = threading.Lock()

    def __call__(self, job: int) -> tuple[dict[str, torch.Tensor], int]:
        index, at = divmod(job, self.group_batches)
        group = self._group(index)
        first = at * self.batch_size
        rows = min(self.batch_size, group.rows - first)
        return {name: tensor[first : first + rows] for name, tensor in group.out.items()}, rows

    def _group(self, index: int) -> _Group:
        """Group ``index``, filled: by this call when it is the first to ask, else by the one that was."""
        with self._group_lock:
            group = self._groups.get(index)
            fill = group is None
            if group is None:
                group = self._groups[index] = _Group(self.group_batches)
            group.left -= 1
            if group.left == 0:  # its last batch: the group is handed over whole after this one
                del self._groups[index]
        if fill:
            try:
                self._fill_group(index, group)
            except BaseException as error:  # every batch of the group raises it, on whichever thread
                group.error = error
            finally:
                group.ready.set()
        else:
            group.ready.wait()
        if group.error is not None:
            raise group.error
        return group

    def _fill_group(self, index: int, group: _Group) -> None:
        start = time.perf_counter()
        first = self.start_row + index * self.group_batches * self.batch_size
        rows = min(self.group_batches * self.batch_size, self.plan.rows - first)
        runs = self._chunk(index * self.group_batches // self.chunk_batches)
        buffers = self.pool.acquire()
        out = {name: buffers.fixed(name, rows) for name in self.pool.specs}
        self._fill(runs, first, rows, out)
        out.pop(self.RAW, None)
        self.pool.release(buffers)
        group.out, group.rows = out, rows
        self.times.add("read", time.perf_counter() - start, out["tokens"].numel() * self.docs.dtype.itemsize)

    def _chunk(self, index: int) -> RowRuns:
        with self._chunk_lock:
            runs = self._chunks.get(index)
            if runs is None:
                first = self.start_row + index * self.chunk_batches * self.batch_size
                rows = min(self.chunk_batches * self.batch_size, self.plan.rows - first)
                pack = self.pack
                runs = plan_rows(self.plan, self.docs, pack.seq_len, pack.row_len, pack.eos, first, rows)
                self.docs.verify(runs.shard)  # checksums, once per shard and process
                self._chunks[index] = runs
                for old in sorted(self._chunks)[: -self.KEEP_CHUNKS]:
                    del self._chunks[old]
            return runs

    def _fill(self, runs: RowRuns, first: int, rows: int, out: dict[str, torch.Tensor]) -> None:
        pack, width, size = self.pack, self.pack.row_len, self.docs.dtype.itemsize
        a, b = first - runs.first, first - runs.first + rows
        ra, rb = runs.row_runs[a], runs.row_runs[b]
        base = a * width  # token offset of these rows' first within the chunk
        tokens = out["tokens"]
        target = out[self.RAW] if self.convert else tokens
        dst = runs.dst[ra:rb] - base
        gather_ranges(
            self.docs.table, runs.shard[ra:rb], runs.src[ra:rb], runs.nbytes[ra:rb], target, self.threads,
            dst=dst * size,
        )  # fmt: skip
        if self.convert:
            tokens.copy_(target)
        if pack.eos is not None:
            tokens.view(-1).numpy()[runs.eos_at[runs.row_eos[a] : runs.row_eos[b]] - base] = pack.eos
        lengths = runs.length[ra:rb]
        if pack.document_ids:
            out["document_ids"].view(-1).numpy()[:] = np.repeat(runs.run_in_row[ra:rb], lengths)
        if self.arange is not None:
            out["positions"].view(-1).numpy()[:] = self.arange[: rows * width] - np.repeat(dst, lengths)
