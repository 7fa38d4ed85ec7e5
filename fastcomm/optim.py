"""CompressedAdam: AdamW whose momentum, not its gradient, crosses the network compressed (1-bit Adam).

Error feedback alone does not carry Adam through compression: the variance term sees the compression error
and the step sizes drift (on our LM task topk and sign under plain AdamW ended 22-26% worse than dense).
1-bit Adam (Tang et al., 2021) and 0/1 Adam (Lu et al., 2022) observe that Adam's variance settles early, so
after a short dense warm-up it can be frozen; Adam then is a momentum SGD with a fixed per-coordinate
preconditioner, and momentum tolerates compression with error feedback the way SGD does.

The optimizer keeps AdamW's state and math. Its DDP hook (:mod:`fastcomm.hooks.momentum`, registered by
``fastcomm.register(ddp, optimizer)``) does the communication:

1. Warm-up (the first ``warmup_steps`` steps): the hook allreduces gradients densely; :meth:`step` is AdamW.
2. At the end of warm-up the bias-corrected variance is frozen into ``denom = sqrt(v / (1 - beta2^T)) + eps``
   and the momentum is kept preconditioned from then on: ``u = m / denom``.
3. Compressed phase: each rank's hook mixes its local gradient into the shared preconditioned momentum,
   ``u_local = beta1 * u + (1 - beta1) * g_local / denom``, and the compressor (sign by default, with error
   feedback on both sides of its two-phase exchange) averages ``u_local`` over ranks. ``denom`` is identical
   on every rank, so that mean is exactly ``(beta1 * m + (1 - beta1) * mean(g)) / denom``: Adam's momentum
   of the mean gradient, preconditioned. (Each rank floors ``denom`` by ``sqrt(1 - beta2) * |g_local|``, see
   :func:`precondition_`.) It arrives in ``p.grad``; :meth:`step` adopts it as ``u`` and applies
   ``p -= lr * u / (1 - beta1^t)`` after the decoupled weight decay ``p *= 1 - lr * wd``.

Why ``u`` and not ``m`` crosses the wire (1-bit Adam sends ``m``): a 1-bit code gives every element of a chunk
the chunk's mean magnitude. A coordinate that had no gradient in warm-up (a dead ReLU unit, an unused
embedding row) has ``denom = eps``, so the magnitude its raw-momentum code carries was multiplied by
``1 / eps``: on a small ReLU network the weights turned to NaN within a few steps. In ``u`` every element is
already an Adam update (magnitude about 1 or less), so the code's error is bounded the same way everywhere.
The same coordinate coming alive after warm-up (a ReLU unit that starts firing) would divide its first real
gradient by ``eps``; Adam itself would have grown ``v`` by ``(1 - beta2) * g^2`` that step, so the frozen
``denom`` is floored by that amount, and ``|g / denom|`` stays below ``1 / sqrt(1 - beta2)`` as in Adam.
Without the floor the same small ReLU network diverged about 80 steps after warm-up.

Without a registered hook (one process, or plain ``torch.nn.Module``) the compressed phase computes the same
momentum locally, so the optimizer is usable anywhere AdamW is.

Example::

    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = fastcomm.CompressedAdam(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                        warmup_steps=100, compressor="sign")
    state = fastcomm.register(model, optimizer)
    for batch in loader:
        loss = model(batch).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["COMPRESSORS", "WARMUP_COMPRESSORS", "CompressedAdam", "precondition_"]

COMPRESSORS = ("sign", "quantize", "topk")
WARMUP_COMPRESSORS = (None, "cast", "quantize")
EXCHANGES = ("update", "momentum")


def _check_number(name: str, value: Any, low: float, high: float, *, high_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or value < low or above:
        bracket = ")" if high_open else "]"
        raise ValueError(f"{name} must be in [{low}, {high}{bracket}, got {value!r}")
    return value


def precondition_(grad: Tensor, denom: Tensor, beta2: float, grad_scale: float = 1.0) -> Tensor:
    """``grad / max(denom, sqrt(1 - beta2) * |grad| / grad_scale)``, in place: a gradient through a frozen
    Adam preconditioner, never divided by less than Adam's own variance would have been after seeing it.

    Adam's ``v_t >= (1 - beta2) * g_t^2``, so ``|g_t| / sqrt(v_t) <= 1 / sqrt(1 - beta2)``; the floor keeps
    that bound when ``v`` is frozen (a coordinate with no gradient in warm-up has ``denom = eps``).

    Args:
        grad: the gradient (times ``grad_scale`` under a GradScaler), overwritten with the result.
        denom: the frozen ``sqrt(v_hat) + eps`` (unscaled units), shaped like ``grad``.
        beta2: Adam's second-moment decay.
        grad_scale: the loss scale ``grad`` carries.

    Returns:
        ``grad``.

    Example::

        >>> precondition_(torch.tensor([1.0, 1.0]), torch.tensor([2.0, 1e-8]), beta2=0.96)
        tensor([0.5000, 5.0000])
    """
    floor = grad.abs().mul_(math.sqrt(1.0 - beta2) / grad_scale)
    return grad.div_(torch.maximum(floor, denom, out=floor))


def _adam_update_bound(beta1: float, beta2: float) -> float:
    """The largest ``|m_hat / sqrt(v_hat)|`` Adam itself can produce: ``(1 - b1) / (sqrt(1 - b2) (1 - b1 /
    sqrt(b2)))`` when ``b1 < sqrt(b2)`` (each past gradient's share of ``m`` over its share of ``v``)."""
    if beta1 >= math.sqrt(beta2):
        return math.inf
    return (1 - beta1) / (math.sqrt(1 - beta2) * (1 - beta1 / math.sqrt(beta2)))


class CompressedAdam(torch.optim.Optimizer):
    """AdamW with a dense warm-up, then frozen variance and compressed, error-fed momentum (1-bit Adam).

    1. Steps ``1 .. warmup_steps``: exactly AdamW (decoupled weight decay, bias correction) on the dense
       mean gradient.
    2. After step ``warmup_steps``: ``denom = sqrt(v_hat) + eps`` is frozen per parameter.
    3. Later steps: ``p.grad`` holds the preconditioned momentum ``u = m / denom`` averaged over ranks by the
       hook (see the module docstring); it becomes ``exp_avg`` (which holds ``u`` from the end of warm-up
       on) and ``p -= lr * u / (1 - beta1^t)``.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr: learning rate (groups may override it; schedulers work as usual).
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to the frozen ``sqrt(v_hat)``.
        weight_decay: decoupled weight decay, as AdamW (``p *= 1 - lr * weight_decay``).
        warmup_steps: AdamW steps before the variance freezes, at least 1. 1-bit Adam uses 15-25% of
            training. On our 500-step LM task (cosine schedule) 200 steps (40%) ended at dense AdamW's loss
            (+0.01%) and 100 steps 2.8% above it, with the 8-bit compressor instead of sign 1.7% above: a
            variance frozen too early, not the 1-bit code, is what costs. ``warmup_compressor="quantize"``
            makes a long warm-up cheap on a slow link.
        compressor: what averages the momentum after warm-up: ``"sign"`` (1 bit per element plus one fp32
            scale per ``chunk``), ``"quantize"`` (8/4/2-bit blockwise) or ``"topk"``.
        warmup_compressor: how warm-up averages gradients: ``None`` (dense allreduce in the gradients'
            dtype), ``"cast"`` (a bf16 allreduce, ``fastcomm.cast_hook``) or ``"quantize"`` (8-bit blockwise
            with error feedback, ``fastcomm.quantize_hook``), both within 0.5% of dense AdamW's loss on our LM
            task, at 1/2 and 1/4 of the traffic.
        exchange: what the hook averages after warm-up: ``"update"`` (the preconditioned momentum
            ``m / denom``, see the module docstring) or ``"momentum"`` (``m`` itself, as 1-bit Adam; the step
            divides by ``denom`` after the exchange, clamps each coordinate to Adam's own largest step
            ``(1 - b1) / (sqrt(1 - b2) (1 - b1 / sqrt(b2)))`` and never moves one that had no gradient in
            warm-up).
        **compressor_options: options of the compressor's hook state (``fastcomm.SignState``,
            ``QuantState`` or ``TopKState``), e.g. ``chunk=2048`` or ``bits=4``; ``start_iter`` is not
            allowed (``warmup_steps`` plays its part).

    Example::

        optimizer = fastcomm.CompressedAdam(ddp.parameters(), lr=1e-3, warmup_steps=200)
        state = fastcomm.register(ddp, optimizer)
        ...
        torch.save({"optimizer": optimizer.state_dict(), "comm": state.state_dict()}, "ckpt.pt")
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        warmup_steps: int = 100,
        compressor: str = "sign",
        warmup_compressor: str | None = None,
        exchange: str = "update",
        **compressor_options: Any,
    ) -> None:
        lr = _check_number("lr", lr, 0.0, math.inf)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        betas = (_check_number("betas[0]", betas[0], 0.0, 1.0), _check_number("betas[1]", betas[1], 0.0, 1.0))
        eps = _check_number("eps", eps, 0.0, math.inf)
        weight_decay = _check_number("weight_decay", weight_decay, 0.0, math.inf)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int):
            raise TypeError(
                f"warmup_steps must be an int, got {type(warmup_steps).__name__} {warmup_steps!r}"
            )
        if warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be at least 1, got {warmup_steps}: the frozen variance is estimated "
                f"during the dense warm-up"
            )
        if compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {COMPRESSORS}, got {compressor!r}")
        if warmup_compressor not in WARMUP_COMPRESSORS:
            raise ValueError(
                f"warmup_compressor must be one of {WARMUP_COMPRESSORS}, got {warmup_compressor!r}"
            )
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if "start_iter" in compressor_options:
            raise ValueError("start_iter is not a CompressedAdam option: warmup_steps sets the dense phase")
        self.warmup_steps = warmup_steps
        self.compressor = compressor
        self.warmup_compressor = warmup_compressor
        self.exchange = exchange
        self.compressor_options = dict(compressor_options)
        # set by fastcomm.register: then p.grad holds the averaged momentum in the compressed phase
        self.hook_attached = False
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "step": 0}
        super().__init__(params, defaults)

    # ---------------------------------------------------------------------------------------------- phase
    @property
    def steps(self) -> int:
        """Steps taken so far (the step counter shared by every group)."""
        return int(self.param_groups[0]["step"]) if self.param_groups else 0

    @property
    def compressing(self) -> bool:
        """Whether the next step is in the compressed phase (the hook then sends momentum, not gradients)."""
        return self.steps >= self.warmup_steps

    def momentum_of(self, param: Tensor) -> Tensor | None:
        """``param``'s ``exp_avg``: the momentum in warm-up, ``m / denom`` after (``None`` before step 1)."""
        return self.state.get(param, {}).get("exp_avg")

    def frozen_denom_of(self, param: Tensor) -> Tensor | None:
        """``sqrt(v_hat) + eps`` of ``param`` as frozen at the end of warm-up (``None`` before)."""
        return self.state.get(param, {}).get("frozen_denom")

    # ----------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step: AdamW during warm-up, the frozen-variance momentum step after it.

        Args:
            closure: re-evaluates the model and returns the loss, as for any ``torch.optim`` optimizer.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            step = int(group["step"]) + 1
            group["step"] = step
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("CompressedAdam does not support sparse gradients")
            if step <= self.warmup_steps:
                self._adamw_step(group, params, step)
            else:
                self._frozen_step(group, params, step)
        return loss

    def _adamw_step(self, group: dict[str, Any], params: list[Tensor], step: int) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        bias1, bias2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grad, exp_avg, exp_avg_sq = p.grad, state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1 - lr * wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-lr / bias1)
            if step == self.warmup_steps:
                state["frozen_denom"] = denom
                if self.exchange == "update":
                    exp_avg.div_(denom)  # from now on the momentum is kept preconditioned
                else:  # a coordinate without any warm-up gradient never moves (its denom is eps)
                    denom.masked_fill_(exp_avg_sq == 0, math.inf)

    def _frozen_step(self, group: dict[str, Any], params: list[Tensor], step: int) -> None:
        lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
        for p in params:
            state = self.state[p]
            if "frozen_denom" not in state:
                raise RuntimeError(
                    "CompressedAdam reached its compressed phase for a parameter that had no gradient during "
                    f"the {self.warmup_steps} warm-up steps, so it has no variance to freeze; give it a "
                    "gradient in warm-up or put it in a plain AdamW"
                )
            exp_avg, denom = state["exp_avg"], state["frozen_denom"]
            if self.hook_attached:
                exp_avg.copy_(p.grad)  # the hook's result, averaged over ranks
            elif self.exchange == "update":
                exp_avg.mul_(beta1).add_(precondition_(p.grad.clone(), denom, beta2), alpha=1 - beta1)
            else:
                exp_avg.lerp_(p.grad, 1 - beta1)
            p.mul_(1 - lr * wd)
            if self.exchange == "update":
                p.add_(exp_avg, alpha=-lr / (1 - beta1**step))
            else:
                bound = _adam_update_bound(beta1, beta2)
                p.add_(torch.div(exp_avg, denom).clamp_(-bound, bound), alpha=-lr / (1 - beta1**step))
