"""The loader's pipeline: which samples each rank reads, in which order and batches, epoch after epoch.

One module per question, each handed its part of the loader's settings:

- :mod:`~fastio.pipeline.arguments`: DataLoader's keyword arguments, checked with DataLoader's own rules.
- :mod:`~fastio.pipeline.settings`: what a :class:`fastio.StreamLoader` was asked, checked once and grouped
  by the part that uses it (:class:`~fastio.pipeline.settings.OrderSettings`,
  :class:`~fastio.pipeline.settings.WorkerSettings`, :class:`~fastio.pipeline.settings.AssemblySettings`).
- :mod:`~fastio.pipeline.order`: the epoch's global sample order (seed, epoch, shuffle mode), its split
  across ranks and the resume arithmetic.
- :mod:`~fastio.pipeline.batches`: how an epoch is cut into batches (the :class:`~fastio.pipeline.batches.
  Batches` protocol the loader delegates to) and its state dict.
- :mod:`~fastio.pipeline.sampled`: the same, when DataLoader's ``sampler=``/``batch_sampler=`` decide.
- :mod:`~fastio.pipeline.epoch`: one pass over an epoch: the source prepared, a batch producer run by
  workers, batches handed over in order (or as they are ready).
- :mod:`~fastio.pipeline.spawn`: what a worker process started by ``"spawn"``/``"forkserver"`` opens.

Beside it: how one batch is made (:mod:`fastio.assembly`), who makes it (:mod:`fastio.workers`), weighted
streams (:mod:`fastio.mixing`, whose batches are :mod:`~fastio.pipeline.batches`' with a mixed order).
This package imports none of its modules, so a lower layer may import one of them (``fastio.remote``
uses :mod:`~fastio.pipeline.order`) without loading the rest.

Example::

    from fastio.pipeline.order import epoch_order, rank_indices

    order = epoch_order([13] * 9, seed=0, epoch=3, shuffle=True)
    mine = rank_indices(order, start=0, world_size=4, rank=1, drop_last=False)
"""

__all__: list[str] = []
