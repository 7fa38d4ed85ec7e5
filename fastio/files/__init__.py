"""Local files, below every format: the paths a pattern names and where fastio keeps local copies
(:mod:`~fastio.files.paths`), whole files mapped read-only (:mod:`~fastio.files.mapped`), and the gathers
that copy rows and byte ranges out of them into a batch's buffers (:mod:`~fastio.files.gather`, native when
:mod:`fastio._native` loaded the kernels). This package imports none of its modules.

Example::

    from fastio.files.mapped import MappedFile, MappedTable

    table = MappedTable([MappedFile("data/train/shard-000000.fio")])
"""

__all__: list[str] = []
