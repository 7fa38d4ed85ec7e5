"""Top-k sparsification hook: each rank sends its k largest-magnitude entries (Deep Gradient Compression)."""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real types.
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from fastcomm import ops
from fastcomm.collectives import Timer, then
from fastcomm.collectives.errors import collective_value
from fastcomm.compress.protocol import all_finite
from fastcomm.compress.topk import TopKCompressor
from fastcomm.hooks.engine.compression import BucketCall, CompressionState, gather_payloads, run_compressed
from fastcomm.hooks.engine.options import is_real, require_real
from fastcomm.hooks.engine.util import BucketKey

__all__ = ["TopKState", "topk_hook"]


class TopKState(CompressionState):
    """State of :func:`topk_hook`: sparsity and Deep Gradient Compression's recipe, residuals, statistics.

    DGC (Lin et al., 2018) makes top-k sparsification train like dense momentum SGD with four pieces; on a
    bucket that is compressed, each rank's hook runs, in order:

    1. Local gradient clipping (``clip_norm``): the rank's own gradient ``g`` is scaled down to norm at
       most ``clip_norm * sqrt(bucket numel / model numel) / sqrt(W)`` before it enters the velocity.
       DGC clips locally because unsent gradient accumulates on each rank, and scales the global threshold
       by ``W ** -0.5``, a rank's share of it if all ranks' gradients were alike. A hook sees one bucket at
       a time, so the threshold is shared out so that the squared shares add up to ``clip_norm**2 / W``
       over the model (the model's size is that of the module bound by :func:`fastcomm.register`, else of
       the parameters seen in buckets so far: exact from the second iteration on).
    2. Momentum correction (``momentum=m > 0``): a velocity per bucket ``u = m * u + g`` (``nesterov``:
       ``u = m * (u + g)``, and ``u + g`` is what accumulates), and ``acc = u + residual``.
    3. Sparsification with error feedback: the top-k of ``acc`` is sent, the rest stays in the residual.
    4. Momentum factor masking (``momentum_masking``): the velocity is cleared where entries were sent, so
       a gradient that has just been applied does not keep pushing through a stale momentum.
    5. Warm-up of the sparsity (``warmup_steps``): during the ``warmup_steps`` steps after ``start_iter``
       the ratio goes through ``warmup_ratios`` (equal stages, the densest first), then stays at ``ratio``.

    Optimizer pairing: with ``momentum > 0`` the momentum is already inside the reduced gradient, so use an
    optimizer *without* momentum, ``torch.optim.SGD(params, lr, momentum=0)`` (momentum would otherwise be
    applied twice); ``nesterov=True`` stands for ``SGD(nesterov=True)``. The optimizer's ``weight_decay``
    then acts without momentum (add it to the loss to have it inside the velocity, as DGC does). With
    ``clip_norm`` do not also call ``clip_grad_norm_`` on the reduced gradients: clipping belongs before the
    accumulation. Momentum correction is DGC's answer for momentum SGD, not for Adam (keep ``momentum=0``
    with AdamW, or use :class:`fastcomm.CompressedAdam`). Dense steps (before ``start_iter``, buckets
    below ``min_compress_numel``, world size 1) apply the momentum to the mean gradient, as DGC's own code
    does: ``u = m * u + mean(g)`` (Nesterov: ``u = m * (u + mean(g))``, returning ``u + mean(g)``), with
    the velocity kept per parameter and staged like the residual; clipping does not apply there.

    Args:
        ratio: fraction of each bucket's entries a rank sends, in ``(0, 1]``; ``k = ceil(ratio * numel)``.
        exact: exactly k entries, or DGC's sampled threshold (about k, fewer passes). The payload has a
            fixed size k on every rank either way: extra entries stay in the residual, missing ones are
            padded with zeros.
        momentum: DGC momentum correction factor in ``[0, 1)``; 0 disables it.
        warmup_ratios: ratios of the warmup stages, each in ``(0, 1]``.
        warmup_steps: length of the warmup; 0 disables it.
        nesterov: DGC's Nesterov variant of momentum correction (needs ``momentum > 0``).
        momentum_masking: clear the velocity at the entries sent (needs ``error_feedback``; turning it
            off is for ablations).
        clip_norm: local gradient clipping threshold, as a global L2 norm over the model's gradient
            (what ``clip_grad_norm_`` would get); ``None`` disables it. The hook sees gradients before
            ``GradScaler.unscale_``, so under AMP loss scaling the threshold is in loss-scaled units.
        error_feedback: keep unsent entries in a per-bucket residual and add them to the next gradient.
        start_iter: dense allreduce for the first ``start_iter`` steps.
        min_compress_numel: buckets with fewer elements go dense.
        wire_chunk_bytes: bytes per peer of each chunk a collective is split into (see
            :class:`~fastcomm.hooks.engine.compression.CompressionState`).
        process_group: the group to reduce over; ``None`` for the default group.
        (``error_feedback`` and the options after it are keyword-only.)

    Example::

        state = fastcomm.TopKState(ratio=0.01, momentum=0.9, warmup_steps=500, clip_norm=1.0)
        ddp.register_comm_hook(state, fastcomm.topk_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.0)  # momentum lives in the hook
    """

    _OPTIONS = (
        "ratio",
        "exact",
        "momentum",
        "warmup_ratios",
        "warmup_steps",
        "nesterov",
        "momentum_masking",
        "clip_norm",
        *CompressionState._OPTIONS,
    )

    def __init__(
        self,
        ratio: float = 0.01,
        exact: bool = False,
        momentum: float = 0.0,
        warmup_ratios: tuple[float, ...] = (0.25, 0.0625, 0.015625, 0.004, 0.001),
        warmup_steps: int = 0,
        *,
        nesterov: bool = False,
        momentum_masking: bool = True,
        clip_norm: float | None = None,
        **options: Any,
    ) -> None:
        if not 0.0 < require_real("ratio", ratio) <= 1.0:
            raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
        if not 0.0 <= require_real("momentum", momentum) < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        if isinstance(warmup_ratios, str) or not all(is_real(r) for r in warmup_ratios):
            raise ValueError(f"warmup_ratios must be a sequence of numbers, got {warmup_ratios!r}")
        warmup_ratios = tuple(float(r) for r in warmup_ratios)
        if not warmup_ratios or not all(0.0 < r <= 1.0 for r in warmup_ratios):
            raise ValueError(
                f"warmup_ratios must be a non-empty sequence of values in (0, 1], got {warmup_ratios!r}"
            )
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
        for name, flag in (("exact", exact), ("nesterov", nesterov), ("momentum_masking", momentum_masking)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        if nesterov and momentum == 0.0:
            raise ValueError("nesterov=True needs momentum > 0 (it is a variant of momentum correction)")
        if clip_norm is not None and not 0.0 < require_real("clip_norm", clip_norm) < math.inf:
            raise ValueError(f"clip_norm must be None or a positive finite number, got {clip_norm!r}")
        self.ratio = float(ratio)
        self.exact = exact
        self.momentum = float(momentum)
        self.warmup_ratios = warmup_ratios
        self.warmup_steps = warmup_steps
        self.nesterov = nesterov
        self.momentum_masking = momentum_masking
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        # numel of every parameter the hook serves: the model size that local clipping shares out
        self._clipped_numels: WeakIdKeyDictionary = WeakIdKeyDictionary()
        super().__init__(**options)

    def dense_result(
        self, key: BucketKey, params: tuple[Tensor, ...], world_size: int, mean: torch.futures.Future[Tensor]
    ) -> torch.futures.Future[Tensor]:
        """With ``momentum > 0``, the velocity of DGC's momentum correction applied to a dense mean."""
        if self.momentum == 0.0:
            return mean
        entry = self.store.entry(key, tuple(p.numel() for p in params), world_size)

        def with_momentum(done: torch.futures.Future[Tensor]) -> Tensor:
            averaged = done.value()  # a failed allreduce raises here
            previous = self.store.current(entry, "velocity", averaged.reshape(-1))
            if self.nesterov:
                velocity = (previous + averaged.reshape(-1)).mul_(self.momentum)
                result = velocity + averaged.reshape(-1)
            else:
                velocity = previous * self.momentum + averaged.reshape(-1)
                result = velocity
            self.store.stage(key, "velocity", velocity)
            return averaged.copy_(result.view_as(averaged))

        return then(mean, with_momentum)

    def ratio_at(self, step: int) -> float:
        """The sparsity ratio used at ``step`` (warmup stage or ``ratio``)."""
        into = step - self.start_iter
        if 0 <= into < self.warmup_steps:
            stage = into * len(self.warmup_ratios) // self.warmup_steps
            return max(self.warmup_ratios[stage], self.ratio)
        return self.ratio

    def bind(self, module: torch.nn.Module) -> None:
        """Tie this state to ``module`` (see :meth:`HookState.bind`); its size sets the clipping shares."""
        super().bind(module)
        for param in module.parameters():
            if param.requires_grad:
                self._clipped_numels[param] = param.numel()

    def clip_threshold(self, bucket: dist.GradBucket | Sequence[Tensor], world_size: int) -> float:
        """The norm a rank's gradient in ``bucket`` (or these parameters) is clipped to (local clipping).

        ``clip_norm * sqrt(bucket numel / model numel) / sqrt(world_size)``; the model numel counts every
        parameter of the bound module and of the buckets seen so far.

        Raises:
            ValueError: ``clip_norm`` is ``None``.

        Example::

            state = fastcomm.register(ddp, "topk", ratio=0.01, momentum=0.9, clip_norm=1.0)
        """
        if self.clip_norm is None:
            raise ValueError("clip_threshold needs clip_norm; this state was made with clip_norm=None")
        numel = 0
        for param in bucket.parameters() if hasattr(bucket, "parameters") else bucket:
            self._clipped_numels[param] = param.numel()
            numel += param.numel()
        model_numel = max(numel, sum(self._clipped_numels.values()))
        return self.clip_norm * math.sqrt(numel / model_numel) / math.sqrt(world_size)


def topk_hook(state: TopKState | None, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: mean over ranks of each rank's top-k of (gradient + residual), by one all-gather.

    1. Dense allreduce instead when the step is before ``start_iter`` or the bucket is smaller than
       ``min_compress_numel``; the gradient as is when the world size is 1.
    2. ``acc = grad (or the DGC velocity, after local clipping: see :class:`TopKState`) + residual``;
       ``(values, int32 indices) = ops.topk_select(acc, k)``
       with ``k = ceil(ratio * numel)``. Approximate selection is cut or zero-padded to exactly k, so every
       rank's payload has the same size, fixed before any communication.
    3. The new residual is ``acc`` with the sent entries zeroed (staged: dropped if the step is skipped).
    4. One all-gather of the packed ``(indices, values)`` rows; then scatter-add every rank's entries in rank
       order into fp32 zeros, divide by the world size and cast to the bucket's dtype (in a result buffer
       kept per bucket, of which only the previous step's entries need clearing).

    One collective per bucket, issued inside the hook call, so every rank issues the same collectives in
    the same (bucket) order. Traffic per rank is ``(W - 1) * k * (4 + element size)`` bytes: unlike a ring
    allreduce it grows with the world size, so top-k pays off when ``ratio`` is well below ``1 / W``.

    Args:
        state: a :class:`TopKState`, or ``None`` for a default one per model.
        bucket: the DDP gradient bucket.

    Returns:
        A future holding the averaged bucket (the result buffer kept for the bucket, or a dense one).

    Example::

        ddp.register_comm_hook(fastcomm.TopKState(ratio=0.01), fastcomm.topk_hook)
    """
    return run_compressed(state, bucket, TopKState, _topk_bucket)


def _topk_bucket(call: BucketCall) -> torch.futures.Future[Tensor]:
    """Steps 2-4 of :func:`topk_hook` for one bucket."""
    state, key, entry, flat, world_size = call.state, call.key, call.entry, call.flat, call.world_size
    assert isinstance(state, TopKState)
    store, numel = state.store, flat.numel()
    timer = Timer()
    with timer:
        k = min(numel, max(1, math.ceil(state.ratio_at(state.accounting.steps) * numel)))
        compressor = TopKCompressor(k, state.exact)
        if state.clip_norm is not None:  # DGC local clipping: before the gradient enters the velocity
            _clip_norm_(flat, state.clip_threshold(call.params, world_size))
        source = flat
        if state.momentum > 0.0:
            previous = store.current(entry, "velocity", flat)
            if state.nesterov:  # DGC's Nesterov form: u = m (u + g); u + g accumulates
                velocity = (previous + flat).mul_(state.momentum)
                source = velocity + flat
            else:
                velocity = previous * state.momentum + flat
                source = velocity
        residual = current = None
        if state.error_feedback:  # the op writes acc with the sent entries zeroed into the spare buffer
            current = store.current(entry, "residual", flat)
            residual = store.spare(key, "residual", current)
        values, indices, sent = compressor.select(source, residual, current)
        if residual is not None:
            store.stage(key, "residual", residual)
        if state.momentum > 0.0:
            if state.error_feedback and state.momentum_masking:  # momentum factor masking
                velocity.index_fill_(0, sent.long(), 0)
            store.stage(key, "velocity", velocity)
        uint8 = torch.empty(0, dtype=torch.uint8, device=flat.device)
        row = store.buffers.tensor(key, "row", uint8, compressor.wire_bytes(numel, flat.dtype))
        compressor.pack(row, values, indices)
    gathered, gathered_future = gather_payloads(call, row, timer.seconds)
    dtype, bucket_index = flat.dtype, call.bucket_index
    result = store.buffers.object(key, "result", lambda: _SparseResult(flat), lambda kept: kept.fits(flat))

    def decompress(arrived: torch.futures.Future[Tensor]) -> Tensor:
        collective_value(arrived, "TopKState all-gather", bucket_index)  # a failed all-gather raises here
        decompress_timer = Timer()
        with decompress_timer:
            all_indices, all_values = compressor.unpack(gathered, dtype)
            state.accounting.note_output(all_finite(all_values))
            out = result.fill(all_indices, all_values, world_size)
        state.accounting.add_seconds(decompress_timer.seconds)
        return out

    return then(gathered_future, decompress)


class _SparseResult:
    """A bucket's dense result, kept between steps: zero except where the last result was written.

    Each step clears only the entries the previous step set (at most ``W * k``) instead of the whole bucket.
    DDP copies a hook's result into the gradients before the bucket's next hook call, so reuse is safe.
    """

    def __init__(self, like: Tensor) -> None:
        self.sums = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        self.out = self.sums if like.dtype == torch.float32 else torch.zeros_like(like)
        self.touched: Tensor | None = None

    def fits(self, like: Tensor) -> bool:
        return (self.out.numel(), self.out.dtype, self.out.device) == (like.numel(), like.dtype, like.device)

    def fill(self, indices: Tensor, values: Tensor, world_size: int) -> Tensor:
        """Sum the gathered entries in rank order in fp32, divide by ``W``, cast to the bucket's dtype.

        One op (:func:`fastcomm.ops.sparse_mean`) for an fp32 bucket: it clears last step's entries, adds
        and divides, each a prefetched pass over the entries (each entry is a cache miss in a bucket larger
        than the caches; torch's index ops took about twice as long). Other dtypes sum in the fp32 buffer
        and copy the means out with ``index_select``/``index_copy_``.
        """
        if self.out is self.sums:
            ops.sparse_mean(self.sums, indices, values, world_size, clear=self.touched)
            # indices views the gathered buffer, which the next step overwrites: keep a copy
            self.touched = indices.clone()
            return self.out
        if self.touched is not None:
            self.out.index_fill_(0, self.touched, 0)
        ops.sparse_accumulate(self.sums, indices, values)
        touched = indices.long()
        means = self.sums.index_select(0, touched).div_(world_size)
        self.sums.index_fill_(0, touched, 0)
        self.out.index_copy_(0, touched, means.to(self.out.dtype))
        self.touched = touched
        return self.out


def _clip_norm_(flat: Tensor, threshold: float) -> None:
    """Scale ``flat`` in place to L2 norm at most ``threshold`` (norm in fp32; no host sync)."""
    norm = torch.linalg.vector_norm(flat, dtype=torch.float32)
    flat.mul_((threshold / (norm + 1e-6)).clamp_(max=1.0).to(flat.dtype))
