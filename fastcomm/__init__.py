"""fastcomm: gradient compression for DDP as communication hooks.

Example::

    import fastcomm
    state = fastcomm.register(ddp_model, "topk", ratio=0.01)
"""

from fastcomm import collectives, compress, fault, fsdp, integrations, ops
from fastcomm.checkpoint import Checkpointer, CheckpointError
from fastcomm.diloco import DiLoCo
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
    "powersgd_hook",
    "quantize_hook",
    "register",
    "sign_hook",
    "topk_hook",
]
