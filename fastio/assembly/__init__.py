"""How one batch is made, in one place. A sample batch (:mod:`~fastio.assembly.producer`) is the source's
gather into reused buffers, then the :class:`~fastio.assembly.stages.BatchStage` steps in order (the image
pipeline, :mod:`~fastio.assembly.image` with :mod:`~fastio.assembly.crop`), then the Python path
(``transform`` per sample, ``collate``: :mod:`~fastio.assembly.collate`), then the copy to the device, with
the user's code seeded from ``(seed, epoch, sample)`` around them (:mod:`~fastio.assembly.seeding`).
Packing (:mod:`~fastio.assembly.pack`: its options :mod:`~fastio.assembly.pack_options`, its row plan
:mod:`~fastio.assembly.pack_rows`, its batch fill :mod:`~fastio.assembly.pack_fill`) is the other way to
make a batch: fixed-length rows cut from the token stream of many samples.

Which of the two a loader uses is chosen once, in :mod:`fastio.pipeline.batches`; who runs them (threads,
processes, the consumer) is :mod:`fastio.workers`.
"""
