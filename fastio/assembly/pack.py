"""Token packing: variable-length token documents concatenated and cut into fixed ``[B, L]`` rows.

``StreamLoader(directory, batch_size=B, pack=Pack("tokens", seq_len=S, eos=..., shift=...))`` yields dicts
of ``"tokens"`` ``[b, L]`` (``L = S``, or ``S + 1`` with ``shift=True``), plus ``"document_ids"`` and
optionally ``"positions"`` (int32 ``[b, L]``) for attention masks. How a batch is made:

1. The documents of the field (one sample = one document: a variable-length integer array field of a
   fastio shard set, or a ``.npy`` member such as ``"tokens.npy"`` of WebDataset tar shards) are taken in
   the epoch's order (:func:`fastio.pipeline.order.epoch_order`: ``shuffle``, ``seed``, ``epoch``), each
   followed by ``eos`` when given. Their lengths come from the shards' offset tables (tar: each member's
   ``.npy`` header, parsed once when the loader is made); no token is read to plan.
2. Ranks: rank ``r`` of ``W`` takes documents ``r, r + W, r + 2W, ...`` of that order and concatenates them
   into its own token stream (disjoint streams, no padding, no document repeated).
3. Rows: row ``k`` of a stream is its tokens ``[k * S, k * S + L)``. With ``shift=True`` consecutive rows
   share one token (row ``k``'s last is row ``k + 1``'s first, as in Megatron's GPT dataset), so
   ``inputs = row[:, :-1]``, ``targets = row[:, 1:]`` and every token of the stream is a target once. A
   document cut by a row boundary continues at the start of the next row.
4. Equal counts: every rank computes every rank's stream length (cheap: sums of lengths) and all yield the
   minimum row count; the rows beyond it, and each stream's last partial row, are dropped. Batches are
   ``B`` consecutive rows; the last batch may have fewer rows, and ``drop_last=True`` drops it.
5. Rows are planned with numpy (``searchsorted`` of the rows' starts in the documents' cumulative
   stream positions gives every ``(document, offset, length)`` run of every row), then filled by one
   native :func:`fastio.files.gather.gather_ranges` call straight into the batch buffer, eos slots set
   after; small batches a group of about 4 MiB at a time, each batch a view of it
   (:mod:`fastio.assembly.pack_fill`).
   ``document_ids``: the document's number within its row, counting from 0 (a document continued from
   the previous row is 0 in the new row); ``positions``: the token's position within that document's
   piece of the row (0 at each document start and at each row start: the ``position_ids`` and
   ``cu_seqlens`` (``positions == 0``) of packed flash attention). An eos belongs to the document it ends.
6. ``num_workers`` threads fill batches ahead into reused buffers; a set of buffers is refilled only when
   nothing outside the loader still views it (:meth:`fastio.sources.BatchBuffers.held`), else fresh ones
   are used, so a kept batch is never overwritten. The output does not depend on ``num_workers``. As
   in DataLoader, ``worker_init_fn`` runs first in each thread (:func:`fastio.worker_info` set), once per
   thread: ``persistent_workers=True`` keeps them for every epoch. Rows come in order (``in_order=False``
   allows it); no worker processes (``multiprocessing_context=``): no Python runs per batch.
7. Resume: ``state_dict()`` records the epoch and the rows consumed (the carry: ``token_offset`` is where
   the rank's stream stands); after ``load_state_dict()`` the next ``iter()`` continues with exactly the
   rows that would have come, for any ``num_workers`` and any ``batch_size`` (rows, not batches, are
   counted). A changed seed, shuffle, dataset, field, ``seq_len``, ``shift``, ``eos`` or world size is
   refused with a ``ValueError`` naming it.

Example::

    loader = fastio.StreamLoader("data/tokens", batch_size=8, shuffle=True, seed=0,
                                 pack=fastio.Pack("tokens", seq_len=1024, eos=0, shift=True))
    for batch in loader:
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        same_doc = batch["document_ids"][:, :-1, None] == batch["document_ids"][:, None, :-1]
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastio._native import default_threads
from fastio.assembly.pack_fill import PackProducer
from fastio.assembly.pack_options import Pack
from fastio.assembly.pack_rows import EpochPlan
from fastio.errors import EmptySourceError
from fastio.pipeline.settings import AssemblySettings, OrderSettings, WorkerSettings
from fastio.sources import ReadPlan, TokenDocuments, shard_read_order, torch_dtype
from fastio.workers.batch_pass import BatchPass
from fastio.workers.info import PassInfo
from fastio.workers.kept import KeptWorkers
from fastio.workers.threads import ThreadPipeline

__all__ = ["Pack", "PackedEpoch", "TokenPacker"]

_STATE_FORMAT = "fastio.StreamLoader.pack"
_STATE_VERSION = 1


def _documents(source: Any, field_name: str) -> TokenDocuments:
    token_documents = getattr(source, "token_documents", None)
    if token_documents is None:
        raise TypeError(
            "pack= needs a fastio shard directory (ShardWriter with a variable-length token field) or tar "
            f"shards of .npy token members, got a {type(source).__name__} "
            f"({getattr(source, 'name', source)}), which has no token_documents(field)"
        )
    return token_documents(field_name)


def _out_dtype(pack: Pack, stored: np.dtype) -> torch.dtype:
    stored_torch = torch_dtype(stored)
    out = pack.dtype or stored_torch
    out_np = torch.empty(0, dtype=out).numpy().dtype
    if not np.can_cast(stored, out_np, "safe"):
        raise ValueError(
            f"Pack dtype={out} cannot hold every {stored.name} token of field {pack.field!r} "
            "(values would wrap)"
        )
    if pack.eos is not None:
        info = np.iinfo(out_np)
        if not info.min <= pack.eos <= info.max:
            raise ValueError(
                f"Pack eos={pack.eos} does not fit the output dtype {out} ({info.min}..{info.max})"
            )
    return out


class PackedEpoch(BatchPass):
    """One pass over (the rest of) an epoch's packed rows for this rank; what ``iter(loader)`` returns.

    Example::

        it = iter(loader); batch = next(it); print(it.stats()["tokens_per_s"])
    """

    def __init__(self, packer: TokenPacker, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start
        workers, assembly, source = packer.workers, packer.assembly, packer.source
        plan = packer.plan(epoch)
        self.begin_pass(packer.num_batches(epoch, start))
        # The documents are the source's samples; this pass reads them from the start row's first one on.
        first_doc = max(0, int(np.searchsorted(plan.starts, start * packer.pack.seq_len, "right")) - 1)
        docs = plan.docs[first_doc:]
        n, slots = workers.num_workers, workers.slots
        # A batch of rows reads about its share of the pass's documents; its workers are threads.
        docs_per_batch = max(1, -(-len(docs) // max(1, self.n_batches)))
        source.plan_reads(ReadPlan(docs_per_batch, slots, False, packer.order.world_size > 1))
        source.prepare(shard_read_order(source.shard_sizes, docs), epoch, docs)
        self.device = assembly.device
        # Slots in flight, plus the batch the consumer holds while asking for the next, plus one spare.
        keep = slots + 2 if assembly.reuse_buffers else 0
        convert = packer.out_dtype != torch_dtype(packer.documents.dtype)
        self.producer = PackProducer(
            packer.pack,
            packer.documents,
            plan,
            packer.output_specs(convert),
            start_row=start,
            batch_size=assembly.batch_size,
            threads=workers.threads or max(1, default_threads() // max(1, n)),
            pin=assembly.pin,
            keep=keep,
        )
        self.times = self.producer.times
        self.pipeline: ThreadPipeline | None = None
        self.kept = packer.kept if n else None
        info = PassInfo(n, packer.order.seed, epoch)
        if self.kept is not None:
            self.pipeline = self.kept.take((self.producer, info), self.n_batches, self.times)
        if n and self.pipeline is None:
            self.pipeline = ThreadPipeline(
                self.producer, self.n_batches, n, slots, dataclasses.replace(info, init_fn=workers.init_fn),
                workers.timeout, persistent=self.kept is not None, unit=self.producer.group_batches,
            )  # fmt: skip
            if self.kept is not None:
                self.kept.keep(self.pipeline)

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.yielded >= self.n_batches:  # the end: what the source writes for later loaders is whole
            self.producer.docs.settle()
        batch, rows = self.take()
        if self.device is not None:
            # A blocking copy: the reused host buffer may be refilled as soon as the consumer lets go of it.
            batch = {k: v.to(self.device) for k, v in batch.items()}
        self.count(rows)
        return batch

    @property
    def rows_consumed(self) -> int:
        """Rows of the epoch handed to the consumer so far, counted from the epoch's start."""
        return self.start + self.samples

    def stats(self) -> dict[str, Any]:
        """As :meth:`fastio.StreamLoader.stats` (``samples`` are rows) plus ``tokens``, ``tokens_per_s``."""
        stats = super().stats()
        stats["tokens"] = self.samples * self.producer.pack.row_len
        elapsed = stats["elapsed_s"]
        stats["tokens_per_s"] = stats["tokens"] / elapsed if elapsed > 0 else 0.0
        return stats


class TokenPacker:
    """The batches of a :class:`fastio.StreamLoader` with ``pack=`` (a
    :class:`fastio.pipeline.batches.Batches`): plans, iterates and resumes the packed rows.

    Args:
        source: the loader's source; it must offer ``token_documents(field)``
            (:class:`fastio.sources.TokenDocuments`), as shard directories and tar shards do.
        pack: what to pack and how.
        orders: ``orders(epoch) -> int64 [N]``, the loader's epoch order of the documents.
        order: the loader's order settings (seed and shuffle are kept in the state dict, so a resume with
            another order is refused; rank, world size, drop_last split the rows).
        workers, assembly: the loader's (workers are threads, kept across epochs when ``persistent``; no
            stages, transform or collate).
        identity: what else the state dict records about ``orders`` (a mixed loader's streams and weights),
            so a resume on another order is refused.

    Raises :class:`fastio.SchemaMismatchError` when the field is not a 1-D variable-length integer array,
    ``ValueError`` for a dtype or eos that does not fit or settings packing does not take,
    :class:`fastio.EmptySourceError` when a rank's stream of epoch 0 holds no batch.

    Example::

        packer = TokenPacker(source, Pack("tokens", seq_len=16), orders, order=OrderSettings(),
                             workers=WorkerSettings(), assembly=AssemblySettings(batch_size=4))
        print(packer.num_batches(epoch=0))
    """

    def __init__(
        self,
        source: Any,
        pack: Pack,
        orders: Callable[[int], np.ndarray],
        *,
        order: OrderSettings,
        workers: WorkerSettings,
        assembly: AssemblySettings,
        identity: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(pack, Pack):
            raise TypeError(f"pack= must be a fastio.Pack, got {type(pack).__name__}")
        self.source, self.pack, self.orders, self.order_identity = source, pack, orders, dict(identity or {})
        self.order, self.workers, self.assembly = order, workers, assembly
        self.batch_size = assembly.batch_size
        self.documents = _documents(source, pack.field)
        self.out_dtype = _out_dtype(pack, self.documents.dtype)
        self.num_tokens = int(self.documents.tokens.sum())
        self._plan: EpochPlan | None = None
        self._plan_lock = threading.Lock()
        self.num_batches(0)
        python = assembly.transform is not None or assembly.collate is not None
        if python or assembly.stages:
            raise ValueError(
                "pack= makes batches of packed rows itself: it takes no transform, collate or stages"
            )
        if workers.mode == "process":
            raise ValueError(
                "pack= makes its rows in worker threads (no Python runs per batch), not in worker processes: "
                "drop multiprocessing_context= and WorkerOptions(mode='process'); num_workers= gives threads"
            )
        self.kept = KeptWorkers() if workers.persistent else None

    def output_specs(self, with_raw: bool = False) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Output fields -> (dtype, per-row shape); ``with_raw`` adds the stored-dtype staging buffer.

        Example::

            packer.output_specs()["tokens"]   # (torch.int32, (1025,)) for int32 tokens, seq_len 1024, shift
        """
        width = self.pack.row_len
        specs = {"tokens": (self.out_dtype, (width,))}
        if with_raw:
            specs[PackProducer.RAW] = (torch_dtype(self.documents.dtype), (width,))
        if self.pack.document_ids:
            specs["document_ids"] = (torch.int32, (width,))
        if self.pack.positions:
            specs["positions"] = (torch.int32, (width,))
        return specs

    def plan(self, epoch: int) -> EpochPlan:
        """This rank's stream of ``epoch`` (cached for the latest epoch asked).

        Example::

            rows = packer.plan(epoch=2).rows   # rows every rank yields in epoch 2
        """
        with self._plan_lock:
            if self._plan is None or self._plan.epoch != epoch:
                self._plan = self._make_plan(epoch)
            return self._plan

    def _make_plan(self, epoch: int) -> EpochPlan:
        order = self.orders(epoch)
        units = self.documents.tokens + (self.pack.eos is not None)
        width, stride, world = self.pack.row_len, self.pack.seq_len, self.order.world_size
        totals = [int(units[order[r::world]].sum()) for r in range(world)]
        rows = min((t - width) // stride + 1 if t >= width else 0 for t in totals)
        docs = order[self.order.rank :: world]
        starts = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum(units[docs], out=starts[1:])
        drop_last = self.order.drop_last
        if (rows < self.batch_size) if drop_last else rows == 0:
            raise EmptySourceError(
                f"{self.source.name}: field {self.pack.field!r} holds {self.num_tokens} tokens in "
                f"{len(units)} documents; split across {world} rank(s) (smallest stream {min(totals)} "
                f"tokens) that is {rows} row(s) of {width} per rank in epoch {epoch}, fewer than one "
                f"batch of {self.batch_size}{' (drop_last=True)' if drop_last else ''}"
            )
        return EpochPlan(epoch, docs, starts, rows)

    def num_batches(self, epoch: int, start_row: int = 0) -> int:
        """Batches this rank (and every rank) yields in ``epoch`` from row ``start_row`` on.

        Example::

            assert packer.num_batches(0) == len(loader)
        """
        left = max(0, self.plan(epoch).rows - start_row)
        return left // self.batch_size if self.order.drop_last else -(-left // self.batch_size)

    def iterate(self, epoch: int, start: int) -> PackedEpoch:
        """A :class:`PackedEpoch` from row ``start`` of ``epoch``.

        Example::

            it = packer.iterate(0, 0)
        """
        return PackedEpoch(self, epoch, start)

    # -- resume --------------------------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {
            **self.order.identity(),
            **self.order_identity,
            "num_samples": len(self.documents.tokens),
            "num_tokens": self.num_tokens,
            "field": self.pack.field,
            "seq_len": self.pack.seq_len,
            "shift": self.pack.shift,
            "eos": self.pack.eos,
            "world_size": self.order.world_size,
        }

    def state_dict(self, epoch: int, start: int, yielded: int = 0) -> dict[str, Any]:
        """The state of a packing loader after ``yielded`` batches of a pass from row ``start`` of ``epoch``.

        Example::

            state = packer.state_dict(epoch=1, start=96)   # state["token_offset"] == 96 * seq_len
        """
        rows_consumed = start + yielded * self.batch_size
        if yielded:
            rows_consumed = min(rows_consumed, self.plan(epoch).rows)  # the last batch may be partial
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            **self._identity(),
            "epoch": int(epoch),
            "rows_consumed": int(rows_consumed),
            "token_offset": int(rows_consumed) * self.pack.seq_len,
            "batch_size": self.batch_size,
            "rank": self.order.rank,
        }

    def resume_point(self, state: dict[str, Any]) -> tuple[int, int]:
        """``(epoch, row)`` to continue from, after checking ``state`` describes this very stream.

        Example::

            epoch, row = packer.resume_point(torch.load("loader.pt"))
        """
        if state.get("format") != _STATE_FORMAT or state.get("version") != _STATE_VERSION:
            found = f"{state.get('format')!r} v{state.get('version')}"
            raise ValueError(f"not a {_STATE_FORMAT} v{_STATE_VERSION} state dict (found {found})")
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                raise ValueError(
                    f"state_dict {key}={state.get(key)!r} but this loader has {key}={mine!r}; "
                    "the packed token stream would differ"
                )
        return int(state["epoch"]), int(state["rows_consumed"])
