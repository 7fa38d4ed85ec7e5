"""What every hook shares: the state lifecycle and the bucket's side of the compressed exchanges.

- ``state.py``: :class:`HookState` (binding to a model, step accounting, the dense allreduce, pickling).
- ``compression.py``: :class:`CompressionState` and ``run_compressed``, the common body of the
  compressing hooks; ``twophase.py`` and ``rounds.py`` give a bucket to the exchanges of
  :mod:`fastcomm.collectives` (residuals, buffers, seeds, accounting) and decide where the second
  collective is issued.
- ``store.py``, ``buffers.py``, ``accounting.py``: per-bucket residuals (staged, inherited across bucket
  rebuilds, checkpointed), reusable wire buffers, traffic and timing statistics.
- ``reshard.py``: merging states across world sizes; ``names.py``: the one table of hook names;
  ``registered.py``, ``defaults.py``, ``options.py``, ``util.py``: small helpers.

Internal: the public names are re-exported by :mod:`fastcomm.hooks`.
"""
