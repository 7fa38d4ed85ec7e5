"""Registering fastcomm hooks on models that Accelerate or Lightning wrap in DDP, and checking they took.

Both frameworks build the ``DistributedDataParallel`` wrapper themselves, and both have a setting that looks
as if it took a custom hook but silently registers nothing: Accelerate's
``DistributedDataParallelKwargs(comm_hook=...)`` only knows its own enum of torch's hooks, and Lightning's
``DDPStrategy(ddp_comm_hook=...)`` registers only on CUDA. The supported ways register on the wrapper once
it exists:

- Accelerate: :func:`register_accelerate` on the model ``accelerator.prepare`` returned (or
  ``fastcomm.register`` on it directly: it is the DDP wrapper in a multi-process run).
- Lightning: the callback ``fastcomm.integrations.lightning.CommHook`` (``lightning`` package) or
  ``fastcomm.integrations.pytorch_lightning.CommHook`` (``pytorch_lightning`` package).

:func:`comm_hook_state` tells whether a DDP model really has a fastcomm hook registered.

Example::

    from fastcomm.integrations import register_accelerate
    model, optimizer = accelerator.prepare(model, optimizer)
    state = register_accelerate(accelerator, model, "topk", ratio=0.01)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist
from torch import nn

from fastcomm.hooks import register
from fastcomm.integrations._ddp import comm_hook_state, find_ddp, refuse_second_hook, registered_comm_hooks

__all__ = ["comm_hook_state", "find_ddp", "register_accelerate", "registered_comm_hooks"]


def register_accelerate(accelerator: Any, model: nn.Module, name: Any, **options: Any) -> Any:
    """Register a fastcomm hook on the DDP wrapper of a model that ``accelerator.prepare`` returned.

    1. Warn if the accelerator's ``DistributedDataParallelKwargs`` carries a ``comm_hook`` that Accelerate
       does not know (a fastcomm hook there is silently ignored by Accelerate).
    2. Find the DDP wrapper (through ``torch.compile``). In a one-process run Accelerate does not wrap the
       model and there is no gradient communication: warn and return ``None``. A model without DDP is an
       error when ``torch.distributed`` has more than one rank, whatever Accelerate reports: on CPU a plain
       ``Accelerator()`` under ``torchrun`` reports one process (distributed type ``NO``) while the ranks
       exist, and each would train on its own gradients. It is an error too in a multi-process run (not the
       prepared model, or FSDP/DeepSpeed, which take no DDP hooks).
    3. Refuse a model that already has a comm hook (DDP allows one), naming it.
    4. ``fastcomm.register(ddp, name, **options)``.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: what ``accelerator.prepare(model)`` returned.
        name: as for :func:`fastcomm.register`: ``"topk"``, ``"quantize"``, ``"sign"``, ``"cast"``, a
            compressor (``fastcomm.compressor(...)``), a state, or a ``fastcomm.CompressedAdam``.
        **options: as for :func:`fastcomm.register`.

    Returns:
        The hook's state (for ``stats()`` and ``state_dict()``), or ``None`` in a one-process run.

    Raises:
        RuntimeError: ``torch.distributed`` has several ranks but Accelerate reports one process (on CPU:
            construct ``Accelerator(cpu=True)``).
        TypeError: a multi-process run whose ``model`` is not DDP-wrapped.
        ValueError: the model already has a comm hook.

    Example::

        accelerator = Accelerator(cpu=True)  # on CPU; Accelerator() where the ranks have GPUs
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        state = register_accelerate(accelerator, model, "topk", ratio=0.01)
    """
    handler = getattr(accelerator, "ddp_handler", None)
    if handler is not None and callable(getattr(handler, "comm_hook", None)):
        hook_name = getattr(handler.comm_hook, "__name__", repr(handler.comm_hook))
        warnings.warn(
            f"DistributedDataParallelKwargs(comm_hook={hook_name}) is ignored by Accelerate (it registers "
            "only its own DDPCommunicationHookType values); register_accelerate registers the hook instead",
            stacklevel=2,
        )
    ddp = find_ddp(model)
    if ddp is None:
        processes = int(getattr(accelerator, "num_processes", 1))
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if processes <= 1 < ranks:
            kind = getattr(accelerator, "distributed_type", "?")
            raise RuntimeError(
                f"register_accelerate: torch.distributed has {ranks} ranks but Accelerate reports "
                f"{processes} process (distributed type {kind}), so it did not wrap the model in DDP and "
                f"each rank would train on its own gradients, unsynchronized. "
                f"On CPU construct the accelerator as Accelerator(cpu=True) (a plain Accelerator() without "
                f"GPUs sees one process under torchrun), then prepare the model again"
            )
        if processes <= 1:
            warnings.warn(
                "register_accelerate: one process, so Accelerate did not wrap the model in DDP and no "
                "gradients are communicated; no hook registered",
                stacklevel=2,
            )
            return None
        raise TypeError(
            f"register_accelerate needs the DDP model that accelerator.prepare returned; got "
            f"{type(model).__name__} in a {processes}-process run (distributed type "
            f"{getattr(accelerator, 'distributed_type', '?')}); FSDP and DeepSpeed take no DDP comm hooks"
        )
    refuse_second_hook(ddp)
    return register(ddp, name, **options)
