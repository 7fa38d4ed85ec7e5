"""The comm hooks already registered on a DDP model: read them, and refuse a second one by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel

__all__ = ["known_hooks", "refuse_second_hook"]


def known_hooks(ddp: DistributedDataParallel) -> list[tuple[Callable[..., Any], object]] | None:
    """The ``(hook, state)`` pairs in DDP's ``_comm_hooks`` list, or ``None`` where this torch has none."""
    hooks = getattr(ddp, "_comm_hooks", None)
    return list(hooks) if isinstance(hooks, list) else None


def refuse_second_hook(ddp: DistributedDataParallel) -> None:
    """Raise ``ValueError`` naming the hook already on ``ddp`` (DDP's own error does not name it).

    Example::

        refuse_second_hook(ddp)  # ValueError: ... already has a comm hook registered (topk_hook) ...
    """
    hooks = known_hooks(ddp) or []
    if hooks:
        names = ", ".join(getattr(hook, "__qualname__", repr(hook)) for hook, _ in hooks)
        raise ValueError(
            f"this DDP model already has a comm hook registered ({names}); DDP takes one hook per model, so "
            "register fastcomm's instead of, not beside, it"
        )
