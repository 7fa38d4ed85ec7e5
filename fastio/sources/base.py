"""The contract every batch source of a :class:`fastio.StreamLoader` meets: :class:`Source`.

A source turns global sample indices into one batch. The loader knows nothing else about it: it never
checks a source's type, only reads what this protocol declares. A new source is a class that subclasses
:class:`Source` (for its defaults) plus one row in :mod:`fastio.registry`; a built-in shard format keeps
its reader, source and remote source together in its folder under :mod:`fastio.format`.

Lifecycle, as the loader drives it:

1. :func:`fastio.registry.open_source` opens it once, in the consumer's process.
2. Before the first :meth:`Source.fetch` of an epoch (and of a resumed epoch), the loader calls
   :meth:`Source.plan_reads` (how it fetches: :class:`ReadPlan`), then :meth:`Source.prepare` with the
   shards this rank will read, in the order its batches read them first.
   Sources whose shards become local lazily (downloaded, decompressed into a cache) start bringing them in
   there, ahead of the reads; every other source inherits the no-op. A later call replaces the earlier plan
   (a new epoch, a resume, a new ``iter()``).
3. :meth:`Source.fetch` is called from the consumer's thread, from worker threads (concurrently), or from
   forked worker processes. It may block until the shards it needs are local. Worker processes are forked
   after :meth:`Source.prepare` ran: they hold a copy of the source as it was then, without its threads, so a
   fetch there must find its shards through what survives a fork (files in a cache directory, file locks),
   not through in-memory state that the parent's threads update. Nothing is pickled.

Example::

    class Squares(Source):
        name, num_samples, shard_sizes = "squares", 10, [5, 5]
        def fixed_specs(self):
            return {"y": (torch.int64, ())}
        def fetch(self, indices, buffers, threads, times):
            out = buffers.fixed("y", len(indices))
            out.copy_(torch.from_numpy(indices) ** 2)
            return {"y": out}

    loader = fastio.StreamLoader(Squares(), batch_size=4)
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from fastio.files.mapped import MappedTable
    from fastio.sources.buffers import BatchBuffers

__all__ = [
    "REQUIRED_MEMBERS",
    "ReadPlan",
    "ShardParts",
    "Source",
    "StageTimes",
    "TokenDocuments",
    "missing_members",
    "shard_read_order",
    "torch_dtype",
]

FixedSpecs = dict[str, tuple[torch.dtype, tuple[int, ...]]]
_RANK_SKEW = 2  # batches by which ranks sharing a cache read apart: one step each way, one batch of rounding


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """How the loader fetches a pass, beyond the sample order: what :meth:`Source.plan_reads` is told (a
    source that caches shards checks its cache against it, :mod:`fastio.remote.working_set`).

    Args:
        batch_size: samples per batch (batches are consecutive slices of the pass's indices).
        batches_in_flight: batches fetched at once, the one the consumer waits for included
            (``num_workers + prefetch``; 1 without workers).
        worker_processes: fetches run in forked processes, each keeping its own pins between fetches.
        ranks_share_cache: other ranks may read through the same node cache; they read the same shards in
            step, so their pins widen the window by a few batches each way (:attr:`lead`, :attr:`lag`).

    Example::

        ReadPlan(batch_size=256, batches_in_flight=4)
    """

    batch_size: int = 1
    batches_in_flight: int = 1
    worker_processes: bool = False
    ranks_share_cache: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.batches_in_flight < 1:
            raise ValueError(
                f"batch_size and batches_in_flight must be >= 1, got {self.batch_size}, "
                f"{self.batches_in_flight}"
            )

    @property
    def lead(self) -> int:
        """Batches past the consumer's whose shards are pinned (:mod:`fastio.remote.working_set`)."""
        return _RANK_SKEW if self.ranks_share_cache else 0

    def reach(self, world_size: int) -> int:
        """Samples of the epoch's global order that the shards pinned around one batch span: the batch,
        :attr:`lead` and :attr:`lag` batches, on each of ``world_size`` ranks (:mod:`fastio.pipeline.order`'s
        window leaves room for them)."""
        return (self.lead + self.lag + 1) * self.batch_size * world_size

    @property
    def lag(self) -> int:
        """Batches before the consumer's whose shards may still be pinned (see ``lead``)."""
        stale = self.batches_in_flight - 1 if self.worker_processes else 0
        return stale + (_RANK_SKEW if self.ranks_share_cache else 0)


@dataclasses.dataclass(frozen=True)
class ShardParts:
    """How a source read shard by shard split its shards for ``shuffle=True`` (:meth:`Source.split_shards`):
    each shard into ``parts`` contiguous runs of samples (the last ones one sample shorter where ``parts``
    does not divide a shard), of which the cache holds ``window`` at once (what the order keeps open), the
    largest ``part_samples`` samples long, drawn from ``shards`` shards.

    Example::

        ShardParts(parts=8, window=31, part_samples=64, shards=16)
    """

    parts: int
    window: int
    part_samples: int
    shards: int


class StageTimes:
    """Seconds per loader stage, summed over threads, plus bytes and samples produced. Thread-safe.

    Example::

        times = StageTimes(); times.add("read", 0.01)
    """

    STAGES = ("read", "decode_transform", "collate", "host_to_device")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self.bytes = 0

    def add(self, stage: str, seconds: float, nbytes: int = 0) -> None:
        with self._lock:
            self.seconds[stage] += seconds
            self.bytes += nbytes


class Source(Protocol):
    """What a :class:`fastio.StreamLoader` needs of a batch source (see the module docstring for when the
    loader calls what).

    Subclass it to inherit the defaults of the optional members (``per_sample``, ``requires_shard_order``,
    :meth:`prepare`, :meth:`stats`); a class that does not subclass it must define them all
    (:func:`fastio.registry.open_source` says which are missing).

    Attributes:
        name: what errors and progress bars call the source (a path, a URL, a class name).
        num_samples: samples in the source, every rank's share together.
        shard_sizes: samples per shard in storage order (global index ``i`` lies in the shard whose
            cumulative range holds it); the shard-aware shuffle (:mod:`fastio.pipeline.order`) permutes
            these shards.
        per_sample: False (the default): :meth:`fetch` returns a dict of batched fields (tensors ``[B, ...]``
            or lists); True: it returns a list of ``B`` samples (any Python objects), which the loader passes
            through ``transform`` and ``collate`` (the Python path), as for a map-style ``Dataset``.
        requires_shard_order: True for sources where reading a random sample costs a whole shard (remote
            stores): ``StreamLoader(shuffle=True)`` is a full permutation only where :meth:`shards_held`
            says every shard fits, else a sliding window of parts of shards where :meth:`split_shards`
            splits them, or of that many shards (:mod:`fastio.pipeline.order`).
            Default False.

    Example::

        class Tokens(Source):
            name, num_samples, shard_sizes = "tokens", 6, [6]
            def fixed_specs(self):
                return {"t": (torch.int32, (4,))}
            def fetch(self, indices, buffers, threads, times):
                out = buffers.fixed("t", len(indices))
                out.copy_(torch.from_numpy(indices).int()[:, None].expand(-1, 4))
                return {"t": out}
    """

    name: str
    num_samples: int
    shard_sizes: Sequence[int]
    per_sample: bool = False
    requires_shard_order: bool = False

    def fixed_specs(self) -> FixedSpecs:
        """Fixed-shape fields -> ``(dtype, per-sample shape)``: the loader allocates (and reuses, pins)
        ``[batch_size, *shape]`` buffers for them, which :meth:`fetch` fills (``buffers.fixed(name, B)``)."""
        ...

    def fetch(self, indices: np.ndarray, buffers: BatchBuffers, threads: int, times: StageTimes) -> Any:
        """The batch of global sample ``indices`` (int64, any order, repeats allowed).

        Args:
            indices: global sample indices in ``[0, num_samples)``.
            buffers: this batch's reused output buffers (:class:`fastio.sources.BatchBuffers`).
            threads: threads a native gather may use.
            times: add the seconds spent (``"read"``, ``"decode_transform"``) and bytes read here.

        Returns:
            a dict of batched fields, or a list of samples when ``per_sample`` is True.
        """
        ...

    def prepare(self, shard_order: np.ndarray, epoch: int, indices: np.ndarray | None = None) -> None:
        """Called before the epoch's first :meth:`fetch` with ``shard_order`` (int64): the shards this
        rank reads from this pass on, each once, in the order its batches first touch them; ``indices``: the
        pass's global sample indices in the order they will be fetched (this rank's share, after the resume
        point; batches are consecutive slices of it), so a source can count what each shard still has to
        serve. Default: nothing (the shards are local already).

        Example::

            source.prepare(np.array([3, 0, 2]), epoch=1)   # a remote source starts downloading shard 3
        """
        return None

    def plan_reads(self, plan: ReadPlan) -> None:
        """Called before :meth:`prepare` with how the loader fetches from this pass on (batch size, batches
        in flight, worker processes, ranks that may share a node): a source that caches shards checks its
        cache against it (a remote source's ``cache_limit``). Default: nothing.

        Example::

            source.plan_reads(ReadPlan(batch_size=256, batches_in_flight=4, worker_processes=True))
        """
        return None

    def joined(self, others: Sequence[Source]) -> Source | None:
        """One source serving this one's samples then each of ``others``' (global id: the concatenation),
        or None (the default) when it cannot: a mixed loader (:mod:`fastio.mixing`) then gathers each
        stream with one call instead of one per stream. Optional: a source need not define it.

        Example::

            both = web.joined([code])   # a shard source joins other local shard sets of its schema
        """
        return None

    def shards_held(self) -> int | None:
        """How many shards a source read shard by shard can hold at once (a remote source: its largest
        shards that fit ``cache_limit``); None: every shard. ``shuffle=True`` mixes that many shards at once
        where it is not None (:meth:`fastio.pipeline.settings.OrderSettings.within`). Default: None.

        Example::

            source.shards_held()   # 4: a cache_limit of four shards
        """
        return None

    def split_shards(self, reach: int | None, parts: int | None = None) -> ShardParts | None:
        """Read parts of shards instead of whole ones, where that lets ``shuffle=True`` mix more shards into
        a batch than whole shards could: the loader calls it, when the method exists, with ``reach`` (the
        samples read around each batch, :meth:`ReadPlan.reach`) for ``shuffle=True`` on a source that
        :meth:`shards_held` says cannot hold every shard, and with None otherwise (whole shards again).
        Returns the split, after which ``shard_sizes`` lists the parts' samples (global indices unchanged:
        parts are contiguous and in storage order), or None: whole shards (:mod:`fastio.pipeline.order`'s
        ``"parts"`` and ``"window"``). ``parts``: split each shard into that many, whatever the cache (what
        ``StreamLoader(shuffle="parts", shuffle_parts=P)`` asks, to resume a state dict), or None where the
        source cannot. Default: None (it cannot split).

        Example::

            split = source.split_shards(reach=64)   # ShardParts(parts=8, window=31, ...) or None
        """
        return None

    def stats(self) -> dict[str, Any]:
        """Counters of the source's own (a remote source: ``network_wait_s``, ``downloaded_bytes``,
        ``cache_bytes``, ``cache_limit``...), which :meth:`fastio.StreamLoader.stats` reports as ``source``
        and the progress bar shows. Default: none.

        Example::

            print(source.stats().get("downloaded_bytes", 0))
        """
        return {}


def _nothing_to_settle() -> None:
    """A source that writes nothing in the background for later loaders."""


@dataclasses.dataclass(frozen=True)
class TokenDocuments:
    """Where every sample's token array of one field lies, for ``StreamLoader(pack=...)``
    (:mod:`fastio.assembly.pack`): a source that can be packed offers
    ``token_documents(field) -> TokenDocuments``.

    Attributes:
        shard, src, tokens: per sample (document): its shard (int32, an index into ``table.files``), the byte
            offset of its first token there (int64), its token count (int64).
        dtype: the stored integer dtype of the tokens (native byte order).
        table: the mapped files the gathers read from.
        verify: ``verify(shard_ids)`` runs before shards are read (checksums once per shard; may be a no-op).
        settle: ``settle()`` runs when a pass has yielded its last batch: waits for what the source writes in
            the background for later loaders (Parquet's kept token files; default: nothing).

    Example::

        docs = source.token_documents("tokens")
        print(int(docs.tokens.sum()), "tokens in", len(docs.tokens), "documents")
    """

    shard: np.ndarray
    src: np.ndarray
    tokens: np.ndarray
    dtype: np.dtype
    table: MappedTable
    verify: Callable[[np.ndarray], None]
    settle: Callable[[], None] = _nothing_to_settle


REQUIRED_MEMBERS = ("name", "num_samples", "shard_sizes", "per_sample", "requires_shard_order")
_REQUIRED_METHODS = ("fixed_specs", "fetch", "prepare", "plan_reads", "shards_held", "stats")


def missing_members(source: Any) -> list[str]:
    """The members of :class:`Source` that ``source`` lacks (empty when it meets the protocol).

    Example::

        assert missing_members(object())[-1] == "stats()"
    """
    missing = [name for name in REQUIRED_MEMBERS if not hasattr(source, name)]
    return missing + [f"{name}()" for name in _REQUIRED_METHODS if not callable(getattr(source, name, None))]


def shard_read_order(shard_sizes: Sequence[int], indices: np.ndarray) -> np.ndarray:
    """The shards holding ``indices``, each once, in the order the indices first reach them: what the
    loader hands :meth:`Source.prepare`.

    Example::

        assert shard_read_order([2, 2, 2], np.array([5, 4, 0, 3])).tolist() == [2, 0, 1]
    """
    if len(indices) == 0:
        return np.zeros(0, dtype=np.int64)
    cumulative = np.cumsum(np.asarray(shard_sizes, dtype=np.int64))
    shards = np.searchsorted(cumulative, indices, side="right")
    _, first = np.unique(shards, return_index=True)
    return shards[np.sort(first)].astype(np.int64)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (native byte order required).

    Example::

        torch_dtype(np.dtype("uint8")) is torch.uint8
    """
    if not dtype.isnative:
        raise ValueError(f"{dtype} is not in native byte order; torch cannot view it")
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
