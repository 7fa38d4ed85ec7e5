"""fastio's own options of a :class:`fastio.StreamLoader`, one small frozen object per concern; DataLoader's
keyword names (``batch_size``, ``shuffle``, ``num_workers``, ``collate_fn``, ...) stay flat on the loader.
docs/loader.md ("fastio's own options") is the one table of every field.

- :class:`ReadOptions` (``read=``): how shards are read: tar decoding, checksums, strict tar ends.
- :class:`RemoteOptions` (``remote=``): where shards brought local are kept (remote stores, compressed
  tars), how many bytes, and the storage client's options.
- :class:`OrderOptions` (``order=``): the rank split and the shard-aware shuffles' knobs.
- :class:`WorkerOptions` (``workers=``): threads or processes, gather threads, batches in flight.
- :class:`BatchOptions` (``batches=``): batch stages, buffer reuse, the progress bar.
- :class:`MixingOptions` (``mixing=``): how a list of :class:`fastio.Stream` is mixed.
- :class:`OpenOptions`: what every source opener is passed (``read`` and ``remote`` together).

The loader's own flat names of these fields (``cache_dir=``, ``worker_mode=``, ...) keep working for one
release: :func:`grouped_options` turns them into the objects above with a ``DeprecationWarning`` that names
the new form.

Example::

    loader = fastio.StreamLoader(
        "s3://bucket/train/", batch_size=256, shuffle=True, num_workers=4,
        remote=fastio.RemoteOptions(cache_dir="/scratch/cache", cache_limit="50GB"),
        workers=fastio.WorkerOptions(mode="process"),
    )
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastio.assembly.stages import BatchStage

__all__ = [
    "BatchOptions",
    "MixingOptions",
    "OpenOptions",
    "OrderOptions",
    "ReadOptions",
    "RemoteOptions",
    "WorkerOptions",
    "columns_read",
    "grouped_options",
]


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How shards are read.

    Attributes:
        decode: tar sources: None (bytes, ``.npy`` and numbers decoded), ``"pil"`` (images via Pillow) or
            ``decode(field, bytes) -> value``.
        verify: shard checksums: None (lazily, once per process per shard), True (all at open), False.
        tar_strict: tar shards must end with an end-of-archive marker; ``False`` serves the members before
            the damage instead of raising :class:`fastio.CorruptShardError`.
        columns: Parquet: the columns to read (only their column chunks are read, or fetched); None: every
            one. A format that cannot select columns refuses it (:func:`columns_read`).

    Example::

        fastio.StreamLoader("data/shard-{000..003}.tar", batch_size=8, read=ReadOptions(decode="pil"))
        fastio.StreamLoader("data/train-*.parquet", batch_size=8, read=ReadOptions(columns=["input_ids"]))
    """

    decode: Callable[[str, bytes], Any] | str | None = None
    verify: bool | None = None
    tar_strict: bool = True
    columns: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.columns is not None:
            if isinstance(self.columns, str) or not all(isinstance(c, str) for c in self.columns):
                raise TypeError(
                    f"ReadOptions(columns=...) takes a list of column names, got {self.columns!r}"
                )
            object.__setattr__(self, "columns", tuple(self.columns))


@dataclasses.dataclass(frozen=True)
class RemoteOptions:
    """Where sources that bring shards local keep them (remote stores, compressed tars decompressed once).

    Attributes:
        cache_dir: the folder (default: ``$FASTIO_CACHE``, else a folder under the user's cache).
        cache_limit: the most bytes the remote cache keeps (an int, or ``"50GB"``); None: no limit.
        storage_options: keyword arguments of the storage client (fsspec's ``storage_options``:
            ``endpoint_url``, ``anon``...).

    Example::

        fastio.StreamLoader("s3://bucket/train/", batch_size=256,
                            remote=RemoteOptions(cache_dir="/scratch/c", cache_limit="50GB"))
    """

    cache_dir: str | os.PathLike[str] | None = None
    cache_limit: int | str | None = None
    storage_options: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class OrderOptions:
    """The rank split and the knobs of the shard-aware shuffles (:mod:`fastio.pipeline.order`).

    Attributes:
        rank, world_size: override what ``torch.distributed`` says (None: ask it; 0 and 1 without it).
        shuffle_block, shuffle_window: block size and window (shards) of ``shuffle="shard"``.
        shuffle_parts: with ``shuffle="parts"``, the parts per shard of the order ``shuffle=True`` chose on
            a cache-limited remote source, named to resume its state dict under another world size or cache.

    Example::

        fastio.StreamLoader("data/train", batch_size=64, shuffle="shard",
                            order=OrderOptions(shuffle_window=8))
    """

    rank: int | None = None
    world_size: int | None = None
    shuffle_block: int = 256
    shuffle_window: int = 4
    shuffle_parts: int | None = None


WORKER_MODES = ("auto", "thread", "process")


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """Who makes batches (:mod:`fastio.workers`), beside DataLoader's ``num_workers``.

    Attributes:
        mode: ``"thread"``, ``"process"`` (forked, or as DataLoader's ``multiprocessing_context=`` says;
            batches handed over through slot files) or ``"auto"``:
            processes when Python code runs per sample (``transform``, ``collate_fn`` or a Dataset
            source), threads otherwise.
        threads: threads per native gather (None: CPUs / max(1, num_workers), at most 8).
        prefetch: batches in flight beyond ``num_workers`` (None: 2); DataLoader's ``prefetch_factor=``
            says the same per worker (give one of the two).

    Example::

        fastio.StreamLoader(dataset, batch_size=32, num_workers=2, workers=WorkerOptions(mode="thread"))
    """

    mode: str = "auto"
    threads: int | None = None
    prefetch: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in WORKER_MODES:
            raise ValueError(f"worker mode must be 'auto', 'thread' or 'process', got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    """How batches are made and handed over, beside ``transform`` and ``collate_fn``.

    Attributes:
        stages: :class:`fastio.BatchStage` steps run on each gathered batch, in order, before
            ``transform`` (the image pipeline is one).
        reuse_buffers: refill output buffers only when nothing outside the loader still views them
            (False: fresh memory for every batch).
        progress: a tqdm progress bar per epoch.

    Example::

        fastio.StreamLoader("data/images", batch_size=64,
                            batches=BatchOptions(stages=[fastio.ImageStage(...)]))
    """

    stages: Sequence[BatchStage] = ()
    reuse_buffers: bool = True
    progress: bool = False


@dataclasses.dataclass(frozen=True)
class MixingOptions:
    """How a list of :class:`fastio.Stream` is mixed (:mod:`fastio.mixing`).

    Attributes:
        mix: ``"sample"`` (each batch mixes the streams in proportion) or ``"batch"`` (one stream per batch,
            batches drawn in proportion).
        epoch_size: samples per epoch, all streams together (None: the sum of their sizes).

    Example::

        fastio.StreamLoader([fastio.Stream(a, 0.7), fastio.Stream(b, 0.3)], batch_size=64,
                            mixing=MixingOptions(mix="batch", epoch_size=10_000))
    """

    mix: str = "sample"
    epoch_size: int | None = None


@dataclasses.dataclass(frozen=True)
class OpenOptions:
    """What a :class:`fastio.StreamLoader` passes every source opener besides the target
    (:mod:`fastio.registry`): its :class:`ReadOptions` and :class:`RemoteOptions` fields in one object.
    Each source reads the options it knows and ignores the rest.

    Attributes:
        decode, verify, tar_strict, columns: as in :class:`ReadOptions`.
        cache_dir: as in :class:`RemoteOptions` (a string).
        cache_limit, storage_options: as in :class:`RemoteOptions`.

    Example::

        options = OpenOptions(verify=True, cache_dir="/tmp/fastio-cache")
    """

    decode: Callable[[str, bytes], Any] | str | None = None
    verify: bool | None = None
    tar_strict: bool = True
    cache_dir: str | None = None
    cache_limit: int | str | None = None
    storage_options: Mapping[str, Any] | None = None
    columns: Sequence[str] | None = None

    @classmethod
    def of(cls, read: ReadOptions, remote: RemoteOptions) -> OpenOptions:
        """The openers' options for a loader's ``read=`` and ``remote=``.

        Example::

            OpenOptions.of(ReadOptions(verify=True), RemoteOptions(cache_dir="/c")).cache_dir == "/c"
        """
        cache_dir = None if remote.cache_dir is None else os.fspath(remote.cache_dir)
        return cls(read.decode, read.verify, read.tar_strict, cache_dir, remote.cache_limit,
                   remote.storage_options, read.columns)  # fmt: skip


def columns_read(options: OpenOptions, target: Any, source: Any) -> Any:
    """``source``, opened from ``target`` with ``options``, once it is known to have read only
    ``options.columns`` (when given): a source that selects columns says which (``selected_columns``, as a
    Parquet source does); any other, or a source object handed to the loader ready made, is a ``ValueError``
    saying what to do.

    Example::

        source = columns_read(options, "data/train-*.parquet", open_source("data/train-*.parquet", options))
    """
    if options.columns is None:
        return source
    name = getattr(source, "name", type(source).__name__)
    if source is target:
        raise ValueError(
            f"read=ReadOptions(columns=...) with a source object ({name}): a ready-made source has read its "
            "columns already; pass them where it is made (parquet_source(path, columns=[...]))"
        )
    selected = getattr(source, "selected_columns", None)
    if selected is None:
        raise ValueError(
            f"read=ReadOptions(columns={list(options.columns)}) but {name} ({type(source).__name__}) cannot "
            "select columns (Parquet sets can); drop columns= for it, or select fields in a transform"
        )
    return source


# The option groups by their StreamLoader keyword, and the loader's flat names of their fields (one release).
GROUPS: dict[str, type] = {
    "read": ReadOptions,
    "remote": RemoteOptions,
    "order": OrderOptions,
    "workers": WorkerOptions,
    "batches": BatchOptions,
    "mixing": MixingOptions,
}
FLAT_NAMES: dict[str, tuple[str, str]] = {
    "decode": ("read", "decode"),
    "verify": ("read", "verify"),
    "tar_strict": ("read", "tar_strict"),
    "cache_dir": ("remote", "cache_dir"),
    "cache_limit": ("remote", "cache_limit"),
    "storage_options": ("remote", "storage_options"),
    "rank": ("order", "rank"),
    "world_size": ("order", "world_size"),
    "shuffle_block": ("order", "shuffle_block"),
    "shuffle_window": ("order", "shuffle_window"),
    "shuffle_parts": ("order", "shuffle_parts"),
    "worker_mode": ("workers", "mode"),
    "threads": ("workers", "threads"),
    "prefetch": ("workers", "prefetch"),
    "stages": ("batches", "stages"),
    "reuse_buffers": ("batches", "reuse_buffers"),
    "progress": ("batches", "progress"),
    "mix": ("mixing", "mix"),
    "epoch_size": ("mixing", "epoch_size"),
}


def grouped_options(given: Mapping[str, Any], flat: Mapping[str, Any]) -> dict[str, Any]:
    """Every option group of a loader, from the groups it was ``given`` (keyword -> object or None) and the
    old ``flat`` keywords (``cache_dir=``...), each of which warns (``DeprecationWarning``) with its new
    form. A group of the wrong type is a ``TypeError``; an unknown keyword a ``TypeError``, as Python
    raises; a flat name beside its group a ``ValueError``.

    Example::

        groups = grouped_options({"remote": None}, {"cache_dir": "/c"})   # warns
        assert groups["remote"] == RemoteOptions(cache_dir="/c")
    """
    unknown = sorted(set(flat) - set(FLAT_NAMES))
    if unknown:
        homes = [f" (it is {k}=fastio.{g.__name__}({unknown[0]}=...))" for k, g in GROUPS.items()
                 if unknown[0] in {f.name for f in dataclasses.fields(g)}]  # fmt: skip
        raise TypeError(f"StreamLoader() got an unexpected keyword argument {unknown[0]!r}{''.join(homes)}")
    groups: dict[str, Any] = {}
    for keyword, kind in GROUPS.items():
        value = given.get(keyword)
        if value is not None and not isinstance(value, kind):
            raise TypeError(
                f"StreamLoader({keyword}=...) takes a fastio.{kind.__name__}, got {type(value).__name__}"
            )
        groups[keyword] = value
    fields: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        keyword, field = FLAT_NAMES[name]
        kind = GROUPS[keyword]
        if groups[keyword] is not None:
            raise ValueError(
                f"StreamLoader({name}=...) and {keyword}=fastio.{kind.__name__}(...) both given: pass "
                f"{field}= inside {kind.__name__} only"
            )
        warnings.warn(
            f"StreamLoader({name}=...) is deprecated and goes in the next release; pass "
            f"{keyword}=fastio.{kind.__name__}({field}=...)",
            DeprecationWarning,
            stacklevel=3,
        )
        fields.setdefault(keyword, {})[field] = value
    for keyword, kind in GROUPS.items():
        if groups[keyword] is None:
            groups[keyword] = kind(**fields.get(keyword, {}))
    return groups
