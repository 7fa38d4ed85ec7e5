"""A Lightning callback (``pytorch_lightning`` package) that registers a fastcomm hook on the DDP model.

The same callback as :mod:`fastcomm.integrations.lightning`, on the ``pytorch_lightning`` package's
``Callback`` base (each package's Trainer accepts only its own callbacks).

Example::

    import pytorch_lightning as pl
    from fastcomm.integrations.pytorch_lightning import CommHook

    comm = CommHook("sign")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[comm])
    trainer.fit(model)
    print(comm.state.stats())
"""

from __future__ import annotations

from fastcomm.integrations._callback import CommHookLogic, callback_base

Callback = callback_base("pytorch_lightning", "pytorch_lightning", "lightning")

__all__ = ["CommHook"]


class CommHook(CommHookLogic, Callback):
    __doc__ = CommHookLogic.__doc__
