""":func:`register`: one call that builds a state and registers its hook on a DDP model.

The hook names it knows are one table, :data:`HOOKS` (``fastcomm.hooks.engine.names``), re-exported here
with :class:`HookName`; compressor names are :mod:`fastcomm.compress.registry`'s, whose
:func:`add_compressor` and :func:`compressor_of` are re-exported here as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from fastcomm.compress.protocol import AllreduceCompressor, Compressor
from fastcomm.compress.registry import add_compressor, compressor_of
from fastcomm.hooks.engine.names import HOOKS, HookName, Registered, build_state, hook_of
from fastcomm.hooks.engine.registered import refuse_second_hook
from fastcomm.hooks.engine.state import HookState
from fastcomm.hooks.momentum import register_optimizer
from fastcomm.optim import CompressedAdam

__all__ = [
    "HOOKS",
    "HookName",
    "Registered",
    "add_compressor",
    "build_state",
    "compressor_of",
    "hook_of",
    "register",
]


def register(
    ddp: DistributedDataParallel,
    name: str | HookName | HookState | Compressor | AllreduceCompressor | torch.optim.Optimizer,
    **options: Any,
) -> Any:
    """Build the named hook's state from ``options``, bind it to ``ddp``'s model and register the hook.

    1. Resolve ``name``: a row of :data:`HOOKS` (a :class:`HookName` or its string value, or a compressor
       added by :func:`add_compressor`); a compressor object (``fastcomm.compressor("cast")``), served by
       ``compressor_hook``; an existing state object; or a :class:`~fastcomm.CompressedAdam`, whose
       compressed-momentum hook is registered (``options`` are then ``grad_scaler=`` and
       ``process_group=``).
    2. Build the state (``ValueError`` for a bad option) or take the given one.
    3. Bind the state to the model's parameters (``ValueError`` if it already serves another model).
    4. ``ddp.register_comm_hook(state, hook)`` (``ValueError`` naming the hook ``ddp`` already has).

    Args:
        ddp: the DistributedDataParallel model.
        name: ``"topk"``, ``"quantize"``, ``"sign"``, ``"cast"``, ``"powersgd"``, ``"auto"``, another name
            in :data:`HOOKS`, a compressor object, a state to register as is, or a
            ``fastcomm.CompressedAdam``.
        **options: the state's constructor arguments (not allowed with a state object); for a compressor
            added by name, the :class:`~fastcomm.hooks.CompressorState` options and the compressor's own;
            for a compressor object, the ``CompressorState`` options.

    Returns:
        The state, for ``stats()``, ``state_dict()`` and checkpoints.

    Example::

        state = fastcomm.register(ddp, "topk", ratio=0.01, start_iter=10)
        # or any compressor through compressor_hook (two-phase exchange, error feedback, node_size):
        # state = fastcomm.register(ddp, fastcomm.compressor("cast"), node_size=8)
        ...
        print(state.stats()["compression_ratio"])
    """
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"register needs a DistributedDataParallel model, got {type(ddp).__name__}")
    if isinstance(name, torch.optim.Optimizer):
        if not isinstance(name, CompressedAdam):
            raise TypeError(f"register takes a fastcomm.CompressedAdam optimizer, got {type(name).__name__}")
        refuse_second_hook(ddp)
        return register_optimizer(ddp, name, **options)
    if isinstance(name, HookState):
        if options:
            raise TypeError("options cannot be given together with a state object")
        state, hook = name, hook_of(name)
    elif isinstance(name, (str, HookName)):
        state, hook = build_state(name, options)
    elif isinstance(name, (Compressor, AllreduceCompressor)):
        state, hook = build_state(HookName.COMPRESSOR, dict(compressor=name, **options))
    else:
        raise TypeError(
            f"register takes a hook's name, a compressor, a hook state or a fastcomm.CompressedAdam, got "
            f"{type(name).__name__}"
        )
    refuse_second_hook(ddp)
    state.bind(ddp.module)
    ddp.register_comm_hook(state, hook)
    return state
