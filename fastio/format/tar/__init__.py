"""WebDataset tar shards, read in place: a sample is the members that share a key (``a/b.jpg``,
``a/b.cls`` -> key ``a/b``, fields ``jpg`` and ``cls``).

* :mod:`~fastio.format.tar.scan`: one pass over a tar's headers (C++ ``csrc/io/tar_scan.cpp``, or its
  Python twin).
* :mod:`~fastio.format.tar.index`: the sidecar index (``<shard>.fidx``) and :class:`TarShardSet`, the
  indexed, memory-mapped shards of a pattern.
* :mod:`~fastio.format.tar.decode`: member bytes to values, by extension.
* :mod:`~fastio.format.tar.source`: :class:`TarSource`, the shards as a batch source, and the field layout
  decided once per set.
* :mod:`~fastio.format.tar.compression`: ``.tar.gz``/``.tgz``/``.tar.zst``/``.tar.zstd``: the one suffix
  list, the codecs, streaming decompression.
* :mod:`~fastio.format.tar.compressed`: local compressed tars, decompressed once into a local directory and
  read as plain tars.
* :mod:`~fastio.format.tar.remote`: :class:`RemoteTarSource`, tars (plain or compressed) at URLs, read
  through the node-local cache of :mod:`fastio.remote`.

Its rows in :mod:`fastio.registry` are ``"compressed-tar"`` and ``"webdataset-tar"``.
"""
