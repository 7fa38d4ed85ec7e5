"""Reading and checking the comm hooks registered on a DDP model (shared by every integration)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fastcomm.hooks.engine.registered import known_hooks, refuse_second_hook

__all__ = ["comm_hook_state", "find_ddp", "refuse_second_hook", "registered_comm_hooks"]


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` wrapper of ``model``, looking through ``torch.compile``'s wrapper.

    Args:
        model: a model as a framework hands it back (DDP, or a compiled DDP, or a plain module).

    Returns:
        The DDP wrapper, or ``None`` when ``model`` is not DDP-wrapped.

    Example::

        ddp = find_ddp(accelerator.prepare(model))
    """
    seen = 0
    while not isinstance(model, DistributedDataParallel):
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule keeps the module here
        if not isinstance(inner, nn.Module) or seen > 8:
            return None
        model, seen = inner, seen + 1
    return model


def registered_comm_hooks(ddp: DistributedDataParallel) -> list[tuple[Callable[..., Any], object]]:
    """The ``(hook, state)`` pairs registered on ``ddp`` with ``register_comm_hook``, in order.

    DDP keeps them in its ``_comm_hooks`` list (every torch that fastcomm supports, 2.4 and later); a
    built-in hook registered from C++ (``_register_builtin_comm_hook``) is not listed there.

    Raises:
        TypeError: ``ddp`` is not a DistributedDataParallel model.
        RuntimeError: this torch's DDP does not expose its hooks, so nothing can be told.

    Example::

        [hook.__name__ for hook, _ in registered_comm_hooks(ddp)]  # ['topk_hook']
    """
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"expected a DistributedDataParallel model, got {type(ddp).__name__}")
    hooks = known_hooks(ddp)
    if hooks is None:
        raise RuntimeError(
            "this torch's DistributedDataParallel has no _comm_hooks list, so its registered hooks cannot be "
            "read; check state.stats()['compressed_buckets'] after a step instead"
        )
    return hooks


def comm_hook_state(model: nn.Module) -> object | None:
    """The state of the fastcomm hook registered on ``model``'s DDP wrapper, or ``None`` if there is none.

    Use it to check that a framework setting really registered a hook: ``None`` means DDP reduces with
    its own dense allreduce (or with a hook that is not fastcomm's).

    Args:
        model: a DDP model, or a ``torch.compile`` of one.

    Raises:
        TypeError: ``model`` is not DDP-wrapped.
        RuntimeError: this torch's DDP does not expose its hooks.

    Example::

        assert comm_hook_state(model) is not None, "no fastcomm hook on this model"
    """
    ddp = find_ddp(model)
    if ddp is None:
        raise TypeError(f"expected a DistributedDataParallel model, got {type(model).__name__}")
    return next((state for hook, state in registered_comm_hooks(ddp) if _is_fastcomm(hook)), None)


def _is_fastcomm(hook: Callable[..., Any]) -> bool:
    return str(getattr(hook, "__module__", "")).startswith("fastcomm.")
