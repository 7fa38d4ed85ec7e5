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
  through the node-local cache of :mod:`fastio.remote`; :mod:`~fastio.format.tar.parts`: parts of plain
  tars, read by range for ``shuffle=True``; :mod:`~fastio.format.tar.kept`: what it keeps per tar in the
  cache (meta, index) so that the next run opens without a request and reads parts of every plain tar.

Its rows in :mod:`fastio.registry` are ``"compressed-tar"`` and ``"webdataset-tar"``.
"""

from __future__ import annotations

from typing import Any

from fastio.files.paths import is_path_list

__all__ = ["is_tar", "is_tar_url"]


def is_tar(target: Any) -> bool:
    """The registry's match of local tar shards: a ``.tar`` path, a glob or brace pattern, or a list of
    paths (compressed ones are matched first, by :func:`fastio.format.tar.compression.is_compressed_tar`).

    Example::

        assert is_tar("data/shard-{000..009}.tar") and is_tar(["a.tar", "b.tar"])
    """
    if is_path_list(target):
        return True
    return isinstance(target, str) and (target.endswith(".tar") or any(c in target for c in "*?[{"))


def is_tar_url(target: Any) -> bool:
    """The registry's match of tar shards at URLs: a ``.tar`` URL (its query aside), a brace pattern or glob
    (``?`` starts a URL's query: it is no wildcard there), or a list of URLs.

    Example::

        assert is_tar_url("https://host/shard-{000..009}.tar?v=2")
    """
    if is_path_list(target):
        return True
    if not isinstance(target, str):
        return False
    path = target.split("?", 1)[0]
    return path.endswith(".tar") or any(c in path for c in "*[{")
