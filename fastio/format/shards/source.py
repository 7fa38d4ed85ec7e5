"""A fastio shard directory (:class:`fastio.ShardWriter`) as a batch source: fixed fields gathered natively
into the caller's output tensors, variable fields gathered back to back into one reused payload buffer and
returned as views.

Example::

    source = ShardSource(ShardSet("data/train"))
    batch = source.fetch(np.arange(8), BatchBuffers(source.fixed_specs(), 8, pin=False), 2, StageTimes())
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastio.errors import CorruptShardError, SchemaMismatchError
from fastio.files.gather import gather_ranges, gather_rows, read_ranges
from fastio.files.mapped import MappedTable
from fastio.format.shards.reader import ShardReader, ShardSet
from fastio.format.shards.schema import Schema
from fastio.sources.base import Source, StageTimes, TokenDocuments, torch_dtype
from fastio.sources.buffers import BatchBuffers

if TYPE_CHECKING:
    from fastio.options import OpenOptions

__all__ = ["ShardSource", "fixed_specs_of", "open_shard_directory"]


def fixed_specs_of(schema: Schema) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The fixed fields of a schema as :meth:`fastio.sources.Source.fixed_specs` gives them: the batch
    buffers a shard source (local or remote) fills.

    Example::

        fixed_specs_of(ShardSet("data/train").schema)   # {"x": (torch.uint8, (3, 32, 32)), ...}
    """
    return {n: (torch_dtype(f.np_dtype), f.shape) for n, f in schema.items() if f.kind == "fixed"}


def _locate(cumulative: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    shard = np.searchsorted(cumulative, indices, side="right") - 1
    return shard.astype(np.int32), indices - cumulative[shard]


@dataclasses.dataclass(frozen=True)
class _JoinedSets:
    """Shard sets of one schema read as one set (what :meth:`ShardSource.joined` serves)."""

    directory: str
    schema: Schema
    readers: list[ShardReader]
    shard_sizes: list[int]
    num_samples: int


class ShardSource(Source):
    """A fastio shard directory as a batch source.

    Example::

        source = ShardSource(ShardSet("data/train"))
    """

    def __init__(self, shards: ShardSet | _JoinedSets) -> None:
        self.shards = shards
        self.name = str(shards.directory)
        self.schema = shards.schema
        self.shard_sizes = shards.shard_sizes
        self.num_samples = shards.num_samples
        self.cumulative = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
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
        return fixed_specs_of(self.schema)

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

    def joined(self, others: Sequence[Source]) -> ShardSource | None:
        """One local shard source over this set's shards, then each of ``others``', when every one is a
        local shard source of the same schema; else None (see :meth:`fastio.sources.Source.joined`).

        Example::

            both = ShardSource(ShardSet("data/web")).joined([ShardSource(ShardSet("data/code"))])
        """
        sets = [self, *others]
        if any(type(s) is not ShardSource or s.schema != self.schema for s in sets):
            return None
        shards = [s.shards for s in sets if isinstance(s, ShardSource)]
        return ShardSource(
            _JoinedSets(
                " + ".join(str(s.directory) for s in shards),
                self.schema,
                [r for s in shards for r in s.readers],
                [n for s in shards for n in s.shard_sizes],
                sum(s.num_samples for s in shards),
            )
        )

    def token_documents(self, field_name: str) -> TokenDocuments:
        """The documents of a 1-D variable-length integer field, for ``pack=`` (:mod:`fastio.assembly.pack`).

        Example::

            docs = ShardSource(ShardSet("data/lm")).token_documents("tokens")
        """
        field = self.schema.get(field_name)
        expected = "a 1-D variable-length integer array, e.g. ShardWriter(schema={name: ('int32', None)})"
        if field is None:
            raise SchemaMismatchError(
                self.name, field_name, expected, f"no such field (has {sorted(self.schema)})"
            )
        if field.kind != "array" or field.shape or field.np_dtype.kind not in "iu":
            raise SchemaMismatchError(self.name, field_name, expected, field.describe())
        itemsize = field.np_dtype.itemsize
        shards, srcs, counts = [], [], []
        for s, reader in enumerate(self.shards.readers):
            offsets, base = reader.variable_layout(field_name)
            if (offsets % itemsize).any():
                raise CorruptShardError(
                    reader.path,
                    f"{field_name}.offsets",
                    f"multiples of {itemsize} bytes",
                    "a misaligned offset",
                )
            counts.append(np.diff(offsets) // itemsize)
            srcs.append(base + offsets[:-1])
            shards.append(np.full(len(offsets) - 1, s, dtype=np.int32))
        return TokenDocuments(
            np.concatenate(shards),
            np.concatenate(srcs).astype(np.int64),
            np.concatenate(counts),
            field.np_dtype,
            self.table,
            self._verify,
        )

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


def open_shard_directory(directory: str, options: OpenOptions) -> ShardSource:
    """The registry's opener of a fastio shard directory (``options.verify`` applies).

    Example::

        source = open_shard_directory("data/train", OpenOptions())
    """
    return ShardSource(ShardSet(directory, verify=options.verify))
