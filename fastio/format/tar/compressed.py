"""Local compressed tar shards (``.tar.gz``/``.tgz``, ``.tar.zst``/``.tar.zstd``): each is decompressed
once, streaming, into a local directory, then indexed and read as a plain tar by
:class:`~fastio.format.tar.source.TarSource`. No remote code runs (:mod:`fastio.remote` is for URLs).

1. The copy of ``<folder>/shard-000.tgz`` is ``<cache_dir>/local/<digest of the folder>/shard-000.tar``
   (``cache_dir``: ``OpenOptions.cache_dir``, else :func:`fastio.files.paths.default_cache_dir`; ``local/`` is
   :data:`fastio.files.paths.LOCAL_COPIES`, which the remote cache neither counts nor evicts), beside a
   ``.source.json`` that records the compressed file's size and mtime: a later open with the same file
   reuses the copy, a changed file is decompressed again.
2. The copy is written to a temporary file and renamed into place, so a cut or corrupt stream (which raises
   :class:`fastio.CorruptShardError` naming the compressed file) never leaves a ``.tar`` behind, and ranks or
   processes that decompress the same shard at once each finish with a whole copy.
3. A compressed shard's sample count needs its tar, so every shard is decompressed when the source opens;
   the copies take the set's decompressed size (``cache_limit`` bounds the remote cache only).

Example::

    loader = fastio.StreamLoader("data/shard-{000..009}.tar.gz", batch_size=64, cache_dir="/tmp/fastio-cache")
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from fastio.errors import CorruptShardError, FastIOError
from fastio.files.paths import LOCAL_COPIES, default_cache_dir, expand_pattern
from fastio.format.tar.compression import compression_of, decompress, decompressed_name
from fastio.format.tar.index import TarShardSet
from fastio.format.tar.source import TarSource

__all__ = ["decompressed_copy", "open_compressed_tars"]


def _stamp(path: str) -> dict[str, int]:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def decompressed_copy(path: str, directory: str | os.PathLike[str]) -> Path:
    """The plain tar inside the compressed tar ``path``, decompressed under ``directory`` once (see the
    module docstring); returns its path.

    Example::

        tar = decompressed_copy("data/shard-000.tgz", "/tmp/fastio-cache")
    """
    kind = compression_of(path)
    if kind is None:
        raise ValueError(f"{path}: not a compressed tar (expected a name ending in a compressed tar suffix)")
    folder = os.path.dirname(os.path.abspath(path))
    digest = hashlib.sha256(folder.encode()).hexdigest()[:16]
    target = Path(directory) / LOCAL_COPIES / digest / decompressed_name(path)
    stamp_path = target.with_name(target.name + ".source.json")
    stamp = _stamp(path)
    try:
        if target.exists() and json.loads(stamp_path.read_text()) == stamp:
            return target
    except (OSError, ValueError):
        pass  # no stamp, or an unreadable one: decompress again
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{target.name}.part-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(path, "rb") as raw, open(part, "wb") as out:
            try:
                decompress(raw, kind, out)
            except (FastIOError, ImportError):
                raise
            except Exception as exc:  # the decompressor's own errors (gzip: OSError/EOFError, ZstdError)
                expected = f"a whole {kind} stream"
                raise CorruptShardError(path, "compressed stream", expected, repr(exc)) from None
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    stamp_tmp = stamp_path.with_name(f".{stamp_path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    stamp_tmp.write_text(json.dumps(stamp))
    os.replace(stamp_tmp, stamp_path)
    return target


def open_compressed_tars(target: str | list[str], options: Any) -> TarSource:
    """The registry's opener of local compressed tar shards: a path, brace pattern or glob, or a list of
    them, decompressed into ``options.cache_dir`` (see the module docstring) and read as plain tars
    (``options.tar_strict`` and ``options.decode`` apply).

    Example::

        source = open_compressed_tars("data/shard-{000..003}.tgz", OpenOptions(cache_dir="/tmp/c"))
    """
    paths = expand_pattern(target)
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such tar shard")
    directory = options.cache_dir if options.cache_dir is not None else default_cache_dir()
    tars = [str(decompressed_copy(path, directory)) for path in paths]
    return TarSource(TarShardSet(tars, strict=options.tar_strict), decode=options.decode)
