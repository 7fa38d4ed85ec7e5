"""Sources of a :class:`fastio.StreamLoader`: each turns global sample indices into one batch.

* :class:`ShardSource` (a fastio shard directory): fixed fields gathered natively into the caller's output
  tensors, variable fields gathered back to back into one reused payload buffer and returned as views.
* :class:`TarSource` (WebDataset tar shards): a ``.npy`` field whose members share one header throughout the
  set is gathered like a fixed field (the header is skipped by offset), integer fields (``cls``...) are
  decoded once at open and gathered as an int64 tensor, everything else decoded per sample.
* :class:`DatasetSource` (any map-style ``Dataset``): ``__getitems__`` when present, else ``__getitem__``.

Example::

    source = open_source("data/train")
    batch = source.fetch(np.arange(8), BatchBuffers(source.fixed_specs(), 8, pin=False), threads=2)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastio._native import MappedTable, gather_ranges, gather_rows, read_ranges
from fastio.errors import CorruptShardError
from fastio.format.decode import INT_EXTENSIONS, decode_default, last_extension, npy_layout
from fastio.format.reader import ShardSet
from fastio.format.tar import TarShardSet

__all__ = [
    "BatchBuffers",
    "BufferPool",
    "DatasetSource",
    "ShardSource",
    "StageTimes",
    "TarSource",
    "open_source",
    "storage_refs",
]


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (native byte order required).

    Example::

        torch_dtype(np.dtype("uint8")) is torch.uint8
    """
    if not dtype.isnative:
        raise ValueError(f"{dtype} is not in native byte order; torch cannot view it")
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


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


class BatchBuffers:
    """Reused output tensors of one in-flight batch: ``[batch_size, *shape]`` per fixed field (pinned when
    asked) and one growable uint8 payload buffer per variable field.

    Example::

        buffers = BatchBuffers({"x": (torch.uint8, (3, 32, 32))}, batch_size=256, pin=False)
        out = buffers.fixed("x", 100)   # a view of the first 100 rows
    """

    def __init__(
        self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], batch_size: int, pin: bool
    ) -> None:
        self.pin = pin
        self._fixed = {
            name: torch.empty((batch_size, *shape), dtype=dtype, pin_memory=pin)
            for name, (dtype, shape) in specs.items()
        }
        self._payload: dict[str, torch.Tensor] = {}
        self.event: Any = None  # a CUDA event: the last host-to-device copy out of these buffers

    def fixed(self, name: str, rows: int) -> torch.Tensor:
        return self._fixed[name][:rows]

    def payload(self, name: str, nbytes: int) -> torch.Tensor:
        buf = self._payload.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1) * 5 // 4 + 64, dtype=torch.uint8, pin_memory=self.pin)
            self._payload[name] = buf
        return buf[:nbytes]

    def held(self) -> bool:
        """True while any tensor outside these buffers still views their memory (a batch the consumer
        kept, a slice of it, a numpy view of it): refilling them now would change data someone holds.

        Counts the references to each buffer's storage: the buffer itself holds one, every live view one.

        Example::

            buffers = BatchBuffers({"y": (torch.int64, ())}, batch_size=4, pin=False)
            kept = buffers.fixed("y", 4)
            assert buffers.held()
            del kept
            assert not buffers.held()
        """
        return any(storage_refs(t) > 1 for t in (*self._fixed.values(), *self._payload.values()))

    def held_count(self) -> tuple[int, int]:
        """``(held, total)``: how many of the buffers are held (see :meth:`held`), of how many."""
        buffers = (*self._fixed.values(), *self._payload.values())
        return sum(storage_refs(t) > 1 for t in buffers), len(buffers)

    def renew_held(self) -> None:
        """Replace every held buffer with fresh memory and leave the old one to whoever views it: a user who
        keeps only the labels of each batch costs one small allocation per batch, not a new image buffer.

        Example::

            buffers = BatchBuffers({"y": (torch.int64, ()), "x": (torch.uint8, (8,))}, 4, pin=False)
            kept, x = buffers.fixed("y", 4), buffers.fixed("x", 4).data_ptr()
            buffers.renew_held()
            assert buffers.fixed("y", 4).data_ptr() != kept.data_ptr()
            assert buffers.fixed("x", 4).data_ptr() == x
        """
        for name, t in self._fixed.items():
            if storage_refs(t) > 1:
                self._fixed[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        self._payload = {name: t for name, t in self._payload.items() if storage_refs(t) == 1}


class BufferPool:
    """The :class:`BatchBuffers` of the batches in flight: a set is refilled only when nothing outside the
    loader still views it (:meth:`BatchBuffers.held`); otherwise a fresh set is made and the held one is left
    to whoever holds it. Thread-safe.

    1. :meth:`acquire` hands out an idle set that is not held; else the idle set with the fewest held
       buffers, those renewed (:meth:`BatchBuffers.renew_held`), if some of it is free; else a new set.
    2. :meth:`release` takes it back once the batch is made (its views then live in the batch); at most
       ``keep`` sets are kept for reuse, dropping the longest-held first. ``keep=0``: fresh sets every time.

    Example::

        pool = BufferPool({"y": (torch.int64, ())}, batch_size=4, pin=False, keep=3)
        buffers = pool.acquire()
        kept = buffers.fixed("y", 4)
        pool.release(buffers)
        assert pool.acquire() is not buffers   # `kept` still views it: a fresh set
    """

    def __init__(
        self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], batch_size: int, pin: bool, keep: int
    ) -> None:
        self.specs, self.batch_size, self.pin, self.keep = specs, batch_size, pin, keep
        self._idle: list[BatchBuffers] = []
        self._lock = threading.Lock()

    def acquire(self) -> BatchBuffers:
        with self._lock:
            for i, buffers in enumerate(self._idle):
                if not buffers.held():
                    return self._idle.pop(i)
            free = [total - held for held, total in (buffers.held_count() for buffers in self._idle)]
            if free and max(free) > 0:
                buffers = self._idle.pop(free.index(max(free)))
                buffers.renew_held()
                return buffers
        return BatchBuffers(self.specs, self.batch_size, self.pin)

    def release(self, buffers: BatchBuffers) -> None:
        if not self.keep:
            return
        with self._lock:
            self._idle.append(buffers)
            if len(self._idle) > self.keep:
                self._idle.pop(next((i for i, b in enumerate(self._idle) if b.held()), 0))


def storage_refs(tensor: torch.Tensor) -> int:
    """Tensors (and views) sharing ``tensor``'s storage, ``tensor`` itself included.

    Example::

        base = torch.zeros(4)
        view = base[1:]
        assert storage_refs(base) == 2
    """
    # untyped_storage() makes a temporary Python storage that holds one reference of its own.
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) - 1


def _locate(cumulative: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    shard = np.searchsorted(cumulative, indices, side="right") - 1
    return shard.astype(np.int32), indices - cumulative[shard]


class _MappedSource:
    num_samples: int
    shard_sizes: list[int]

    def _init_locator(self) -> None:
        self.cumulative = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)

    def check_indices(self, indices: np.ndarray) -> None:
        if len(indices) and (indices.min() < 0 or indices.max() >= self.num_samples):
            raise IndexError(f"sample index out of range [0, {self.num_samples})")


class ShardSource(_MappedSource):
    """A fastio shard directory as a batch source.

    Example::

        source = ShardSource(ShardSet("data/train"))
    """

    def __init__(self, shards: ShardSet) -> None:
        self.shards = shards
        self.name = str(shards.directory)
        self.schema = shards.schema
        self.shard_sizes = shards.shard_sizes
        self.num_samples = shards.num_samples
        self._init_locator()
        self.table = MappedTable([r.file for r in shards.readers])
        self._verified = np.zeros(len(shards.readers), dtype=bool)
        self._all_verified = False
        self._verify_lock = threading.Lock()
        self._fixed_start = {
            name: np.array([r.sections[name]["data"][0] for r in shards.readers], dtype=np.int64)
            for name, f in self.schema.items()
            if f.kind == "fixed"
        }
        self._variable = {
            name: [r.variable_layout(name) for r in shards.readers]
            for name, f in self.schema.items()
            if f.is_variable
        }

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {n: (torch_dtype(f.np_dtype), f.shape) for n, f in self.schema.items() if f.kind == "fixed"}

    def _verify(self, shard_ids: np.ndarray) -> None:
        if self._all_verified:
            return
        todo = np.unique(shard_ids[~self._verified[shard_ids]])
        for s in todo:
            with self._verify_lock:
                if not self._verified[s]:
                    self.shards.readers[int(s)].ensure_verified()
                    self._verified[s] = True
                    self._all_verified = bool(self._verified.all())

    def fetch(
        self, indices: np.ndarray, buffers: BatchBuffers, threads: int, times: StageTimes
    ) -> dict[str, Any]:
        start = time.perf_counter()
        shard_ids, local = _locate(self.cumulative, indices)
        self._verify(shard_ids)
        batch: dict[str, Any] = {}
        nbytes = 0
        for name, field in self.schema.items():
            if field.kind == "fixed":
                out = buffers.fixed(name, len(indices))
                row = field.row_nbytes
                gather_rows(
                    self.table, shard_ids, self._fixed_start[name][shard_ids] + local * row, row, out, threads
                )
                batch[name] = out
                nbytes += out.numel() * out.element_size()
            else:
                batch[name], n = self._fetch_variable(name, field, shard_ids, local, buffers, threads)
                nbytes += n
        times.add("read", time.perf_counter() - start, nbytes)
        return batch

    def _fetch_variable(
        self,
        name: str,
        field: Any,
        shard_ids: np.ndarray,
        local: np.ndarray,
        buffers: BatchBuffers,
        threads: int,
    ) -> tuple[list[Any], int]:
        src = np.empty(len(local), dtype=np.int64)
        lengths = np.empty(len(local), dtype=np.int64)
        for s in np.unique(shard_ids):
            mask = shard_ids == s
            offsets, base = self._variable[name][int(s)]
            first = offsets[local[mask]]
            src[mask] = base + first
            lengths[mask] = offsets[local[mask] + 1] - first
        total = int(lengths.sum())
        if field.kind in ("bytes", "str"):
            raw = read_ranges(self.table, shard_ids, src, lengths)
            if field.kind == "bytes":
                return raw, total
            texts = []
            for row, data in enumerate(raw):
                try:
                    texts.append(data.decode("utf-8"))
                except UnicodeDecodeError:
                    raise CorruptShardError(
                        self.table.files[int(shard_ids[row])].path,
                        f"{name}[{int(local[row])}]",
                        "UTF-8 text",
                        repr(data[:40]),
                    ) from None
            return texts, total
        payload = buffers.payload(name, total)
        gather_ranges(self.table, shard_ids, src, lengths, payload, threads)
        typed = payload.view(torch_dtype(field.np_dtype))
        parts = torch.split(typed, (lengths // field.np_dtype.itemsize).tolist())
        if field.shape:
            parts = [p.view(-1, *field.shape) for p in parts]
        return list(parts), total


class TarSource(_MappedSource):
    """WebDataset tar shards as a batch source (fields named as WebDataset names them, plus ``__key__``).

    Args:
        shards: the indexed tar set.
        decode: None for :func:`fastio.format.decode.decode_default`, ``"pil"`` for that plus Pillow images,
            or ``decode(field, data: bytes) -> value`` for every field (no fast paths then).

    Example::

        source = TarSource(TarShardSet("data/shard-{000000..000003}.tar"))
    """

    def __init__(self, shards: TarShardSet, decode: Callable[[str, bytes], Any] | str | None = None) -> None:
        if decode is not None and decode != "pil" and not callable(decode):
            raise ValueError(f"decode must be None, 'pil' or a callable, got {decode!r}")
        self.shards = shards
        self.name = (
            shards.paths[0] if len(shards.paths) == 1 else f"{shards.paths[0]} (+{len(shards.paths) - 1})"
        )
        self.decode = decode
        self.shard_sizes = shards.shard_sizes
        self.num_samples = shards.num_samples
        self._init_locator()
        self.table = MappedTable(shards.files)
        self.keys = np.concatenate([ix.keys for ix in shards.indexes])
        self.columns = {f: shards.column(f) for f in shards.fields}
        self._shard_of = np.repeat(np.arange(len(shards.files), dtype=np.int32), self.shard_sizes)
        self._npy_fixed: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        self._ints: dict[str, np.ndarray] = {}
        if not callable(decode):
            for field in shards.fields:
                offsets, sizes = self.columns[field]
                if (sizes < 0).any():
                    continue
                kind = last_extension(field)
                if kind == "npy":
                    spec = self._uniform_npy(field, offsets, sizes)
                    if spec is not None:
                        self._npy_fixed[field] = spec
                elif kind in INT_EXTENSIONS:
                    self._ints[field] = self._decode_ints(field, offsets, sizes)

    def _uniform_npy(
        self, field: str, offsets: np.ndarray, sizes: np.ndarray
    ) -> tuple[np.dtype, tuple[int, ...], int] | None:
        if (sizes != sizes[0]).any():
            return None
        shard0 = self.table.files[int(self._shard_of[0])]
        first = read_ranges(self.table, self._shard_of[:1], offsets[:1], sizes[:1])[0]
        # Every member has this size and (checked below) this header, so one check covers them all.
        member = f"{self.keys[0]}.{field}"
        dtype, shape, fortran, header = npy_layout(first, int(sizes[0]), shard0.path, member)
        if fortran or dtype.hasobject or not dtype.isnative:
            return None
        reference = torch.frombuffer(bytearray(first[:header]), dtype=torch.uint8)
        step = 1 << 16  # bounded scratch memory for huge shards
        heads = torch.empty((min(step, len(offsets)), header), dtype=torch.uint8)
        for chunk in range(0, len(offsets), step):
            rows = slice(chunk, chunk + step)
            out = heads[: len(offsets[rows])]
            gather_rows(self.table, self._shard_of[rows], offsets[rows], header, out)
            if (out != reference).any():
                return None
        return dtype, shape, header

    def _decode_ints(self, field: str, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        files = self.table.files
        raw = read_ranges(self.table, self._shard_of, offsets, sizes)
        return np.array(
            [
                decode_default(field, data, path=files[s].path, member=f"{key}.{field}")
                for s, key, data in zip(self._shard_of.tolist(), self.keys.tolist(), raw, strict=True)
            ],
            dtype=np.int64,
        )

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        specs = {name: (torch_dtype(dtype), shape) for name, (dtype, shape, _) in self._npy_fixed.items()}
        specs.update({name: (torch.int64, ()) for name in self._ints})
        return specs

    def fetch(
        self, indices: np.ndarray, buffers: BatchBuffers, threads: int, times: StageTimes
    ) -> dict[str, Any]:
        start = time.perf_counter()
        shard_ids = self._shard_of[indices]
        batch: dict[str, Any] = {"__key__": self.keys[indices].tolist()}
        nbytes = 0
        for name, (_, _, header) in self._npy_fixed.items():
            out = buffers.fixed(name, len(indices))
            offsets, sizes = self.columns[name]
            row = int(sizes[0]) - header
            gather_rows(self.table, shard_ids, offsets[indices] + header, row, out, threads)
            batch[name] = out
            nbytes += row * len(indices)
        for name, values in self._ints.items():
            out = buffers.fixed(name, len(indices))
            out.copy_(torch.from_numpy(values[indices]))
            batch[name] = out
        read_done = time.perf_counter()
        times.add("read", read_done - start, nbytes)
        files = self.table.files
        decoded = 0
        for name in self.shards.fields:
            if name in batch:
                continue
            offsets, sizes = self.columns[name]
            sizes = sizes[indices]
            present = np.flatnonzero(sizes >= 0)
            raw = read_ranges(self.table, shard_ids[present], offsets[indices][present], sizes[present])
            values = [None] * len(indices)
            decoded += int(sizes[present].sum())
            for row, data in zip(present.tolist(), raw, strict=True):
                if callable(self.decode):
                    values[row] = self.decode(name, data)
                    continue
                try:
                    values[row] = decode_default(name, data, images=self.decode)
                except CorruptShardError as err:  # name the tar and the member (not known to the decoder)
                    path, member = files[int(shard_ids[row])].path, f"{batch['__key__'][row]}.{name}"
                    raise CorruptShardError(path, member, err.expected, err.actual) from None
            batch[name] = values
        times.add("decode_transform", time.perf_counter() - read_done, decoded)
        return batch


class DatasetSource:
    """A map-style ``torch.utils.data.Dataset`` as a batch source: whole batches through ``__getitems__``
    where the dataset has it, else one ``__getitem__`` per sample. Returns the list of samples.

    Example::

        source = DatasetSource(torchvision_dataset)
    """

    def __init__(self, dataset: Any) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"{type(dataset).__name__} is not a map-style Dataset (needs __len__ and __getitem__)"
            )
        self.dataset = dataset
        self.name = type(dataset).__name__
        self.num_samples = len(dataset)
        self.shard_sizes = [self.num_samples]

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {}

    def fetch(self, indices: np.ndarray, buffers: BatchBuffers, threads: int, times: StageTimes) -> list[Any]:
        start = time.perf_counter()
        wanted = indices.tolist()
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = list(getitems(wanted)) if getitems is not None else [self.dataset[i] for i in wanted]
        times.add("read", time.perf_counter() - start)
        return samples


def open_source(
    source: Any,
    decode: Callable[[str, bytes], Any] | str | None = None,
    verify: bool | None = None,
    tar_strict: bool = True,
) -> ShardSource | TarSource | DatasetSource:
    """The batch source for what :class:`fastio.StreamLoader` was given.

    A directory -> :class:`ShardSource`; a ``.tar`` path, glob or brace pattern (or a list of them) ->
    :class:`TarSource`; an object with ``__len__`` and ``__getitem__`` -> :class:`DatasetSource`.

    ``tar_strict`` is :class:`TarShardSet`'s ``strict``: refuse tars without a clean end-of-archive marker.

    Example::

        open_source("data/shard-{000000..000009}.tar")
    """
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if os.path.isdir(text):
            return ShardSource(ShardSet(text, verify=verify))
        if text.endswith(".tar") or any(c in text for c in "*?[{"):
            return TarSource(TarShardSet(text, strict=tar_strict), decode=decode)
        if not os.path.exists(text):
            raise FileNotFoundError(f"{text}: no such shard directory or tar shard")
        raise ValueError(f"{text}: expected a fastio shard directory or WebDataset .tar shards")
    if isinstance(source, Sequence) and source and all(isinstance(s, (str, os.PathLike)) for s in source):
        return TarSource(TarShardSet([os.fspath(s) for s in source], strict=tar_strict), decode=decode)
    return DatasetSource(source)
