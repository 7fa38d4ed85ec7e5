"""numpy's ``.npy``/``.npz`` headers read under one lock, for fastio's worker threads.

numpy parses each ``.npy`` header (and the header of each array of an ``.npz``) with ``ast.literal_eval``.
On CPython 3.11 (seen on 3.11.7), building ASTs in several threads at once can fail with a spurious
``SystemError: AST constructor recursion depth mismatch`` (cpython gh-106905): here in about 1 of 6 runs of
two worker threads opening tar indexes at once. Every header fastio parses in a worker goes through
:data:`NPY_HEADER_LOCK`; a header is a few hundred bytes, so the lock costs nothing measurable.

Example::

    arrays = load_npz("data/shard-000000.tar.idx.npz")   # every array of the archive, read under the lock
"""

from __future__ import annotations

import io
import os
import threading
import zipfile

import numpy as np

__all__ = ["NPY_HEADER_LOCK", "load_npz"]

NPY_HEADER_LOCK = threading.Lock()


def load_npz(source: str | os.PathLike[str] | io.BytesIO) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` at ``source`` (a path or a file object), read at once under
    :data:`NPY_HEADER_LOCK`; no pickles. A bad archive raises ``OSError`` or ``ValueError`` (a cut or damaged
    one too: zip's own errors, such as a member's wrong crc32, come as ``ValueError``)."""
    try:
        with NPY_HEADER_LOCK, np.load(source, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"not a whole .npz archive: {exc}") from None
