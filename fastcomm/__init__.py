"""fastcomm: compressed collectives for PyTorch training: DDP comm hooks, FSDP2/HSDP and DiLoCo.

One set of compressors (:mod:`fastcomm.compress`, named by :func:`compressor`: ``"topk"``, ``"quantize"``,
``"sign"``, ``"cast"``, ``"powersgd"``) serves three ways of training across ranks:

- DDP: :func:`register` installs a compressing comm hook (:mod:`fastcomm.hooks`, flat or two-level);
- FSDP2 and HSDP: ``fastcomm.fsdp.compress(model, ...)`` after ``fully_shard`` (:mod:`fastcomm.fsdp`);
- DiLoCo: :class:`DiLoCo` averages compressed pseudo-gradients every ``sync_every`` steps.

The compressed all-reduce, reduce-scatter and all-gather beneath them are :mod:`fastcomm.collectives`;
:func:`backend` says which kernels run. Its sibling package ``fastio`` is the data loader.

``fastcomm.hooks`` (and the names it gives: :func:`register`, the states and hooks), ``fastcomm.fsdp``,
``fastcomm.integrations`` and ``fastcomm.advise`` are imported on first use: an FSDP or DiLoCo job never
loads the DDP hooks, and a DDP job never loads FSDP2's DTensor.

Example::

    import fastcomm
    state = fastcomm.register(ddp_model, "quantize", bits=8)               # DDP
    compression = fastcomm.fsdp.compress(fsdp_model, "quantize", bits=8)   # FSDP2 / HSDP
    outer = fastcomm.DiLoCo(model, inner_optimizer, compressor="quantize", bits=4)
    q4 = fastcomm.compressor("quantize", bits=4)                           # the compressor itself
"""

import importlib
from typing import TYPE_CHECKING, Any

from fastcomm import collectives, compress, fault, ops
from fastcomm.checkpoint import Checkpointer, CheckpointError
from fastcomm.collectives.errors import PeerCollectiveError
from fastcomm.compress.registry import add_compressor, compressor
from fastcomm.diloco import DiLoCo, outer_lr_ramp
from fastcomm.ops import backend
from fastcomm.optim import CompressedAdam

if TYPE_CHECKING:
    from fastcomm import advise, fsdp, hooks, integrations
    from fastcomm.hooks import (
        AutoState,
        CastState,
        HookName,
        PowerSGDState,
        QuantState,
        SignState,
        TopKState,
        auto_hook,
        cast_hook,
        powersgd_hook,
        quantize_hook,
        register,
        sign_hook,
        topk_hook,
    )

# Imported on first use. fastcomm.fsdp imports torch.distributed.fsdp and DTensor (~0.9 s of CPU), which a
# DDP job never needs; fastcomm.hooks brings the DDP hooks, the advisor and CompressedAdam's hook, which
# FSDP and DiLoCo jobs never need.
_LAZY_MODULES = frozenset({"advise", "fsdp", "ft", "hooks", "integrations"})
_FROM_HOOKS = frozenset(
    {
        "AutoState",
        "CastState",
        "HookName",
        "PowerSGDState",
        "QuantState",
        "SignState",
        "TopKState",
        "auto_hook",
        "cast_hook",
        "powersgd_hook",
        "quantize_hook",
        "register",
        "sign_hook",
        "topk_hook",
    }
)


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(f"fastcomm.{name}")
    if name in _FROM_HOOKS:
        value = getattr(importlib.import_module("fastcomm.hooks"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fastcomm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AutoState",
    "CastState",
    "CheckpointError",
    "Checkpointer",
    "CompressedAdam",
    "DiLoCo",
    "HookName",
    "PeerCollectiveError",
    "PowerSGDState",
    "QuantState",
    "SignState",
    "TopKState",
    "add_compressor",
    "advise",
    "auto_hook",
    "backend",
    "cast_hook",
    "collectives",
    "compress",
    "compressor",
    "fault",
    "fsdp",
    "hooks",
    "integrations",
    "ops",
    "outer_lr_ramp",
    "powersgd_hook",
    "quantize_hook",
    "register",
    "sign_hook",
    "topk_hook",
]
