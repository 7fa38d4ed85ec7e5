"""A Lightning callback (``lightning`` package) that registers a fastcomm hook on the DDP model.

``DDPStrategy(ddp_comm_hook=...)`` registers nothing unless the model is on CUDA; this callback registers
at ``on_fit_start``, once the strategy has built the DDP wrapper, on any device.

Example::

    import lightning.pytorch as L
    from fastcomm.integrations.lightning import CommHook

    comm = CommHook("topk", ratio=0.01)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[comm])
    trainer.fit(model)
    print(comm.state.stats())
"""

from __future__ import annotations

from fastcomm.integrations._callback import CommHookLogic, callback_base

Callback = callback_base("lightning.pytorch", "lightning", "pytorch_lightning")

__all__ = ["CommHook"]


class CommHook(CommHookLogic, Callback):
    __doc__ = CommHookLogic.__doc__
