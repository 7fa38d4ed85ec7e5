"""The optimizer and communication of ``train_lm.py``: an optimizer by name, a hook registered on DDP (or
a compressor on FSDP2), DiLoCo's arguments, and the learning-rate schedule.

Optimizers (:data:`OPTIMIZERS`): ``adamw`` (lr 2e-3, betas (0.9, 0.95), weight decay 0.1), ``sgd`` (lr
0.1, momentum 0.9), ``sgd_nomomentum`` (for a hook that applies the momentum itself),
``compressed_adam`` (``fastcomm.CompressedAdam``, which registers its own hook) and ``diloco`` (AdamW
inner steps in ``fastcomm.DiLoCo``, no DDP). Hooks: a :func:`fastcomm.register` name, ``torch_fp16``
(torch's own ``fp16_compress_hook``), ``noop`` (no communication at all: the compute floor, for timing)
or ``none`` (DDP's dense allreduce).

Example::

    from lm_optim import build_ddp, lr_factor

    optimizer, state = build_ddp("adamw", "sign", ddp, lr=2e-3, options={})
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, 30, 500))
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fastcomm

__all__ = [
    "BASE_LR",
    "BETAS",
    "OPTIMIZERS",
    "WEIGHT_DECAY",
    "build_ddp",
    "build_fsdp",
    "diloco_arguments",
    "fsdp_unavailable",
    "lr_factor",
]

BASE_LR = {"adamw": 2e-3, "compressed_adam": 2e-3, "diloco": 2e-3, "sgd": 0.1, "sgd_nomomentum": 0.1}
OPTIMIZERS = tuple(BASE_LR)  # sgd: momentum 0.9; sgd_nomomentum: for a hook that applies momentum itself
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1


def _noop_hook(state, bucket):  # type: ignore[no-untyped-def]
    # Unannotated: DDP compares a hook's annotations with the real classes, and this module's annotations
    # are strings (postponed), which it would refuse.
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def build_ddp(
    optimizer_name: str, hook: str, ddp: DistributedDataParallel, lr: float, options: dict[str, Any]
) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer over ``ddp``'s parameters and the state of the hook registered on it (None when the
    hook keeps none).

    Example::

        optimizer, state = build_ddp("adamw", "quantize", DistributedDataParallel(model), 2e-3, {"bits": 8})
    """
    params = list(ddp.parameters())
    if optimizer_name == "compressed_adam":  # it registers its own hook
        kwargs = {"lr": lr, "betas": BETAS, "weight_decay": WEIGHT_DECAY, **options}
        optimizer = fastcomm.CompressedAdam(params, **kwargs)
        return optimizer, fastcomm.register(ddp, optimizer)
    if optimizer_name == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY
        )
    elif optimizer_name in ("sgd", "sgd_nomomentum"):
        optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9 if optimizer_name == "sgd" else 0.0)
    else:
        raise ValueError(f"unknown optimizer {optimizer_name!r}")
    if hook == "none":
        return optimizer, None
    if hook == "noop":
        ddp.register_comm_hook(None, _noop_hook)
        return optimizer, None
    if hook == "torch_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return optimizer, None
    return optimizer, fastcomm.register(ddp, hook, **options)


# Under FSDP2 the hook is a compressor name of fastcomm.fsdp.compress, its options the compressor's
_FSDP_HOOKS = ("quantize", "sign", "cast")


def fsdp_unavailable(optimizer: str, hook: str) -> str | None:
    """Why ``optimizer`` with ``hook`` cannot run under FSDP2 (``--fsdp``), or None: dense, or AdamW/SGD
    with a hook that is a compressor of :func:`fastcomm.fsdp.compress`.

    Example::

        fsdp_unavailable("adamw", "topk")  # "its hook 'topk' is not a compressor of fastcomm.fsdp (...)"
    """
    if optimizer not in ("adamw", "sgd"):
        return f"its optimizer {optimizer!r} has no FSDP2 form here (AdamW or SGD only)"
    if hook != "none" and hook not in _FSDP_HOOKS:
        return f"its hook {hook!r} is not a compressor of fastcomm.fsdp ({', '.join(_FSDP_HOOKS)})"
    return None


def build_fsdp(
    optimizer_name: str, hook: str, model: nn.Module, lr: float, options: dict[str, Any]
) -> tuple[torch.optim.Optimizer, Any]:
    """Shard ``model`` with FSDP2 (every block, then the root), compress its gradient reduce-scatter with
    the method's compressor (none: dense FSDP2), and build the optimizer over the sharded parameters."""
    from torch.distributed.fsdp import fully_shard

    import fastcomm.fsdp

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    compression = None if hook == "none" else fastcomm.fsdp.compress(model, hook, **options)
    params = list(model.parameters())
    if optimizer_name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY), compression
    return torch.optim.SGD(params, lr=lr, momentum=0.9), compression


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def diloco_arguments(options: dict[str, Any]) -> dict[str, Any]:
    """DiLoCo's keyword arguments from a method's options: ``outer_lr_ramp=[start, end, hold, until]``
    (a list, so that the options stay JSON) becomes ``outer_lr=fastcomm.outer_lr_ramp(...)``.

    Example::

        ramped = {"sync_every": 10, "outer_lr_ramp": [0.5, 1.0, 100, 500]}
        fastcomm.DiLoCo(model, inner, **diloco_arguments(ramped))
    """
    arguments = dict(options)
    ramp = arguments.pop("outer_lr_ramp", None)
    if ramp is not None:
        start, end, hold, until = ramp
        arguments["outer_lr"] = fastcomm.outer_lr_ramp(start, end, hold=hold, until=until)
    return arguments
