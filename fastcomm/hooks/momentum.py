"""The DDP hook of :class:`fastcomm.CompressedAdam`: dense gradients in warm-up, compressed momentum after it.

The hook wraps one of the compressing hooks (sign, quantize or top-k, with their error feedback,
bucket-rebuild handling, skipped-step staging and collective-order guarantees) and changes only what goes
in: after warm-up each bucket's local gradient is first mixed into the optimizer's preconditioned momentum
``u = m / denom``, in place in DDP's bucket buffer,

    u_local = beta1 * u + (1 - beta1) * g_local / denom      (times the GradScaler scale, when there is one)

(``denom`` floored by ``sqrt(1 - beta2) * |g_local|``: :func:`fastcomm.optim.precondition_`)

so the wrapped hook averages momentum instead of gradients, and the mean lands in ``p.grad`` for
:meth:`CompressedAdam.step` to adopt. ``u`` and the frozen ``denom`` are identical on every rank, so the mean
of ``u_local`` over ranks is exactly ``(beta1 * m + (1 - beta1) * mean(g)) / denom``: Adam's momentum of the
mean gradient, up to what the compressor owes in its residuals.

Example::

    optimizer = fastcomm.CompressedAdam(ddp.parameters(), lr=2e-3, warmup_steps=100)
    state = fastcomm.register(ddp, optimizer, grad_scaler=scaler)  # grad_scaler only under AMP
    print(state.stats()["phase"])
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real types.
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from fastcomm.collectives import completed, ring_bytes, then
from fastcomm.collectives.errors import collective_value
from fastcomm.hooks.engine.names import HOOKS, HookName
from fastcomm.hooks.engine.reshard import describe, keep_if_same_world
from fastcomm.optim import CompressedAdam, precondition_

__all__ = ["CompressedAdamState", "compressed_adam_hook", "register_optimizer"]


@dataclasses.dataclass
class _Counters:
    """What the wrapper itself counts: the loss scale its compressors' residuals are in, warm-up traffic."""

    scale: float = 1.0
    warmup_bytes: int = 0
    warmup_buckets: int = 0


class CompressedAdamState:
    """State of :func:`compressed_adam_hook`: the optimizer, the wrapped compressor's state, warm-up traffic.

    Made by ``fastcomm.register(ddp, optimizer)``; a checkpoint keeps ``optimizer.state_dict()`` and this
    state's :meth:`state_dict` (the compressor's residuals) side by side.

    Args:
        optimizer: the :class:`~fastcomm.CompressedAdam` whose momentum the hook exchanges.
        inner: the compressor's hook state (``SignState``, ``QuantState`` or ``TopKState``).
        inner_hook: the matching hook function.
        warmup: ``(state, hook)`` of the compressor that averages warm-up gradients, or ``None`` for a dense
            allreduce (``CompressedAdam(warmup_compressor=...)``).
        grad_scaler: the ``torch.amp.GradScaler`` scaling the loss, if any: momentum is mixed in the
            gradients' scaled units, and the compressor's residuals are rescaled when the scale changes.
        process_group: the group to reduce over; ``None`` for the default group.

    Example::

        state = fastcomm.register(ddp, fastcomm.CompressedAdam(ddp.parameters()))
        torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "comm": state.state_dict()}, "ckpt.pt")
    """

    def __init__(
        self,
        optimizer: CompressedAdam,
        inner: Any,
        inner_hook: Any,
        warmup: tuple[Any, Any] | None = None,
        *,
        grad_scaler: Any = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(optimizer, CompressedAdam):
            raise TypeError(f"optimizer must be a fastcomm.CompressedAdam, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.inner = inner
        self.inner_hook = inner_hook
        self.warmup = warmup
        self.grad_scaler = grad_scaler
        self.process_group = process_group
        self._betas: dict[int, tuple[float, float]] = {}
        self._counters = _Counters()

    def bind(self, module: torch.nn.Module) -> None:
        """Check that the optimizer holds every trainable parameter of ``module``, and bind the compressor."""
        owned = {
            id(p): tuple(group["betas"]) for group in self.optimizer.param_groups for p in group["params"]
        }
        missing = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in owned]
        if missing:
            raise ValueError(
                f"CompressedAdam does not hold these trainable parameters of the DDP model: {missing[:5]}; "
                f"its hook replaces their gradients with momentum: build the optimizer from ddp.parameters()"
            )
        self._betas = owned
        self.inner.bind(module)
        if self.warmup is not None:
            self.warmup[0].bind(module)

    # ---------------------------------------------------------------------------------------- hook work
    def _grad_scale(self) -> float:
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        return float(scaler.get_scale())

    def _begin_iteration(self) -> None:
        """At bucket 0: follow a changed loss scale (residuals hold scaled momentum)."""
        scale = self._grad_scale()
        if scale != self._counters.scale:
            for state in (self.inner, None if self.warmup is None else self.warmup[0]):
                if hasattr(state, "scale_residuals"):
                    state.scale_residuals(scale / self._counters.scale)
            self._counters.scale = scale

    def _mix_momentum(self, bucket: dist.GradBucket) -> None:
        """``buffer = (1 - beta1) * g / denom + beta1 * scale * u`` for each parameter slice of the bucket."""
        flat = bucket.buffer().view(-1)
        offset = 0
        scale = self._counters.scale
        for param in bucket.parameters():
            numel = param.numel()
            view = flat[offset : offset + numel]
            offset += numel
            momentum = self.optimizer.momentum_of(param)
            denom = self.optimizer.frozen_denom_of(param)
            beta1, beta2 = self._betas.get(id(param), self.optimizer.defaults["betas"])
            if momentum is None or denom is None:  # no warm-up gradient: step() reports it
                view.mul_(1 - beta1)
                continue
            if self.optimizer.exchange == "update":
                precondition_(view, denom.view(-1), beta2, scale)
            if scale == 1.0:
                view.lerp_(momentum.view(-1), beta1)
            else:
                view.mul_(1 - beta1).add_(momentum.view(-1), alpha=beta1 * scale)

    def _dense(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Warm-up: the mean gradient by one allreduce (divided first, so fp16 cannot overflow)."""
        buffer = bucket.buffer()
        world_size = dist.get_world_size(self.process_group)
        self._counters.warmup_buckets += 1
        if world_size == 1:
            return completed(buffer)
        self._counters.warmup_bytes += ring_bytes(buffer.numel(), buffer.element_size(), world_size)
        work = dist.all_reduce(buffer.div_(world_size), group=self.process_group, async_op=True)
        index = bucket.index()

        def reduced(fut: torch.futures.Future[list[Tensor]]) -> Tensor:
            return collective_value(fut, "CompressedAdam warm-up allreduce", index)[0]

        return then(work.get_future(), reduced)

    # ------------------------------------------------------------------------------------------- public
    @property
    def steps(self) -> int:
        """Optimizer steps taken (warm-up included)."""
        return self.optimizer.steps

    def stats(self) -> dict[str, Any]:
        """The compressor's counters (compressed phase) plus the warm-up's dense traffic.

        Returns:
            The wrapped state's ``stats()`` with ``sent_bytes`` (and its other name ``bytes_sent``) and
            ``dense_bytes`` including warm-up allreduces, ``compression_ratio`` over the whole run,
            ``phase`` (``"warmup"`` or ``"compressed"``), ``warmup_buckets`` and ``optimizer_steps``.
        """
        stats: dict[str, Any] = dict(self.inner.stats())
        stats["sent_bytes"] += self._counters.warmup_bytes
        stats["dense_bytes"] += self._counters.warmup_bytes
        if self.warmup is not None:
            warmup = self.warmup[0].stats()
            stats["sent_bytes"] += warmup["sent_bytes"]
            stats["dense_bytes"] += warmup["dense_bytes"]
        stats["bytes_sent"] = stats["sent_bytes"]
        stats["compression_ratio"] = (
            stats["dense_bytes"] / stats["sent_bytes"] if stats["sent_bytes"] else 1.0
        )
        stats["phase"] = "compressed" if self.optimizer.compressing else "warmup"
        stats["warmup_buckets"] = self._counters.warmup_buckets
        stats["optimizer_steps"] = self.optimizer.steps
        return stats

    def state_dict(self) -> dict[str, Any]:
        """The compressor's residuals and counters, the loss scale they are in, and the warm-up counters.

        The optimizer's own state (momentum, frozen variance, step) is ``optimizer.state_dict()``.
        """
        return {
            "type": type(self).__name__,
            "inner": self.inner.state_dict(),
            "warmup": None if self.warmup is None else self.warmup[0].state_dict(),
            "counters": dataclasses.asdict(self._counters),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: the dict comes from another kind of state.
        """
        if state_dict.get("type") != type(self).__name__:
            raise ValueError(f"state_dict is for {state_dict.get('type')!r}, not {type(self).__name__}")
        self.inner.load_state_dict(state_dict["inner"])
        if (self.warmup is None) != (state_dict["warmup"] is None):
            raise ValueError("state_dict was saved with another warmup_compressor than this optimizer's")
        if self.warmup is not None:
            self.warmup[0].load_state_dict(state_dict["warmup"])
        self._counters = _Counters(**state_dict["counters"])

    @classmethod
    def merge_state_dicts(
        cls, states: Sequence[dict[str, Any]], world_size: int, rank: int
    ) -> tuple[dict[str, Any], str]:
        """The state_dict rank ``rank`` of a ``world_size``-rank group loads, from every old rank's.

        1. Same world size: ``states[rank]`` unchanged (a bit-identical resume).
        2. The compressor's state and the warm-up compressor's, if any, by their own
           ``merge_state_dicts``: their residuals (of preconditioned momentum after warm-up, of gradients
           during it) are re-partitioned, every new rank owing the mean over old ranks of what each still
           owed, so the mean over ranks of the momentum still owed is unchanged
           (:meth:`~fastcomm.hooks.engine.compression.CompressionState.merge_state_dicts`).
        3. The loss scale and the warm-up counters: old rank 0's (the scale is the same on every rank).

        The optimizer's momentum and frozen variance are the same on every rank (each adopts the mean the
        hook returns); they come from ``optimizer.state_dict()``.

        Args:
            states: every old rank's :meth:`state_dict`, indexed by old rank.
            world_size: the new group's size.
            rank: this process's rank in the new group.

        Returns:
            ``(state_dict, why)``: the dict to :meth:`load_state_dict` and the log line.

        Raises:
            ValueError: no states, states of another type, of other compressors or options, some with a
                warm-up compressor and some without.

        Example::

            states = [torch.load(f"ckpt/comm_{r}.pt") for r in range(2)]  # 2 ranks saved, 3 resume
            merged, why = type(state).merge_state_dicts(states, 3, dist.get_rank())
            state.load_state_dict(merged)
        """
        kept = keep_if_same_world(cls.__name__, states, world_size, rank, options=False)
        if kept is not None:
            return kept
        if any((state["warmup"] is None) != (states[0]["warmup"] is None) for state in states):
            raise ValueError("some old ranks' CompressedAdamState has a warm-up compressor and some not")
        inner, inner_why = _merged_part([state["inner"] for state in states], world_size, rank)
        notes = [f"compressor {inner_why}"]
        warmup = None
        if states[0]["warmup"] is not None:
            warmup, warmup_why = _merged_part([state["warmup"] for state in states], world_size, rank)
            notes.append(f"warm-up compressor {warmup_why}")
        notes.append("loss scale and warm-up counters: old rank 0's")
        merged = {
            "type": cls.__name__,
            "inner": inner,
            "warmup": warmup,
            "counters": dict(states[0]["counters"]),
        }
        return merged, describe(cls.__name__, len(states), world_size, notes)

    def __repr__(self) -> str:
        return f"CompressedAdamState(compressor={self.inner!r}, warmup_steps={self.optimizer.warmup_steps})"


def _merged_part(states: list[dict[str, Any]], world_size: int, rank: int) -> tuple[dict[str, Any], str]:
    """A wrapped compressor's states merged by the ``merge_state_dicts`` of the class they name."""
    by_name = {row.state.__name__: row.state for row in HOOKS.values()}
    name = states[0].get("type")
    if name not in by_name:
        raise ValueError(f"CompressedAdamState wraps a {name!r} state; known: {sorted(by_name)}")
    return by_name[name].merge_state_dicts(states, world_size, rank)


def compressed_adam_hook(state: CompressedAdamState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook of :class:`~fastcomm.CompressedAdam`: dense in warm-up, compressed momentum after.

    1. At bucket 0: if the GradScaler's scale changed, rescale the compressors' residuals.
    2. Warm-up (``optimizer.compressing`` is false): record the bucket in the compressor's layout (a
       checkpoint at the end of warm-up then tells a fresh DDP's one-bucket first iteration which buckets
       to compress it as), and allreduce the gradient densely, or through the ``warmup_compressor``'s
       hook; done.
    3. Mix the local gradient into the preconditioned momentum in the bucket buffer (module docstring).
    4. Hand the bucket to the wrapped compressing hook (sign by default): the future holds the momentum
       averaged over ranks, which DDP writes into ``p.grad``.

    Args:
        state: the :class:`CompressedAdamState` made by ``fastcomm.register(ddp, optimizer)``.
        bucket: the DDP gradient bucket.

    Returns:
        A future holding the averaged gradient (warm-up) or the averaged momentum (after).

    Example::

        ddp.register_comm_hook(fastcomm.hooks.momentum.CompressedAdamState(opt, fastcomm.SignState(),
                               fastcomm.sign_hook), fastcomm.hooks.momentum.compressed_adam_hook)
    """
    if bucket.index() == 0:
        state._begin_iteration()
    if not state.optimizer.compressing:
        state.inner.note_layout(bucket)
        if state.warmup is not None:
            return state.warmup[1](state.warmup[0], bucket)
        return state._dense(bucket)
    state._mix_momentum(bucket)
    return state.inner_hook(state.inner, bucket)


def register_optimizer(
    ddp: DistributedDataParallel,
    optimizer: CompressedAdam,
    *,
    grad_scaler: Any = None,
    process_group: dist.ProcessGroup | None = None,
) -> CompressedAdamState:
    """Build the compressor named by ``optimizer.compressor``, wrap it, and register the hook on ``ddp``.

    Args:
        ddp: the DistributedDataParallel model whose parameters ``optimizer`` holds.
        optimizer: a :class:`~fastcomm.CompressedAdam`.
        grad_scaler: the AMP ``GradScaler``, if the loss is scaled.
        process_group: the group to reduce over; ``None`` for the default group.

    Returns:
        The hook's state (``stats()``, ``state_dict()``).

    Example::

        state = fastcomm.hooks.momentum.register_optimizer(ddp, optimizer)  # fastcomm.register does this
    """
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"register needs a DistributedDataParallel model, got {type(ddp).__name__}")
    if optimizer.hook_attached:
        raise ValueError("this CompressedAdam already has a hook registered on a DDP model")
    inner_row = HOOKS[HookName(optimizer.compressor)]
    inner = inner_row.state(**optimizer.compressor_options, process_group=process_group)
    warmup = None
    if optimizer.warmup_compressor is not None:
        warmup_row = HOOKS[HookName(optimizer.warmup_compressor)]
        warmup = (warmup_row.state(process_group=process_group), warmup_row.hook)
    state = CompressedAdamState(
        optimizer, inner, inner_row.hook, warmup, grad_scaler=grad_scaler, process_group=process_group
    )
    state.bind(ddp.module)
    ddp.register_comm_hook(state, compressed_adam_hook)
    optimizer.hook_attached = True
    return state
