"""Parquet files, read in place through pyarrow (the ``parquet`` extra): a file, a glob or brace pattern, a
list of files, or a folder of them (a Hugging Face Hub-style folder of shards such as
``data/train-00000-of-00004.parquet``), local or at URLs.

* :mod:`~fastio.format.parquet.footer`: a file's footer (its metadata) read and checked, from a local file or
  from the tail bytes of a remote one; the byte ranges of a row group's column chunks.
* :mod:`~fastio.format.parquet.layout`: how each selected column comes out of a batch, decided once over the
  set from the files' schemas and statistics; the named errors of a missing column or a schema that differs
  between files.
* :mod:`~fastio.format.parquet.row_group`: one row group as a shard (which file, its rows, its reader).
* :mod:`~fastio.format.parquet.decoded`: the decoded row groups a source keeps in memory (bounded by bytes).
* :mod:`~fastio.format.parquet.source`: :class:`~fastio.format.parquet.source.ParquetSource`, row groups as
  the shards of a batch source; :func:`~fastio.format.parquet.source.parquet_source`, the one call that
  opens a local or remote set with ``columns=``.
* :mod:`~fastio.format.parquet.tokens`: a token (or, with a tokenizer, a text) column as the documents of
  ``pack=``, decoded into memory (or token files past ``memory_limit``), kept as files for the next loader.
* :mod:`~fastio.format.parquet.remote`: :class:`~fastio.format.parquet.remote.RemoteParquetSource`, files at
  URLs read through the node cache of :mod:`fastio.remote`: the footer and the needed row groups' column
  chunks, by range; each file's footer kept in the cache for the next open.
* :mod:`~fastio.format.parquet.folder`: a directory URL, opened as a fastio shard directory (its
  ``index.json``) or as the ``.parquet`` files it lists.

Its row in :mod:`fastio.registry` is ``"parquet"``.
"""

from __future__ import annotations

import os
import re
from typing import Any

from fastio.files.paths import is_path_list

__all__ = [
    "PARQUET_SUFFIX",
    "folder_splits",
    "is_parquet",
    "is_parquet_url",
    "one_split",
    "parquet_files_in",
]

PARQUET_SUFFIX = ".parquet"
_SHARD_NAME = re.compile(r"^(?P<split>.+?)-\d+-of-\d+\.parquet$")  # the Hub's "train-00000-of-00004.parquet"


def parquet_files_in(directory: str) -> list[str]:
    """The ``.parquet`` files under ``directory`` (recursively, sorted by path): a Hub-style folder of
    shards.

    Example::

        parquet_files_in("data")   # ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002..."]
    """
    found = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        found.extend(os.path.join(root, f) for f in sorted(files) if f.endswith(PARQUET_SUFFIX))
    return sorted(found)


def folder_splits(directory: str, paths: list[str]) -> dict[str, list[str]]:
    """The files of a folder grouped by what names a split: their subfolder and, in Hub-style names
    (``train-00000-of-00004.parquet``), the part before the shard number. A folder of one group is one
    split; a Hub repository's ``data/`` often holds several (train, validation, test).

    Example::

        folder_splits("data", ["data/test-00000-of-00001.parquet", "data/train-00000-of-00002.parquet"])
        # {"test-*": [...], "train-*": [...]}
    """
    splits: dict[str, list[str]] = {}
    for path in paths:
        folder, name = os.path.split(os.path.relpath(path, directory))
        match = _SHARD_NAME.match(name)
        group = os.path.join(folder, f"{match.group('split')}-*" if match else "*")
        splits.setdefault(group, []).append(path)
    return splits


def one_split(directory: str, paths: list[str]) -> list[str]:
    """``paths``, the files of a folder, when they make one split (:func:`folder_splits`); else a
    ``ValueError`` naming each split's pattern: a Hub repository's ``data/`` with train and test is never
    read as one set.

    Example::

        one_split("data", ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"])
    """
    splits = folder_splits(directory, paths)
    if len(splits) > 1:
        where = directory.rstrip("/")
        listed = ", ".join(f"{where}/{g}.parquet ({len(p)} files)" for g, p in splits.items())
        raise ValueError(
            f"{directory}: the folder holds several splits ({listed}); name one with a pattern, e.g. "
            f"{where}/{next(iter(splits))}.parquet, or pass a list of files"
        )
    return paths


def is_parquet(target: Any) -> bool:
    """The registry's match of local Parquet data: a ``.parquet`` path or pattern, a list of them, or a
    folder that holds ``.parquet`` files and no fastio ``index.json``.

    Example::

        assert is_parquet("data/train-*.parquet") and is_parquet(["a.parquet", "b.parquet"])
    """
    if is_path_list(target):
        return all(t.endswith(PARQUET_SUFFIX) for t in target)
    if not isinstance(target, str):
        return False
    if target.endswith(PARQUET_SUFFIX):
        return True
    if os.path.isdir(target) and not os.path.exists(os.path.join(target, "index.json")):
        return bool(parquet_files_in(target))
    return False


def is_parquet_url(target: Any) -> bool:
    """The registry's match of Parquet files at URLs: a ``.parquet`` URL, glob or brace pattern (its query
    aside), or a list of them.

    Example::

        assert is_parquet_url("hf://datasets/org/name/data/train-*.parquet")
    """
    if is_path_list(target):
        return all(is_parquet_url(t) for t in target)
    return isinstance(target, str) and target.split("?", 1)[0].endswith(PARQUET_SUFFIX)
