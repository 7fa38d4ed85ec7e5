"""fastio's own columnar shard format: a directory of ``shard-NNNNNN.fio`` files and an ``index.json``.

* :mod:`~fastio.format.shards.layout`: the byte layout of a shard file.
* :mod:`~fastio.format.shards.schema`: fields, their kinds and the schema's JSON form.
* :mod:`~fastio.format.shards.writer`: :class:`ShardWriter`.
* :mod:`~fastio.format.shards.reader`: :class:`ShardReader` (one file) and :class:`ShardSet` (a directory).
* :mod:`~fastio.format.shards.source`: :class:`ShardSource`, the directory as a batch source.
* :mod:`~fastio.format.shards.remote`: :class:`RemoteShardSource`, a directory at a URL, read through the
  node-local cache of :mod:`fastio.remote`.

Its row in :mod:`fastio.registry` is ``"fastio-shards"``.
"""
