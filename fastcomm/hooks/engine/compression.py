""":class:`CompressionState` (the options and bucket store of the compressing hooks) and their common start.

Every compressing hook is ``run_compressed(state, bucket, StateClass, compress_bucket)``: the shared
steps (state resolution, iteration accounting, world size 1, dense fallback, the first iteration after a
restore) live here once, and ``compress_bucket(call)`` only compresses one bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives import DEFAULT_CHUNK_BYTES, SecondCollective, ring_bytes, then
from fastcomm.collectives.errors import collective_value
from fastcomm.collectives.gather import gather_row
from fastcomm.collectives.residual import check_residual_dtype
from fastcomm.hooks.engine.defaults import resolve_state
from fastcomm.hooks.engine.options import require_bool, require_int
from fastcomm.hooks.engine.reshard import describe, keep_if_same_world, merge_buckets, merge_counters
from fastcomm.hooks.engine.state import HookState
from fastcomm.hooks.engine.store import BucketEntry, BucketStore, ResumePart
from fastcomm.hooks.engine.util import BucketKey, world_of
from fastcomm.hooks.hierarchical.groups import check_node_size
from fastcomm.hooks.hierarchical.hierarchy import Hierarchy
from fastcomm.hooks.hierarchical.protocols import InnerParts
from fastcomm.hooks.hierarchical.shards import check_hierarchical_options, fold_shards

__all__ = ["BucketCall", "CompressionState", "gather_payloads", "run_compressed"]


class CompressionState(HookState):
    """Options and per-bucket state shared by the compressing hooks (top-k, quantized, sign, compressors).

    The bucket tensors (residuals, velocity) live in :attr:`store`, a
    :class:`~fastcomm.hooks.engine.store.BucketStore`; hooks reach them through its methods only.

    Args:
        error_feedback: keep what compression dropped, per bucket, and add it to the next gradient.
        residual_dtype: keep those residuals in this dtype between steps (``torch.bfloat16``: half the
            memory of fp32), widened to the gradient's dtype for each step; ``None``: the gradient's dtype
            (as computed, no copies). Needs ``error_feedback=True``; the same option as
            :func:`fastcomm.fsdp.compress`'s and :class:`fastcomm.DiLoCo`'s.
        start_iter: plain (dense) allreduce for the first ``start_iter`` steps.
        min_compress_numel: buckets with fewer elements go dense.
        wire_chunk_bytes: each collective is issued as back-to-back chunks of about this many bytes per
            peer (at most 64 chunks): gloo keeps a TCP link busy only with several transfers in flight (on
            a 1 Gbit/s link one 8 MB all-to-all moved 61 MB/s each way, 16 chunks 115 MB/s).
        node_size: ranks per node for hierarchical compression (:mod:`fastcomm.hooks.hierarchical.hierarchy`):
            dense inside each node, compressed only between nodes. ``None``: ``LOCAL_WORLD_SIZE`` when it
            divides the world size into at least two nodes, else flat; ``1``: flat.
        process_group: the group to reduce over; ``None`` for the default group.
        parts: for a hierarchy's inner state only
            (:class:`~fastcomm.hooks.hierarchical.protocols.InnerParts`).

    Example::

        state = fastcomm.register(ddp, "quantize", bits=4, start_iter=10, min_compress_numel=4096)
        owed = state.residual_of(next(ddp.module.parameters()))  # what error feedback still has to send
    """

    _OPTIONS = (
        "error_feedback",
        "residual_dtype",
        "start_iter",
        "min_compress_numel",
        "wire_chunk_bytes",
        "node_size",
    )
    # whether a bucket that goes dense also pays its phase-2 segment residual (a hook that switches a
    # bucket between a two-phase exchange and dense: "auto")
    dense_takes_segment = False

    def __init__(
        self,
        *,
        error_feedback: bool = True,
        residual_dtype: torch.dtype | None = None,
        start_iter: int = 0,
        min_compress_numel: int = 1024,
        wire_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        node_size: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        parts: InnerParts | None = None,
    ) -> None:
        self._parts = parts
        self.error_feedback = require_bool("error_feedback", error_feedback)
        self.residual_dtype = check_residual_dtype(residual_dtype, self.error_feedback)
        self.start_iter = require_int("start_iter", start_iter, minimum=0)
        self.min_compress_numel = require_int("min_compress_numel", min_compress_numel, minimum=0)
        self.wire_chunk_bytes = require_int("wire_chunk_bytes", wire_chunk_bytes, minimum=1)
        self.node_size = check_node_size(node_size)
        check_hierarchical_options(self, self.node_size)
        super().__init__(process_group)

    def _reset_internal(self) -> None:
        super()._reset_internal()
        parts = self._parts
        self.store = BucketStore(self.residual_dtype) if parts is None else parts.store
        if parts is not None:
            self.accounting = parts.accounting
        self.hierarchy = Hierarchy(self.residual_dtype)
        # a two-phase bucket whose phase 1 is in flight; its phase 2 is issued by the next hook call
        self._pending: SecondCollective | None = None

    def _end_iteration(self, finite: bool) -> None:
        self.store.end_iteration(finite)
        self.hierarchy.end_iteration(finite)

    def bind(self, module: torch.nn.Module) -> None:
        """Tie this state to ``module`` (:meth:`HookState.bind`) and make its node groups, if hierarchical.

        Raises:
            ValueError: the state already serves another model, or ``node_size`` does not fit the world.
        """
        super().bind(module)
        self.hierarchy.resolve(self)

    # ------------------------------------------------------------------------------- for the hooks
    def begin_bucket(self, bucket: dist.GradBucket) -> BucketKey:
        if bucket.index() == 0:
            # a last bucket DDP did not mark: its phase 2 must still go out before the new iteration
            self.flush_pending()
            self.store.begin_iteration()
        return super().begin_bucket(bucket)

    def note_layout(self, bucket: dist.GradBucket) -> None:
        """Record ``bucket`` of DDP's layout in the checkpoint's layout, when another hook reduces it.

        CompressedAdam's compressor reduces no bucket during warm-up; a checkpoint taken at its end must
        still hold the layout of the rebuilt buckets the compressor's first iteration will see, so that a
        fresh DDP's initial bucket is compressed as those (:func:`run_compressed`, step 3).
        """
        if bucket.index() == 0:
            self.store.begin_iteration()
        self.store.note_bucket(self._bucket_key(bucket), tuple(p.numel() for p in bucket.parameters()))

    def dense_result(
        self, key: BucketKey, params: tuple[Tensor, ...], world_size: int, mean: torch.futures.Future[Tensor]
    ) -> torch.futures.Future[Tensor]:
        """What a dense bucket returns, given the future of its mean over ranks (that future, here)."""
        return mean

    def use_compression(self, numel: int) -> bool:
        """Whether a bucket of ``numel`` elements is compressed at the current step."""
        return self.accounting.steps >= self.start_iter and numel >= max(1, self.min_compress_numel)

    def defer(self, pending: SecondCollective) -> None:
        """Leave ``pending``'s second phase to the next hook call (or the next iteration's bucket 0).

        A hierarchy's inner state hands it to its node groups' phase-2 thread instead (``parts.defer``).
        """
        if self._parts is not None and self._parts.defer is not None:
            self._parts.defer(pending)
        else:
            self._pending = pending

    def flush_pending(self) -> None:
        """Issue the phase 2 of the two-phase bucket whose phase 1 is in flight, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()

    # ------------------------------------------------------------------------------------------- public
    def scale_residuals(self, factor: float) -> None:
        """Multiply every per-bucket tensor (residuals, velocity) by ``factor``.

        Residuals hold gradients in the units they were computed in. Under AMP those are loss-scaled
        gradients, so when ``GradScaler`` changes its scale the owed gradient must be rescaled with it.

        Args:
            factor: ``new_scale / old_scale``.

        Example::

            old = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() != old:
                state.scale_residuals(scaler.get_scale() / old)
        """
        self._finish_iteration()
        self.store.scale(factor)

    def residual_of(self, param: Tensor) -> Tensor | None:
        """What this rank still owes for ``param``'s gradient (fp32, shaped like ``param``), or ``None``.

        The mean over ranks of ``residual_of(param)`` plus every gradient the hook has returned equals the
        mean over ranks of the sum of raw gradients: the error-feedback invariant. Two-phase hooks fold
        their phase-2 residual in (times the world size), as on a bucket rebuild.
        """
        self._finish_iteration()
        pkey = self.param_key(param)
        if pkey is None:
            return None
        owed = self.store.residual_of(pkey, param.numel())
        shard = self.hierarchy.residual_of(pkey, param.numel())  # hierarchical: this rank's shard's
        if shard is not None:
            owed = shard if owed is None else owed + shard
        return None if owed is None else owed.view_as(param)

    def state_dict(self) -> dict[str, Any]:
        """The counters, every bucket layout's tensors and the last iteration's bucket layout.

        After :meth:`load_state_dict`, the first iteration reduces a bucket made of whole buckets of that
        layout (a fresh DDP's initial one-bucket layout) as those buckets, so a resumed run is
        bit-identical to the uninterrupted one with DDP's default bucket layout as well (see
        :meth:`HookState.state_dict`).
        """
        state = super().state_dict()
        state.update(self.store.state_dict())
        state.update(self.hierarchy.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.store.load_state_dict(state_dict)
        self.hierarchy.load_state_dict(state_dict)

    def residual_bytes(self) -> int:
        """Bytes of error-feedback residuals this rank keeps between steps (flat and hierarchical stores;
        halved by ``residual_dtype=torch.bfloat16``).

        Example::

            state = fastcomm.register(ddp, "quantize", bits=8, residual_dtype=torch.bfloat16)
            ...  # after some steps
            print(state.residual_bytes())  # 2 bytes per compressed gradient element, plus the segments
        """
        self._finish_iteration()
        return self.store.residual_bytes() + self.hierarchy.store.residual_bytes()

    def stats(self) -> dict[str, float | int]:
        """:meth:`HookState.stats`; hierarchical, also ``intra_node_bytes`` and ``cross_node_bytes``.

        With ``node_size > 1``, ``bytes_sent`` counts the compressed exchange between nodes (and dense
        buckets' flat allreduces); ``intra_node_bytes`` the dense reduce-scatter and all-gather inside the
        node; ``cross_node_bytes`` what compressed buckets sent to other nodes.
        """
        return {**super().stats(), **self.hierarchy.stats()}

    @classmethod
    def merge_state_dicts(
        cls, states: Sequence[dict[str, Any]], world_size: int, rank: int
    ) -> tuple[dict[str, Any], str]:
        """The state_dict rank ``rank`` of a ``world_size``-rank group loads: residuals re-partitioned.

        For every compressing hook (top-k, sign, quantize, compressors):

        1. Same world size: ``states[rank]`` unchanged (a bit-identical resume).
        2. Error-feedback residuals are re-partitioned: every new rank owes, per parameter, the mean over
           old ranks of what each old rank still owed (:meth:`residual_of`: a two-phase hook's phase-2
           segment residual folded in times the old world size). The mean over ranks of what is still
           owed, the error-feedback invariant, is unchanged, so no gradient is lost or sent twice.
           Dropping them instead would lose what compression held back; giving each new rank a share of
           one old rank's would need a rank mapping that the mean does not.
        3. Top-k's DGC momentum velocity: the mean over old ranks.
        4. Nothing of the old ranks' own survives: no segment (entries record the new world size) and no
           restored bucket layout (``"layout": []``), so the first iteration reduces DDP's buckets as
           they come instead of as the old layout's (whose segments and budgets were the old group's).
        5. Counters: old rank 0's.
        6. Hierarchical states (``node_size > 1``): each old rank's shard residuals are first folded into
           its bucket residuals (:func:`~fastcomm.hooks.hierarchical.fold_shards`), so step 2 covers them.

        Args:
            states: every old rank's :meth:`state_dict`, indexed by old rank.
            world_size: the new group's size.
            rank: this process's rank in the new group.

        Returns:
            ``(state_dict, why)``: the dict to :meth:`load_state_dict` and the log line.

        Raises:
            ValueError: no states, states of another type, with other options or bucket entries, or at
                another step than old rank 0's.

        Example::

            states = [torch.load(f"ckpt/comm_{r}.pt") for r in range(2)]  # 2 ranks saved, 3 resume
            merged, why = fastcomm.SignState.merge_state_dicts(states, 3, dist.get_rank())
            state.load_state_dict(merged)  # residual_of(p) on each of the 3: the 2 old ranks' mean
        """
        kept = keep_if_same_world(cls.__name__, states, world_size, rank)
        if kept is not None:
            return kept
        merged, notes = cls._merge(states, world_size)
        return merged, describe(cls.__name__, len(states), world_size, notes)

    @classmethod
    def _merge(cls, states: Sequence[dict[str, Any]], world_size: int) -> tuple[dict[str, Any], list[str]]:
        """Steps 2-6 of :meth:`merge_state_dicts`: the merged dict and the log line's clauses."""
        hierarchical = any(state.get("hierarchical") for state in states)
        states = [fold_shards(state, old_rank) for old_rank, state in enumerate(states)]
        buckets, summary = merge_buckets(states, world_size)
        merged = {**merge_counters(states), "buckets": buckets, "layout": []}
        notes = [
            *summary.notes(),
            "no restored bucket layout (the first iteration is reduced in the new layout, not as a "
            "bit-identical resume of the old one)",
            "counters: old rank 0's",
        ]
        if hierarchical:
            notes.insert(0, "hierarchical shard residuals folded into the bucket residuals first")
        return merged, notes


@dataclass
class BucketCall:
    """One bucket to compress: the state, the layout's key and entry, the 1-D gradient, the exchange."""

    state: CompressionState
    key: BucketKey
    entry: BucketEntry
    flat: Tensor
    world_size: int
    rank: int
    last: bool
    bucket_index: int
    params: tuple[Tensor, ...]


CompressBucket = Callable[[BucketCall], torch.futures.Future[Tensor]]


def run_compressed(
    state: CompressionState | None, bucket: dist.GradBucket, cls: type, compress: CompressBucket
) -> torch.futures.Future[Tensor]:
    """The common body of the compressing hooks; ``compress(call)`` compresses one bucket.

    1. Resolve the state (the per-model default when ``None``) and open the iteration at bucket 0.
    2. World size 1: a completed future holding the gradient as is. This and every dense result of step 4
       go through :meth:`CompressionState.dense_result` (top-k's momentum).
    3. The first iteration after ``load_state_dict``, a bucket made of whole buckets of the checkpoint's
       layout (:meth:`~fastcomm.hooks.engine.store.BucketStore.resume_parts`): each part is gathered,
       reduced by steps 4-5 as the checkpointed bucket was, and scattered back.
    4. Before ``start_iter`` or below ``min_compress_numel``: a dense allreduce (with what the bucket's
       parameters still owe, after a rebuild; a last bucket also issues a pending phase 2).
    5. Otherwise ``compress(call)``.

    Returns:
        The future DDP waits on, holding the averaged bucket.
    """
    resolved = resolve_state(state, bucket, cls)
    assert isinstance(resolved, CompressionState)
    key = resolved.begin_bucket(bucket)
    buffer = bucket.buffer()
    world_size, rank = world_of(resolved.process_group)
    params = tuple(bucket.parameters())
    if world_size == 1:
        return resolved.dense_result(key, params, 1, resolved.local(buffer))
    numels = tuple(p.numel() for p in params)
    if sum(numels) != buffer.numel():
        raise RuntimeError(
            f"bucket {bucket.index()} holds {buffer.numel()} elements but its parameters {sum(numels)}: "
            f"fastcomm relies on DDP laying parameters out back to back"
        )
    where = (world_size, rank, bucket.index())
    resolved.store.note_bucket(key, numels)
    parts = resolved.store.resume_parts(key)
    if parts is None:
        return _one(resolved, key, params, buffer, where, bucket.is_last(), compress)
    by_key = dict(zip(key, params, strict=True))
    return _in_parts(resolved, parts, by_key, buffer, where, bucket.is_last(), compress)


def _one(
    state: CompressionState,
    key: BucketKey,
    params: tuple[Tensor, ...],
    buffer: Tensor,
    where: tuple[int, int, int],
    last: bool,
    compress: CompressBucket,
) -> torch.futures.Future[Tensor]:
    world_size, rank, index = where
    numels = tuple(p.numel() for p in params)
    if not state.use_compression(buffer.numel()):
        owed = None
        if state.error_feedback:
            owed = state.store.take_owed(key, numels, world_size, segment=state.dense_takes_segment)
        dense = buffer if owed is None else buffer + owed.to(buffer.dtype)
        future = state.dense_allreduce(dense, world_size, index)
        if last:
            state.flush_pending()
        return state.dense_result(key, params, world_size, future)
    entry = state.store.entry(key, numels, world_size)
    call = BucketCall(state, key, entry, buffer.reshape(-1), world_size, rank, last, index, params)
    if state.hierarchy.resolve(state):
        return state.hierarchy.reduce(call, compress)
    return compress(call)


def _in_parts(
    state: CompressionState,
    parts: list[ResumePart],
    by_key: dict[int, Tensor],
    buffer: Tensor,
    where: tuple[int, int, int],
    last: bool,
    compress: CompressBucket,
) -> torch.futures.Future[Tensor]:
    """Reduce ``buffer`` as the checkpointed buckets ``parts``, in their order; one future for all."""
    flat = buffer.reshape(-1)
    futures = []
    for position, part in enumerate(parts):
        params = tuple(by_key[pkey] for pkey in part.key)
        is_last = last and position == len(parts) - 1
        futures.append(_one(state, part.key, params, part.gather(flat), where, is_last, compress))

    def scatter(done: torch.futures.Future[list[torch.futures.Future[Tensor]]]) -> Tensor:
        for part, future in zip(parts, collective_value(done, "resumed bucket", where[2]), strict=True):
            part.scatter(future.value().reshape(-1), flat)
        return buffer

    return then(torch.futures.collect_all(futures), scatter)


def gather_payloads(
    call: BucketCall, row: Tensor, seconds: float
) -> tuple[Tensor, torch.futures.Future[Tensor]]:
    """All-gather this rank's payload ``row`` (uint8) from every rank, in chunks; count the traffic.

    Returns:
        The ``(W, len(row))`` rows (a buffer kept per bucket; row ``i`` from rank ``i``) and the future
        that completes once every chunk arrived (a failed chunk fails it).
    """
    state, flat, world_size = call.state, call.flat, call.world_size
    gathered = gather_row(
        row,
        world_size=world_size,
        group=state.process_group,
        chunk_bytes=state.wire_chunk_bytes,
        buffers=state.store.buffers.keyed(call.key),
    )
    dense = ring_bytes(flat.numel(), flat.element_size(), world_size)
    state.accounting.count(gathered.sent_bytes, dense, seconds, compressed=True)
    return gathered.rows, gathered.future
