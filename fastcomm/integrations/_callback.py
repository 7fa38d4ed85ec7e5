"""What the Lightning callbacks do, written once for the ``lightning`` and ``pytorch_lightning`` packages.

Each package's Trainer accepts only its own ``Callback`` class, so each integration module defines
``class CommHook(CommHookLogic, Callback)`` with its package's base; the behaviour lives here.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from fastcomm.hooks import HookName, register
from fastcomm.hooks.registry import build_state
from fastcomm.integrations._ddp import comm_hook_state, find_ddp, refuse_second_hook

__all__ = ["CommHookLogic", "callback_base"]


def callback_base(module: str, package: str, other: str) -> type:
    """``module.Callback``, or an ``ImportError`` naming ``package`` (and ``other``, its alternative)."""
    try:
        return importlib.import_module(module).Callback
    except ImportError as exc:
        raise ImportError(
            f"fastcomm.integrations.{package} needs the '{package}' package (pip install {package}); "
            f"with the '{other}' package use fastcomm.integrations.{other}"
        ) from exc


class CommHookLogic:
    """Register a fastcomm hook on the Trainer's DDP model at fit start, and check it ran at the first step.

    1. At construction, a hook name with options builds its state (a bad option raises ``ValueError`` here,
       before any process starts); a state object or a ``fastcomm.CompressedAdam`` is kept as given.
    2. ``on_fit_start`` (after the strategy wrapped the model in DDP): register the hook on
       ``trainer.strategy.model``. One process: warn and do nothing (no gradients are communicated). Several
       processes without a DDP model (FSDP, DeepSpeed): ``TypeError``. A hook already there: ``ValueError``.
    3. ``on_before_optimizer_step``, once: the model being trained still carries this hook and the hook has
       run; otherwise ``RuntimeError`` (the DDP model was replaced after fit start).

    Args:
        name: ``"topk"``, ``"quantize"``, ``"sign"``, ``"cast"``, a compressor (``fastcomm.compressor(...)``),
            a hook state, or a ``fastcomm.CompressedAdam`` (as for :func:`fastcomm.register`).
        **options: the state's options (for a name) or ``register``'s options (for an optimizer).

    Example::

        from fastcomm.integrations.lightning import CommHook  # or .pytorch_lightning

        comm = CommHook("topk", ratio=0.01)
        trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[comm])
        trainer.fit(model)
        print(comm.state.stats()["compression_ratio"])
    """

    def __init__(self, name: Any, **options: Any) -> None:
        if isinstance(name, (str, HookName)):
            self._target: Any = build_state(name, options)[0]
            self._options: dict[str, Any] = {}
        else:
            self._target, self._options = name, options
        self.state: Any = None
        self._checked = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        model = trainer.strategy.model
        ddp = find_ddp(model) if model is not None else None
        if ddp is None:
            if int(trainer.world_size) <= 1:
                warnings.warn(
                    f"{type(self).__name__}: one process, so the model is not DDP-wrapped and no gradients "
                    "are communicated; no hook registered",
                    stacklevel=2,
                )
                return
            raise TypeError(
                f"{type(self).__name__} needs a DDP strategy (strategy='ddp', 'ddp_spawn' or DDPStrategy); "
                f"{type(trainer.strategy).__name__} trains a {type(model).__name__}, which takes no DDP hooks"
            )
        refuse_second_hook(ddp)  # each fit wraps the module in a new DDP: a second fit registers again
        self.state = register(ddp, self._target, **self._options)
        self._checked = False

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._checked or self.state is None:
            return
        self._checked = True
        ddp = find_ddp(trainer.strategy.model)
        if ddp is None or comm_hook_state(ddp) is not self.state:
            raise RuntimeError(
                f"{type(self).__name__}: the model being trained is not the DDP model the hook was "
                "registered on at fit start (something re-wrapped it): gradients go through dense allreduce"
            )
        stats = self.state.stats() if callable(getattr(self.state, "stats", None)) else {}
        calls = stats.get("compressed_buckets", 0) + stats.get("dense_buckets", 0)
        if "compressed_buckets" in stats and calls == 0:
            raise RuntimeError(
                f"{type(self).__name__}: the hook is registered but did not run during the first backward"
            )
