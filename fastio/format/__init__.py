"""The shard formats, one folder each, everything of a format together:

* :mod:`fastio.format.shards`: fastio's own columnar format (layout, schema, reader, writer, its source and
  its remote source).
* :mod:`fastio.format.tar`: WebDataset tar shards (header scan, sidecar index, member decoding, its source,
  compressed tars locally and its remote source).

A new format is a folder here with its reader (and writer, if it has one), a source over local files (a
:class:`fastio.sources.Source`), optionally a remote source (a :class:`fastio.remote.RemoteSource`
subclass that reads the cached files through that local source), and one row in :mod:`fastio.registry`
naming its openers: it is then read locally and from every store at once. :mod:`fastio.remote` never
imports a format.
"""
