"""The :mod:`fastcomm.integrations.lightning` callback for the ``pytorch_lightning`` package.

Each package's Trainer accepts only callbacks built on its own ``Callback`` class, so this module gives the
same ``CommHook`` on ``pytorch_lightning.Callback``. Example: ``pl.Trainer(strategy="ddp",
callbacks=[CommHook("sign")])`` after ``import pytorch_lightning as pl`` and
``from fastcomm.integrations.pytorch_lightning import CommHook``.
"""

from __future__ import annotations

from fastcomm.integrations._callback import CommHookLogic, callback_base

Callback = callback_base("pytorch_lightning", "pytorch_lightning", "lightning")

__all__ = ["CommHook"]


class CommHook(CommHookLogic, Callback):
    __doc__ = CommHookLogic.__doc__
