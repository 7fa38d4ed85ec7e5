"""fastcomm: gradient compression for DDP as communication hooks.

Example::

    import fastcomm
    state = fastcomm.register(ddp_model, "topk", ratio=0.01)
"""

import importlib
from typing import TYPE_CHECKING

from fastcomm import collectives, compress, fault, integrations, ops
from fastcomm.checkpoint import Checkpointer, CheckpointError
from fastcomm.diloco import DiLoCo, outer_lr_ramp
from fastcomm.hooks import (
    AutoState,
    CastState,
    HookName,
    PeerCollectiveError,
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
from fastcomm.ops import backend
from fastcomm.optim import CompressedAdam

if TYPE_CHECKING:
    from fastcomm import fsdp

# Imported on first use: fastcomm.fsdp imports torch.distributed.fsdp and DTensor (~0.9 s of CPU), which a
# DDP job never needs and every rank of every job would otherwise pay at start-up.
_LAZY = {"fsdp"}


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f"fastcomm.{name}")
    raise AttributeError(f"module 'fastcomm' has no attribute {name!r}")

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
    "auto_hook",
    "backend",
    "cast_hook",
    "collectives",
    "compress",
    "fault",
    "fsdp",
    "integrations",
    "ops",
    "outer_lr_ramp",
    "powersgd_hook",
    "quantize_hook",
    "register",
    "sign_hook",
    "topk_hook",
]
