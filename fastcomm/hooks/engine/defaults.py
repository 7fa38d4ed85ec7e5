"""The per-model default states of hooks registered with ``state=None``, found through bucket parameters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from fastcomm.hooks.engine.state import HookState

__all__ = ["default_state", "resolve_state"]

# state class -> (parameter -> the default state serving its model); the last default made per class
_DEFAULT_STATES: dict[type, WeakIdKeyDictionary] = {}
_LAST_NEW_DEFAULT: dict[type, HookState] = {}


def resolve_state(state: HookState | None, bucket: dist.GradBucket, cls: type) -> HookState:
    """The state to use for a hook call: ``state`` itself, or the per-model default when it is ``None``.

    ``ddp.register_comm_hook(None, hook)`` gives hooks no state, so defaults are found through the bucket's
    parameters: a parameter seen before leads to its model's state. A bucket of unseen parameters is either
    bucket 0 of a model's first iteration (a new default state) or a later bucket of that same first
    iteration (DDP reduces buckets in index order), which joins the state started at bucket 0. Two models
    whose *first* backward passes interleave cannot be told apart this way: use ``fastcomm.register``.

    Raises:
        TypeError: ``state`` is not a ``cls``.
    """
    if state is not None:
        if not isinstance(state, cls):
            raise TypeError(f"this hook needs a {cls.__name__} (or None), got {type(state).__name__}")
        return state
    owners = _DEFAULT_STATES.setdefault(cls, WeakIdKeyDictionary())
    params = bucket.parameters()
    found = next((owners[p] for p in params if p in owners), None)
    if found is None:
        if bucket.index() == 0 or cls not in _LAST_NEW_DEFAULT:
            _LAST_NEW_DEFAULT[cls] = cls()
        found = _LAST_NEW_DEFAULT[cls]
    for param in params:
        owners[param] = found
    return found


def default_state(model: torch.nn.Module, cls: type) -> HookState | None:
    """The state a hook registered with ``state=None`` made for ``model`` (a DDP model or its module).

    Args:
        model: the DDP model, or the module it wraps.
        cls: the hook's state class, e.g. ``fastcomm.TopKState``.

    Returns:
        The state, or ``None`` before the hook first ran for this model.

    Example::

        ddp.register_comm_hook(None, fastcomm.topk_hook)
        ...  # after a backward pass
        print(fastcomm.hooks.default_state(ddp, fastcomm.TopKState).stats())
    """
    module = getattr(model, "module", model)
    owners = _DEFAULT_STATES.get(cls)
    if owners is None:
        return None
    return next((owners[p] for p in module.parameters() if p in owners), None)
