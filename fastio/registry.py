"""Which :class:`fastio.sources.Source` opens what a :class:`fastio.StreamLoader` was given: one table of
formats (one row per format, naming its local opener and, for formats that can be read remotely, its
opener of URLs) and one of URL schemes. :func:`open_source` consults only these tables. A new format is
its folder under :mod:`fastio.format` plus one row here: local and remote at once.

1. A string (or ``os.PathLike``) with a URL scheme (``s3://...``, ``https://...``), or a list of such
   strings with one scheme, goes to the opener registered for that scheme
   (:func:`register_scheme`); an unknown scheme raises ``ValueError`` naming the URL and the registered
   schemes. ``file://`` URLs are local paths; ``s3``, ``gs``/``gcs``, ``az``/``abfs(s)``/``adl``, ``http(s)``,
   ``hf`` and ``memory`` go to the first built-in format whose ``url_matches(url)`` is True, whose
   ``url_opener`` reads it through :mod:`fastio.remote` (fsspec and its per-store extras): ``.parquet`` URLs
   (:mod:`fastio.format.parquet`), compressed tars, then ``.tar`` URLs, brace patterns, globs and lists,
   then a directory URL (no file suffix in its last part) as a fastio shard directory, or, without an
   ``index.json``, as the folder of ``.parquet`` files it lists (:mod:`fastio.format.parquet.folder`).
2. Anything else goes to the first format (:func:`register_format`) whose ``matches(target)`` is True.
   Formats registered by users are consulted first (newest last), then the built-ins in this order: an
   object that already is a :class:`~fastio.sources.Source`; ``.parquet`` paths, patterns, lists, or a folder
   of them without an ``index.json`` (:mod:`fastio.format.parquet`); a directory (a fastio shard directory,
   :mod:`fastio.format.shards`); compressed tar paths or patterns (``.tar.gz``, ``.tgz``, ``.tar.zst``...:
   :data:`fastio.format.tar.compression.COMPRESSED_SUFFIXES`, decompressed once into ``cache_dir``,
   :mod:`fastio.format.tar.compressed`); a ``.tar`` path, glob or brace pattern, or a list of paths
   (WebDataset tar shards, :mod:`fastio.format.tar`); any other object (a map-style ``Dataset``).
3. A path no format takes: ``FileNotFoundError`` if it does not exist, else ``ValueError`` listing what
   the path formats expect.
4. An empty directory a format takes (checked before its opener runs), and a source opened with no
   samples (by any format or scheme), raise :class:`fastio.EmptySourceError` naming the path.

A built-in entry names its opener as ``"module:function"``, imported at its first use, so optional
dependencies (fsspec for remote stores) are imported only when a URL needs them, and matching a local path
never imports :mod:`fastio.remote`.

An opener is ``opener(target, options: OpenOptions) -> Source``; ``target`` is the path string, the list of
path strings, the URL (or list of URLs) or the object, as given (``os.PathLike`` turned into ``str``).

Example::

    from fastio.registry import OpenOptions, register_format, register_scheme

    register_format(
        "npy-dir",
        matches=lambda target: isinstance(target, str) and target.endswith(".npydir"),
        opener=lambda target, options: NpyDirSource(target),
        description="a .npydir directory of .npy files",
    )
    register_scheme("mem", lambda url, options: MemorySource(url))
    loader = fastio.StreamLoader("mem://train", batch_size=8)
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from fastio.errors import EmptySourceError
from fastio.files.paths import is_path_list
from fastio.format.parquet import is_parquet, is_parquet_url
from fastio.format.shards import is_shard_directory, is_shard_directory_url
from fastio.format.tar import is_tar, is_tar_url
from fastio.format.tar.compression import COMPRESSED_SUFFIXES, is_compressed_tar
from fastio.options import OpenOptions, columns_read
from fastio.sources.base import Source, missing_members

__all__ = [
    "Format",
    "OpenOptions",
    "formats",
    "open_source",
    "register_format",
    "register_scheme",
    "schemes",
    "unregister_format",
    "unregister_scheme",
    "url_scheme",
]


Opener = Callable[[Any, OpenOptions], Source]
Matcher = Callable[[Any], bool]


@dataclasses.dataclass(frozen=True)
class Format:
    """One row of the format table.

    Attributes:
        name: the row's key (registering the same name again replaces the row).
        matches: ``matches(target) -> bool``, or ``"module:function"``.
        opener: ``opener(target, options) -> Source``, or ``"module:function"``.
        description: for paths, what the format expects (``"a fastio shard directory"``), listed when a
            path matches no format; None for formats that do not take paths.
        url_matches, url_opener: for formats read from URLs (built-in ones), which URLs (or lists of URLs)
            the format takes and its opener of them; None for local-only formats.
    """

    name: str
    matches: Matcher | str
    opener: Opener | str
    description: str | None = None
    url_matches: Matcher | str | None = None
    url_opener: Opener | str | None = None


def _is_path(target: Any) -> bool:
    return isinstance(target, str)


def _is_source(target: Any) -> bool:
    return not isinstance(target, (str, list)) and not missing_members(target)


def _is_object(target: Any) -> bool:
    return not _is_path(target) and not is_path_list(target)


def _open_itself(target: Any, options: OpenOptions) -> Source:
    return target


def _open_file_url(target: Any, options: OpenOptions) -> Source:
    local = [t[len("file://") :] for t in target] if isinstance(target, list) else target[len("file://") :]
    return open_source(local, options)


_SHARD_DIRECTORY = "a fastio shard directory"
_COMPRESSED = f"WebDataset {'/'.join(COMPRESSED_SUFFIXES)} shards"
# One row per format; its matchers live with it and import only the standard library, so matching a target
# never imports a reader, fastio.remote or fsspec.
_BUILTIN_FORMATS = (
    Format("source", _is_source, _open_itself),
    # Before shard directories (a folder of .parquet files has no index.json); unlisted in "expected ...".
    Format("parquet", is_parquet, "fastio.format.parquet.source:open_parquet", None,
           is_parquet_url, "fastio.format.parquet.remote:open_remote_parquet"),
    Format("fastio-shards", is_shard_directory, "fastio.format.shards.source:open_shard_directory",
           _SHARD_DIRECTORY, is_shard_directory_url, "fastio.format.parquet.folder:open_remote_folder"),
    Format("compressed-tar", is_compressed_tar, "fastio.format.tar.compressed:open_compressed_tars",
           _COMPRESSED, is_compressed_tar, "fastio.format.tar.remote:open_remote_tars"),
    Format("webdataset-tar", is_tar, "fastio.format.tar.source:open_tar_shards", "WebDataset .tar shards",
           is_tar_url, "fastio.format.tar.remote:open_remote_tars"),
    Format("dataset", _is_object, "fastio.sources.dataset:open_dataset"),
)  # fmt: skip
_formats: list[Format] = []  # registered by users; consulted before the built-ins


def _open_url(target: Any, options: OpenOptions) -> Source:
    """The opener of the built-in schemes (through fsspec: any store it and its extras reach): the first
    built-in format that takes the URL opens it (see the module docstring)."""
    for row in _BUILTIN_FORMATS:
        if row.url_opener is not None and _resolve(row.url_matches)(target):
            return _resolve(row.url_opener)(target, options)
    readable = ", ".join(row.name for row in _BUILTIN_FORMATS if row.url_opener is not None)
    raise ValueError(
        f"{_shown(target)}: no format reads this URL (formats read remotely: {readable}; a directory URL "
        "has no file suffix in its last part)"
    )


_REMOTE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "http", "https", "hf", "memory")
_schemes: dict[str, Opener | str] = {"file": _open_file_url, **dict.fromkeys(_REMOTE_SCHEMES, _open_url)}

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def register_format(
    name: str, matches: Matcher | str, opener: Opener | str, description: str | None = None
) -> None:
    """Add a local format (or replace the one of that name): ``matches(target)`` says whether it takes a
    target, ``opener(target, options)`` opens it. Consulted before the built-in formats, in the order
    registered.

    Example::

        register_format("npy-dir", lambda t: isinstance(t, str) and t.endswith(".npydir"),
                        lambda t, options: NpyDirSource(t), "a .npydir directory of .npy files")
    """
    if any(f.name == name for f in _BUILTIN_FORMATS):
        raise ValueError(f"format {name!r} is built in; register yours under another name")
    row = Format(name, matches, opener, description)
    for i, existing in enumerate(_formats):
        if existing.name == name:
            _formats[i] = row
            return
    _formats.append(row)


def unregister_format(name: str) -> None:
    """Remove a format added by :func:`register_format` (``KeyError`` if there is none of that name).

    Example::

        unregister_format("npy-dir")
    """
    for i, existing in enumerate(_formats):
        if existing.name == name:
            del _formats[i]
            return
    raise KeyError(f"no registered format {name!r} (registered: {[f.name for f in _formats]})")


def register_scheme(scheme: str, opener: Opener | str) -> None:
    """Open URLs ``<scheme>://...`` (and lists of them) with ``opener(url_or_urls, options)``; replaces an
    earlier opener of that scheme.

    Example::

        register_scheme("mem", lambda url, options: MemorySource(url))
    """
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", scheme):
        raise ValueError(f"not a URL scheme: {scheme!r} (give it without '://', e.g. 's3')")
    _schemes[scheme.lower()] = opener


def unregister_scheme(scheme: str) -> None:
    """Remove a scheme's opener (``KeyError`` if it has none).

    Example::

        unregister_scheme("mem")
    """
    del _schemes[scheme.lower()]


def formats() -> list[Format]:
    """The format table in the order :func:`open_source` consults it.

    Example::

        assert formats()[-1].name == "dataset"
    """
    return [*_formats, *_BUILTIN_FORMATS]


def schemes() -> list[str]:
    """The URL schemes that have an opener, sorted.

    Example::

        assert "file" in schemes()
    """
    return sorted(_schemes)


def url_scheme(target: Any) -> str | None:
    """The URL scheme of a string (lower case), or of a list of strings that all have the same one; None
    for local paths and other objects. A list mixing schemes (or URLs and paths) raises ``ValueError``.

    Example::

        assert url_scheme("S3://bucket/train/") == "s3" and url_scheme("data/train") is None
    """
    if isinstance(target, str):
        match = _SCHEME.match(target)
        return match.group(1).lower() if match else None
    if not is_path_list(target):
        return None
    found = {url_scheme(t) for t in target}
    if len(found) > 1:
        shown = sorted("a local path" if s is None else f"{s}://" for s in found)
        raise ValueError(f"a list of shards must all have one URL scheme (or none), got {', '.join(shown)}")
    return found.pop()


def _resolve(entry: Callable[..., Any] | str) -> Callable[..., Any]:
    if callable(entry):
        return entry
    module, _, attr = entry.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise ImportError(f"fastio registry: {entry} failed to import ({exc})") from exc


def _normalize(target: Any) -> Any:
    if isinstance(target, os.PathLike):
        return os.fspath(target)
    if isinstance(target, Sequence) and not isinstance(target, (str, bytes)) and target:
        if all(isinstance(t, (str, os.PathLike)) for t in target):
            return [os.fspath(t) for t in target]
    return target


def _shown(target: Any) -> str:
    if is_path_list(target):
        return f"{target[0]} (+{len(target) - 1})"
    return target if isinstance(target, str) else type(target).__name__


def _refuse_empty_directory(target: Any, row: Format) -> None:
    """A format that takes an empty directory would open a source of nothing (or fail inside its opener
    on nothing to read): say so by the directory's name first."""
    if is_shard_directory(target) and not os.listdir(target):
        what = f" ({row.description})" if row.description else ""
        raise EmptySourceError(
            f"{target}: empty directory; format {row.name!r}{what} matched it, but there is nothing to read: "
            "check the path, or write the data there first"
        )


def _checked(source: Any, opened_by: str, target: Any) -> Source:
    missing = missing_members(source)
    if missing:
        raise TypeError(
            f"{opened_by} returned a {type(source).__name__}, which lacks {', '.join(missing)} of "
            "fastio.sources.Source (subclass it to inherit the optional members' defaults)"
        )
    if source.num_samples == 0:
        raise EmptySourceError(
            f"{_shown(target)}: {opened_by} opened it as {source.name!r}, which holds no samples: check the "
            "path, or write the data there first"
        )
    return source


def open_source(source: Any, options: OpenOptions | None = None, **fields: Any) -> Source:
    """The batch source for what :class:`fastio.StreamLoader` was given (see the module docstring).

    Args:
        source: a path, a list of paths, a URL (or list of URLs), a map-style ``Dataset`` or a
            :class:`fastio.sources.Source`.
        options: what every opener is passed; ``fields`` override single options
            (``open_source(path, tar_strict=False)``).

    Example::

        source = open_source("data/shard-{000000..000009}.tar")
    """
    options = dataclasses.replace(options or OpenOptions(), **fields)
    target = _normalize(source)
    scheme = url_scheme(target)
    if scheme is not None:
        opener = _schemes.get(scheme)
        if opener is None:
            raise ValueError(
                f"{_shown(target)}: no source is registered for URL scheme {scheme!r} (registered: "
                f"{', '.join(schemes())}); fastio.registry.register_scheme({scheme!r}, opener) adds one"
            )
        return columns_read(
            options, target, _checked(_resolve(opener)(target, options), f"the opener of {scheme}://", target)
        )
    for row in formats():
        if _resolve(row.matches)(target):
            _refuse_empty_directory(target, row)
            return columns_read(
                options,
                target,
                _checked(_resolve(row.opener)(target, options), f"format {row.name!r}", target),
            )
    if not os.path.exists(target):
        raise FileNotFoundError(f"{target}: no such shard directory or tar shard")
    expected = [row.description for row in formats() if row.description]
    listed = ", ".join(expected[:-1]) + " or " + expected[-1] if len(expected) > 1 else expected[0]
    raise ValueError(f"{target}: expected {listed}")
