"""WebDataset tar shards as a batch source: a ``.npy`` field whose members share one header throughout the
set is gathered like a fixed field (the header is skipped by offset), integer fields (``cls``...) are decoded
once at open and gathered as an int64 tensor, everything else decoded per sample.

Example::

    source = TarSource(TarShardSet("data/shard-{000000..000003}.tar"))
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastio.errors import CorruptShardError, SchemaMismatchError
from fastio.files.gather import gather_rows, read_ranges
from fastio.files.mapped import MappedTable
from fastio.format.tar.decode import INT_EXTENSIONS, decode_default, last_extension, npy_layout
from fastio.format.tar.index import TarShardSet
from fastio.sources.base import Source, StageTimes, TokenDocuments, torch_dtype
from fastio.sources.buffers import BatchBuffers

if TYPE_CHECKING:
    from fastio.options import OpenOptions

__all__ = ["TarLayout", "TarSource", "decide_layout", "open_tar_shards"]


@dataclasses.dataclass(frozen=True)
class TarLayout:
    """How a tar set's fields come out of :meth:`TarSource.fetch`: decided once over the whole set, so a
    source over part of its shards (a remote cache's) gives batches of the same fields and types.

    Attributes:
        fields: every field of the set, in order (a batch has each; ``None`` where a sample lacks it).
        npy_fixed: ``.npy`` fields whose members share one header throughout the set, gathered as tensors:
            field -> ``(dtype, shape, header bytes)``.
        ints: integer fields (``cls``...) present in every sample, decoded at open to an int64 tensor.

    Example::

        layout = TarSource(TarShardSet("data/shard-{000000..000003}.tar")).layout
        part = TarSource(TarShardSet.from_parts(paths[:1], indexes[:1]), layout=layout)
    """

    fields: tuple[str, ...]
    npy_fixed: dict[str, tuple[np.dtype, tuple[int, ...], int]]
    ints: tuple[str, ...]

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The batch buffers a source of this layout fills: the gathered ``.npy`` fields, the int fields.

        Example::

            specs = layout.fixed_specs()   # {"x.npy": (torch.float32, (3, 8)), "cls": (torch.int64, ())}
        """
        specs = {name: (torch_dtype(dtype), shape) for name, (dtype, shape, _) in self.npy_fixed.items()}
        specs.update({name: (torch.int64, ()) for name in self.ints})
        return specs


NpySpec = tuple[np.dtype, tuple[int, ...], int]


def decide_layout(
    fields: Sequence[str],
    present: Callable[[str], bool],
    uniform_npy: Callable[[str], NpySpec | None],
    decode: Callable[[str, bytes], Any] | str | None,
) -> TarLayout:
    """The one decision of how a tar set's fields come out, for a local set and a remote one alike: a field
    in every sample (``present(field)``) is an int64 tensor when its extension is an integer one (``cls``...),
    a gathered tensor when it is ``.npy`` and ``uniform_npy(field)`` gives its ``(dtype, shape, header
    bytes)`` (members of one size and header throughout); everything else is decoded per sample. A
    ``decode`` callable decodes every field itself: no tensors then.

    Example::

        layout = decide_layout(["x.npy", "cls"], lambda f: True, lambda f: None, decode=None)
    """
    npy: dict[str, NpySpec] = {}
    ints: list[str] = []
    if not callable(decode):
        for field in fields:
            if not present(field):
                continue
            kind = last_extension(field)
            if kind == "npy":
                spec = uniform_npy(field)
                if spec is not None:
                    npy[field] = spec
            elif kind in INT_EXTENSIONS:
                ints.append(field)
    return TarLayout(tuple(fields), npy, tuple(ints))


class TarSource(Source):
    """WebDataset tar shards as a batch source (fields named as WebDataset names them, plus ``__key__``).

    Args:
        shards: the indexed tar set.
        decode: None for :func:`fastio.format.tar.decode.decode_default`, ``"pil"`` for that plus Pillow
            images, or ``decode(field, data: bytes) -> value`` for every field (no fast paths then).
        layout: the :class:`TarLayout` of a larger set these shards are part of (``.layout`` of a source
            over that set); default: decided from these shards. A ``.npy`` member that does not fit it
            raises :class:`fastio.SchemaMismatchError`.

    Example::

        source = TarSource(TarShardSet("data/shard-{000000..000003}.tar"))
    """

    def __init__(
        self,
        shards: TarShardSet,
        decode: Callable[[str, bytes], Any] | str | None = None,
        layout: TarLayout | None = None,
    ) -> None:
        if decode is not None and decode != "pil" and not callable(decode):
            raise ValueError(f"decode must be None, 'pil' or a callable, got {decode!r}")
        self.shards = shards
        self.name = (
            shards.paths[0] if len(shards.paths) == 1 else f"{shards.paths[0]} (+{len(shards.paths) - 1})"
        )
        self.decode = decode
        self.shard_sizes = shards.shard_sizes
        self.num_samples = shards.num_samples
        self.table = MappedTable(shards.files)
        self.keys = np.concatenate([ix.keys for ix in shards.indexes])
        fields = list(layout.fields) if layout is not None else shards.fields
        self.columns = {f: shards.column(f) for f in fields}
        self._shard_of = np.repeat(np.arange(len(shards.files), dtype=np.int32), self.shard_sizes)
        self._npy_fixed: dict[str, NpySpec] = {}
        self._ints: dict[str, np.ndarray] = {}
        if layout is not None:
            self._apply(layout)
        else:
            layout = decide_layout(
                fields,
                lambda field: bool((self.columns[field][1] >= 0).all()),
                lambda field: self._uniform_npy(field, *self.columns[field]),
                decode,
            )
            self._npy_fixed = dict(layout.npy_fixed)
            self._ints = {field: self._decode_ints(field, *self.columns[field]) for field in layout.ints}
        self.layout = layout

    def joined(self, others: Sequence[Source]) -> TarSource | None:
        """One tar source over this set's shards, then each of ``others``', when every one is a local tar
        source of the same layout and decoding; else None (see :meth:`fastio.sources.Source.joined`).

        Example::

            both = TarSource(TarShardSet("web-*.tar")).joined([TarSource(TarShardSet("code-*.tar"))])
        """
        sets = [self, *others]
        if any(type(s) is not TarSource or s.layout != self.layout or s.decode != self.decode for s in sets):
            return None
        shards = [s.shards for s in sets if isinstance(s, TarSource)]
        joined = TarShardSet.from_parts(
            [p for s in shards for p in s.paths],
            [ix for s in shards for ix in s.indexes],
            [f for s in shards for f in s.files],
        )
        return TarSource(joined, self.decode, self.layout)

    def _apply(self, layout: TarLayout) -> None:
        for field, spec in layout.npy_fixed.items():
            offsets, sizes = self.columns[field]
            found = self._uniform_npy(field, offsets, sizes) if (sizes >= 0).all() else None
            if found is None or found[0] != spec[0] or found[1:] != spec[1:]:
                raise SchemaMismatchError(
                    self.name,
                    field,
                    f"{spec[0]} {spec[1]} .npy, a {spec[2]}-byte header, in every sample (the set's)",
                    "members that differ"
                    if found is None
                    else f"{found[0]} {found[1]}, {found[2]}-byte header",
                )
            self._npy_fixed[field] = spec
        for field in layout.ints:
            offsets, sizes = self.columns[field]
            if (sizes < 0).any():
                raise SchemaMismatchError(self.name, field, "in every sample (the set's)", "missing in some")
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
        raw = read_ranges(self.table, self._shard_of, offsets, sizes)
        try:
            # decode_default's int(raw) without its per-sample dispatch: this runs once per sample at open.
            return np.array([int(data) for data in raw], dtype=np.int64)
        except (ValueError, OverflowError):
            pass  # decode them one by one below, so the first bad member raises its named error
        files = self.table.files
        return np.array(
            [
                decode_default(field, data, path=files[s].path, member=f"{key}.{field}")
                for s, key, data in zip(self._shard_of.tolist(), self.keys.tolist(), raw, strict=True)
            ],
            dtype=np.int64,
        )

    def token_documents(self, field_name: str) -> TokenDocuments:
        """The documents of a ``.npy`` member of 1-D integer arrays, for ``pack=``
        (:mod:`fastio.assembly.pack`): each member's header is parsed once.

        Example::

            docs = TarSource(TarShardSet("data/lm-{0..3}.tar")).token_documents("tokens.npy")
        """
        expected = "a .npy member of a 1-D native-endian integer array in every sample (e.g. 'tokens.npy')"
        if field_name not in self.shards.fields or not field_name.endswith(".npy"):
            raise SchemaMismatchError(self.name, field_name, expected, f"members {self.shards.fields}")
        offsets, sizes = self.shards.column(field_name)
        shard = np.repeat(np.arange(len(self.shard_sizes), dtype=np.int32), self.shard_sizes)
        files = self.table.files
        dtype = None
        src, counts = np.empty(len(offsets), np.int64), np.empty(len(offsets), np.int64)
        for i, (s, at, size) in enumerate(zip(shard.tolist(), offsets.tolist(), sizes.tolist(), strict=True)):
            path = files[s].path
            if size < 0:
                raise SchemaMismatchError(path, field_name, expected, f"sample {i} has no {field_name}")
            member = f"{field_name} (sample {i})"
            kind, shape, _, header = npy_layout(files[s].array[at : at + size], size, path, member)
            if (
                len(shape) != 1
                or kind.kind not in "iu"
                or not kind.isnative
                or (dtype is not None and kind != dtype)
            ):
                found = f"sample {i}: {kind} {shape}" + (
                    f" after {dtype} members" if dtype is not None else ""
                )
                raise SchemaMismatchError(path, field_name, expected, found)
            dtype, src[i], counts[i] = kind, at + header, shape[0]
        return TokenDocuments(shard, src, counts, dtype, self.table, _no_checksums)

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return self.layout.fixed_specs()

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
        for name in self.layout.fields:
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


def _no_checksums(shard_ids: np.ndarray) -> None:
    """Tar shards carry no checksums to verify."""


def open_tar_shards(paths: str | list[str], options: OpenOptions) -> TarSource:
    """The registry's opener of WebDataset tar shards: a path, glob or brace pattern, or a list of them
    (``options.tar_strict`` and ``options.decode`` apply).

    Example::

        source = open_tar_shards("data/shard-{000000..000009}.tar", OpenOptions())
    """
    return TarSource(TarShardSet(paths, strict=options.tar_strict), decode=options.decode)
