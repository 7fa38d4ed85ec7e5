"""Several opened sources as one :class:`fastio.sources.Source` over the concatenation of their samples
(stream ``i``'s sample ``k`` is global id ``k`` plus the samples of the streams before it), adding the
provenance field ``"stream"``.

1. At build: the streams must make batches of one kind (all per-sample ``Dataset`` s, or all batched
   sources) with the same fixed fields (names, dtypes, shapes); else ``ValueError`` naming the streams and
   the field.
2. :meth:`MixedSource.fetch`: sources that join into one (:meth:`fastio.sources.Source.joined`: local
   shard directories of one schema, local tars of one layout) gather a whole batch in one call. Otherwise
   it splits the ids by stream: when they come grouped by stream (as :mod:`fastio.mixing.schedule` lays
   them out), each stream's source gathers its rows straight into its stretch of the batch buffers;
   otherwise (a resume at another layout, the padded tail) the rows are gathered grouped and put back in
   the asked order. Variable fields are joined as lists; every stream must return the same fields.
3. Provenance: batched sources get ``batch["stream"]``, an int64 tensor ``[B]`` of stream indices; per-sample
   sources' dict samples get a ``"stream"`` key (a copy of the sample; other sample types are left alone).
4. ``prepare``/``plan_reads`` go to each stream with its own shards and ids; ``stats()`` reports each
   stream's counters under ``"streams"``.

Example::

    web, code = open_source("data/web", options), open_source("data/code", options)
    source = MixedSource([web, code], ["web", "code"])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastio.files.mapped import MappedTable
from fastio.sources.base import ReadPlan, Source, StageTimes, TokenDocuments
from fastio.sources.buffers import BatchBuffers

__all__ = ["PROVENANCE_FIELD", "MixedSource", "open_streams"]

PROVENANCE_FIELD = "stream"


class _StretchBuffers:
    """A stream's view of a batch's buffers: its rows start at ``first``; its variable fields get payload
    buffers of their own (so two streams' payloads never overwrite each other)."""

    def __init__(self, buffers: BatchBuffers, first: int, stream: int) -> None:
        self.buffers, self.first, self.stream = buffers, first, stream
        self.pin = buffers.pin

    def fixed(self, name: str, rows: int) -> torch.Tensor:
        return self.buffers.fixed(name, self.first + rows)[self.first :]

    def payload(self, name: str, nbytes: int) -> torch.Tensor:
        return self.buffers.payload(f"{name}/{PROVENANCE_FIELD}{self.stream}", nbytes)


class MixedSource(Source):
    """The streams' sources as one source (see the module docstring).

    Args:
        sources: the opened sources, in stream order.
        names: what errors call each stream.

    Example::

        source = MixedSource([web, code], ["web", "code"])
        assert source.num_samples == web.num_samples + code.num_samples
    """

    def __init__(self, sources: Sequence[Source], names: Sequence[str]) -> None:
        self.sources, self.names = list(sources), list(names)
        kinds = {bool(s.per_sample) for s in self.sources}
        if len(kinds) > 1:
            batched = [n for n, s in zip(self.names, self.sources, strict=True) if not s.per_sample]
            per_sample = [n for n, s in zip(self.names, self.sources, strict=True) if s.per_sample]
            raise ValueError(
                f"streams {per_sample} give samples (map-style Datasets) but {batched} give batched fields: "
                "they cannot share a batch; mix sources of one kind (e.g. write the Datasets to shards)"
            )
        self.per_sample = kinds.pop()
        self._specs = self._common_specs()
        self.name = "streams(" + ", ".join(self.names) + ")"
        sizes = np.array([s.num_samples for s in self.sources], dtype=np.int64)
        self.ends = np.cumsum(sizes)
        self.starts = self.ends - sizes
        self.num_samples = int(self.ends[-1])
        self.shard_sizes = [int(n) for s in self.sources for n in s.shard_sizes]
        shard_counts = np.array([len(s.shard_sizes) for s in self.sources], dtype=np.int64)
        self.shard_ends = np.cumsum(shard_counts)
        self.requires_shard_order = any(s.requires_shard_order for s in self.sources)
        # Streams whose prepare() does something (the default does nothing): local shards need none.
        self._preparing = [i for i, s in enumerate(self.sources) if type(s).prepare is not Source.prepare]
        join = getattr(self.sources[0], "joined", None)
        self.fused: Source | None = join(self.sources[1:]) if join is not None else None  # all in one

    def _common_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        first = self.sources[0].fixed_specs()
        for name, source in zip(self.names[1:], self.sources[1:], strict=True):
            specs = source.fixed_specs()
            for field in sorted(set(first) | set(specs)):
                if first.get(field) != specs.get(field):
                    raise ValueError(
                        f"streams {self.names[0]!r} and {name!r} disagree on field {field!r}: "
                        f"{_spec_text(first.get(field))} vs {_spec_text(specs.get(field))}; every stream "
                        "must give the same fields with the same dtype and shape to share a batch"
                    )
        if PROVENANCE_FIELD in first:
            raise ValueError(
                f"the streams have a field {PROVENANCE_FIELD!r}, the name of the provenance field a mixed "
                "loader adds; rename it in the data"
            )
        return dict(first)

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        if self.per_sample:
            return dict(self._specs)
        return {**self._specs, PROVENANCE_FIELD: (torch.int64, ())}

    def stream_of(self, ids: np.ndarray) -> np.ndarray:
        """The stream index of each global id.

        Example::

            source.stream_of(np.array([0, source.num_samples - 1])).tolist() == [0, len(source.sources) - 1]
        """
        return self.ends.searchsorted(ids, side="right")

    def fetch(self, indices: np.ndarray, buffers: BatchBuffers, threads: int, times: StageTimes) -> Any:
        streams = self.stream_of(indices)
        if self.fused is not None:  # one gather for every stream (the ids are the fused source's)
            batch = self.fused.fetch(indices, buffers, threads, times)
            return self._with_provenance(batch, streams, buffers)
        perm = None if bool((np.diff(streams) >= 0).all()) else np.argsort(streams, kind="stable")
        if perm is not None:
            indices, streams = indices[perm], streams[perm]
        bounds = np.searchsorted(streams, np.arange(len(self.sources) + 1)).tolist()
        parts = []
        for i, source in enumerate(self.sources):
            first, end = bounds[i], bounds[i + 1]
            if first < end:
                local = indices[first:end] - self.starts[i]
                view = _StretchBuffers(buffers, first, i)
                parts.append((i, first, end, source.fetch(local, view, threads, times)))  # type: ignore[arg-type]
        if self.per_sample:
            batch: Any = [_tagged(sample, i) for i, _, _, samples in parts for sample in samples]
        else:
            batch = self._with_provenance(self._join(parts, buffers, len(indices)), streams, buffers)
        return batch if perm is None else _in_order(batch, np.argsort(perm))

    def _with_provenance(self, batch: Any, streams: np.ndarray, buffers: BatchBuffers) -> Any:
        if self.per_sample:
            return [_tagged(sample, int(i)) for sample, i in zip(batch, streams.tolist(), strict=True)]
        if PROVENANCE_FIELD in batch:
            raise ValueError(
                f"{self.name} gives a field {PROVENANCE_FIELD!r}, the name of the provenance field a mixed "
                "loader adds; rename it in the data"
            )
        batch[PROVENANCE_FIELD] = buffers.fixed(PROVENANCE_FIELD, len(streams))
        batch[PROVENANCE_FIELD].copy_(torch.from_numpy(streams))
        return batch

    def _join(
        self, parts: list[tuple[int, int, int, Any]], buffers: BatchBuffers, rows: int
    ) -> dict[str, Any]:
        fields = list(parts[0][3])
        for i, _, _, part in parts[1:]:
            if list(part) != fields:
                field = sorted(set(part) ^ set(fields))[0]
                raise ValueError(
                    f"streams {self.names[parts[0][0]]!r} and {self.names[i]!r} give different fields "
                    f"({field!r} is in one batch only: {fields} vs {list(part)}); every stream must give the "
                    "same fields to share a batch"
                )
        batch: dict[str, Any] = {}
        for field in fields:
            if field in self._specs:
                out = batch[field] = buffers.fixed(field, rows)
                for _, first, end, part in parts:
                    if part[field].data_ptr() != out[first:end].data_ptr():
                        out[first:end].copy_(part[field])
            elif all(isinstance(part[field], list) for *_, part in parts):
                batch[field] = [value for *_, part in parts for value in part[field]]
            else:
                batch[field] = torch.cat([part[field] for *_, part in parts])
        return batch

    def prepare(self, shard_order: np.ndarray, epoch: int, indices: np.ndarray | None = None) -> None:
        if not self._preparing:
            return
        stream_of_shard = self.shard_ends.searchsorted(shard_order, side="right")
        streams = None if indices is None else self.stream_of(indices)
        for i in self._preparing:
            source = self.sources[i]
            shards = shard_order[stream_of_shard == i] - (self.shard_ends[i - 1] if i else 0)
            local = None if indices is None or streams is None else indices[streams == i] - self.starts[i]
            source.prepare(shards.astype(np.int64), epoch, local)

    def plan_reads(self, plan: ReadPlan) -> None:
        for source in self.sources:
            source.plan_reads(plan)

    def close(self) -> None:
        """Close each stream's source that has a ``close()`` (a remote one's threads and cache pins)."""
        for source in self.sources:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def stats(self) -> dict[str, Any]:
        per_stream = {name: source.stats() for name, source in zip(self.names, self.sources, strict=True)}
        if not any(per_stream.values()):
            return {}
        waits = [s.get("network_wait_s", 0.0) for s in per_stream.values()]
        return {"network_wait_s": float(sum(waits)), "streams": per_stream}

    def token_documents(self, field: str) -> TokenDocuments:
        """Every stream's documents of ``field`` as one table, for ``pack=``: global id ``k`` is document
        ``k`` (each stream's ``token_documents(field)``; their token dtypes must agree).

        Example::

            docs = source.token_documents("tokens"); len(docs.tokens) == source.num_samples
        """
        parts = []
        for name, source in zip(self.names, self.sources, strict=True):
            documents = getattr(source, "token_documents", None)
            if documents is None:
                raise ValueError(f"pack= needs token documents but stream {name!r} ({source.name}) has none")
            parts.append(documents(field))
        dtypes = {str(p.dtype) for p in parts}
        if len(dtypes) > 1:
            found = ", ".join(f"{n}: {p.dtype}" for n, p in zip(self.names, parts, strict=True))
            raise ValueError(f"pack= field {field!r} has different token dtypes across streams ({found})")
        file_counts = np.array([len(p.table.files) for p in parts], dtype=np.int64)
        file_starts = np.cumsum(file_counts) - file_counts
        return TokenDocuments(
            np.concatenate([p.shard + s for p, s in zip(parts, file_starts, strict=True)]).astype(np.int32),
            np.concatenate([p.src for p in parts]),
            np.concatenate([p.tokens for p in parts]),
            parts[0].dtype,
            MappedTable([f for p in parts for f in p.table.files]),
            _StreamVerify([p.verify for p in parts], np.cumsum(file_counts)),
        )


def open_streams(streams: Sequence[Any], open_one: Callable[[Any], Source]) -> MixedSource:
    """Each :class:`fastio.mixing.Stream`'s source opened by ``open_one`` (the loader passes
    :func:`fastio.registry.open_source` with its options), as one :class:`MixedSource`.

    Example::

        source = open_streams([Stream("data/web", 0.7), Stream("data/code", 0.3)], open_source)
    """
    sources = [open_one(s.source) for s in streams]
    names = [s.name or source.name for s, source in zip(streams, sources, strict=True)]
    return MixedSource(sources, names)


class _StreamVerify:
    """A mixed table's ``verify(shard_ids)``: each stream's own check on its own files."""

    def __init__(self, checks: list[Any], file_ends: np.ndarray) -> None:
        self.checks, self.file_ends = checks, file_ends

    def __call__(self, shard_ids: np.ndarray) -> None:
        streams = np.searchsorted(self.file_ends, shard_ids, side="right")
        for i, check in enumerate(self.checks):
            mine = shard_ids[streams == i]
            if len(mine):
                check(mine - (self.file_ends[i - 1] if i else 0))


def _spec_text(spec: tuple[torch.dtype, tuple[int, ...]] | None) -> str:
    return "absent" if spec is None else f"{spec[0]} {tuple(spec[1])}"


def _tagged(sample: Any, stream: int) -> Any:
    return {**sample, PROVENANCE_FIELD: stream} if isinstance(sample, dict) else sample


def _in_order(batch: Any, inverse: np.ndarray) -> Any:
    """A batch gathered grouped by stream, put back in the asked order (``inverse``: grouped row of each)."""
    if isinstance(batch, list):
        return [batch[k] for k in inverse.tolist()]
    rows = torch.from_numpy(inverse)
    for field, value in batch.items():
        if isinstance(value, torch.Tensor):
            value.copy_(value[rows])
        else:
            batch[field] = [value[k] for k in inverse.tolist()]
    return batch
