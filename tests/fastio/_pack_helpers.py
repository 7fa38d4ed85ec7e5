"""What the pack= tests (tests/fastio/test_pack*.py) hold the packer to: a tiny corpus of odd-sized
documents in odd-sized shards, and a plain-Python packer (concatenate, append eos, cut) whose rows each loader
must give.

Example::

    directory, docs = make_corpus(tmp_path_factory)
    want = batched(reference(docs, np.arange(NUM_DOCS), SEQ_LEN, None, False, 1, 0), BATCH, False)
    assert_same(collect(pack_loader(directory, Pack(seq_len=SEQ_LEN)))[0], want[0])
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

import fastio

__all__ = [
    "BATCH",
    "NUM_DOCS",
    "SEQ_LEN",
    "SHARD_DOCS",
    "assert_same",
    "batched",
    "collect",
    "make_corpus",
    "pack_loader",
    "reference",
    "seeded_rng",
    "write_docs",
]


NUM_DOCS = 117
SHARD_DOCS = 13
SEQ_LEN = 17
BATCH = 3


def seeded_rng(case: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(case).encode()))


def write_docs(directory: Path, docs: list[np.ndarray], dtype: str = "int32") -> Path:
    with fastio.ShardWriter(
        directory, schema={"tokens": (dtype, None), "y": ("int64", ())}, max_samples=SHARD_DOCS
    ) as w:
        for i, doc in enumerate(docs):
            w.write({"tokens": doc.astype(dtype), "y": i})
    return directory


def make_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    """The shared corpus: NUM_DOCS documents of 1-300 random int32 tokens, in shards of SHARD_DOCS."""
    generator = seeded_rng("corpus")
    lengths = generator.integers(1, 301, size=NUM_DOCS)
    docs = [generator.integers(0, 2**31 - 1, size=n, dtype=np.int64).astype(np.int32) for n in lengths]
    return write_docs(tmp_path_factory.mktemp("pack") / "docs", docs), docs


def reference(docs, order, seq_len, eos, shift, world, rank):
    """Rows of rank ``rank``: (tokens, document_ids, positions) lists, by concatenating and cutting."""
    width = seq_len + int(shift)
    streams = []
    for r in range(world):
        tokens, owner = [], []
        for n, d in enumerate(order[r::world]):
            piece = [int(t) for t in docs[d]] + ([eos] if eos is not None else [])
            tokens += piece
            owner += [n] * len(piece)
        streams.append((tokens, owner))
    rows = min((len(t) - width) // seq_len + 1 if len(t) >= width else 0 for t, _ in streams)
    tokens, owner = streams[rank]
    out = []
    for k in range(rows):
        cut = slice(k * seq_len, k * seq_len + width)
        ids, positions = [], []
        for j, o in enumerate(owner[cut]):
            if j == 0:
                doc, pos = 0, 0
            elif o != owner[cut][j - 1]:
                doc, pos = doc + 1, 0
            else:
                pos += 1
            ids.append(doc)
            positions.append(pos)
        out.append((tokens[cut], ids, positions))
    return out


def batched(reference_rows, batch_size, drop_last):
    chunks = [reference_rows[i : i + batch_size] for i in range(0, len(reference_rows), batch_size)]
    if drop_last and chunks and len(chunks[-1]) < batch_size:
        chunks.pop()
    return chunks


def pack_loader(directory, pack, **kwargs):
    kwargs.setdefault("batch_size", BATCH)
    return fastio.StreamLoader(str(directory), pack=pack, **kwargs)


def assert_same(got, want_rows, keys=("tokens", "document_ids", "positions")):
    names = {"tokens": 0, "document_ids": 1, "positions": 2}
    for key in keys:
        expected = np.array([row[names[key]] for row in want_rows])
        np.testing.assert_array_equal(got[key].numpy(), expected, err_msg=key)


def collect(loader):
    return [{k: v.clone() for k, v in b.items()} for b in loader]
