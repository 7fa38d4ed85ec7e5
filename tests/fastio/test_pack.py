"""StreamLoader(pack=...): held to a plain-Python packer (concatenate, eos, cut) on odd sizes: ranks,
resume, dtypes, tar members and the named errors. Worker threads, buffers and worker arguments:
test_pack_workers.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fastio
from fastio.assembly.pack import Pack
from fastio.pipeline.order import epoch_order

sys.path.insert(0, str(Path(__file__).parent))
from _pack_helpers import (  # noqa: E402
    BATCH,
    NUM_DOCS,
    SEQ_LEN,
    SHARD_DOCS,
    assert_same,
    batched,
    collect,
    make_corpus,
    pack_loader,
    reference,
    seeded_rng,
    write_docs,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    return make_corpus(tmp_path_factory)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("eos", [None, -7])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_matches_plain_python_packer(corpus, world, eos, shift, shuffle):
    directory, docs = corpus
    drop_last = (world + shift) % 2 == 0  # both last-batch policies across the sweep
    order = epoch_order([SHARD_DOCS] * 9, seed=5, epoch=0, shuffle=shuffle)
    pack = Pack("tokens", seq_len=SEQ_LEN, eos=eos, shift=shift, positions=True)
    counts = set()
    for rank in range(world):
        loader = pack_loader(
            directory,
            pack,
            shuffle=shuffle,
            seed=5,
            order=fastio.OrderOptions(world_size=world, rank=rank),
            drop_last=drop_last,
        )
        want = batched(reference(docs, order, SEQ_LEN, eos, shift, world, rank), BATCH, drop_last)
        got = collect(loader)
        assert len(got) == len(want) == len(loader)
        for g, w in zip(got, want, strict=True):
            assert g["tokens"].dtype == torch.int32 and g["tokens"].shape == (len(w), SEQ_LEN + shift)
            assert_same(g, w)
        counts.add(len(got))
    assert len(counts) == 1, f"ranks yield different batch counts: {counts}"


def test_ranks_read_disjoint_documents(tmp_path):
    rng = seeded_rng("disjoint")
    docs = [np.arange(n, dtype=np.int32) + 1000 * i for i, n in enumerate(rng.integers(1, 301, NUM_DOCS))]
    directory = write_docs(tmp_path / "docs", docs)
    seen = []
    for rank in range(3):
        loader = pack_loader(
            directory,
            Pack(seq_len=SEQ_LEN),
            shuffle=True,
            seed=1,
            order=fastio.OrderOptions(world_size=3, rank=rank),
        )
        tokens = torch.cat([b["tokens"].flatten() for b in loader])
        seen.append(set((tokens // 1000).tolist()))
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert len(seen[0] | seen[1] | seen[2]) > NUM_DOCS * 0.9  # only each stream's tail is dropped


@pytest.mark.parametrize("cut", [0, 1, 7, 40])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_gives_the_batches_that_would_have_come(corpus, cut, workers):
    directory, _ = corpus
    pack = Pack(seq_len=SEQ_LEN, eos=-3, shift=True, positions=True)
    kwargs = {"shuffle": True, "seed": 9, "order": fastio.OrderOptions(world_size=2, rank=1)}
    full = collect(pack_loader(directory, pack, **kwargs))
    first = pack_loader(directory, pack, num_workers=2 - workers, **kwargs)
    it = iter(first)
    for _ in range(cut):
        next(it)
    state = first.state_dict()
    assert state["rows_consumed"] == cut * BATCH and state["token_offset"] == cut * BATCH * SEQ_LEN
    resumed = pack_loader(directory, pack, num_workers=workers, **kwargs)
    resumed.load_state_dict(state)
    rest = collect(resumed)
    assert len(rest) == len(full) - cut
    for a, b in zip(rest, full[cut:], strict=True):
        for key in b:
            assert torch.equal(a[key], b[key]), key
    if cut:  # the cut falls inside a document: its row starts at no document's first token
        assert state["token_offset"] not in set(resumed._batches.plan(0).starts.tolist())


def test_resume_with_another_batch_size_continues_at_the_same_row(corpus):
    directory, docs = corpus
    pack = Pack(seq_len=SEQ_LEN, eos=-1)
    loader = pack_loader(directory, pack, batch_size=4)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    resumed = pack_loader(directory, pack, batch_size=5)
    resumed.load_state_dict(state)
    rows = torch.cat([b["tokens"] for b in resumed])
    want = reference(docs, np.arange(NUM_DOCS), SEQ_LEN, -1, False, 1, 0)[8:]
    np.testing.assert_array_equal(rows.numpy(), np.array([r[0] for r in want]))


def test_resume_in_a_later_epoch(corpus):
    directory, _ = corpus
    pack = Pack(seq_len=SEQ_LEN)
    loader = pack_loader(directory, pack, shuffle=True, seed=4)
    loader.set_epoch(3)
    full = collect(loader)
    it = iter(loader)
    for _ in range(5):
        next(it)
    resumed = pack_loader(directory, pack, shuffle=True, seed=4)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.epoch == 3
    rest = collect(resumed)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(rest, full[5:], strict=True))


def test_epochs_repeat_and_differ(corpus):
    directory, _ = corpus
    loader = pack_loader(directory, Pack(seq_len=SEQ_LEN), shuffle=True, seed=0)
    first = torch.cat([b["tokens"] for b in collect(loader)])
    again = torch.cat([b["tokens"] for b in collect(loader)])
    loader.set_epoch(1)
    other = torch.cat([b["tokens"] for b in collect(loader)])
    assert torch.equal(first, again)
    assert not torch.equal(first[: len(other)], other[: len(first)])


@pytest.mark.parametrize(
    "change",
    [{"seq_len": 16}, {"shift": True}, {"eos": 0}, {"world_size": 3}, {"seed": 1}, {"shuffle": False}],
    ids=lambda c: next(iter(c)),
)
def test_resume_refuses_a_changed_stream(corpus, change):
    directory, _ = corpus
    base = {"seq_len": SEQ_LEN, "shift": False, "eos": None, "world_size": 1, "seed": 0, "shuffle": True}

    def make(settings):
        pack = Pack(seq_len=settings["seq_len"], shift=settings["shift"], eos=settings["eos"])
        return pack_loader(
            directory, pack, order=fastio.OrderOptions(world_size=settings["world_size"], rank=0),
            seed=settings["seed"], shuffle=settings["shuffle"],
        )  # fmt: skip

    state = make(base).state_dict()
    key = next(iter(change))
    with pytest.raises(ValueError, match=key):
        make({**base, **change}).load_state_dict(state)


def test_resume_refuses_another_dataset(corpus, tmp_path):
    directory, docs = corpus
    other = write_docs(tmp_path / "other", [*docs[:-1], docs[-1][:-1]])  # one token fewer
    state = pack_loader(directory, Pack(seq_len=SEQ_LEN)).state_dict()
    with pytest.raises(ValueError, match="num_tokens"):
        pack_loader(other, Pack(seq_len=SEQ_LEN)).load_state_dict(state)


def test_requested_dtype(corpus):
    directory, docs = corpus
    got = collect(pack_loader(directory, Pack(seq_len=SEQ_LEN, eos=-1, dtype=torch.int64)))
    want = batched(reference(docs, np.arange(NUM_DOCS), SEQ_LEN, -1, False, 1, 0), BATCH, False)
    assert got[0]["tokens"].dtype == torch.int64
    for g, w in zip(got, want, strict=True):
        assert_same(g, w, keys=("tokens", "document_ids"))


def test_uint16_tokens_and_empty_documents(tmp_path):
    rng = seeded_rng("uint16-empty")
    lengths = rng.integers(0, 40, size=NUM_DOCS) * (rng.random(NUM_DOCS) < 0.7)  # many empty documents
    docs = [rng.integers(0, 65536, size=n).astype(np.uint16) for n in lengths]
    directory = write_docs(tmp_path / "docs", docs, dtype="uint16")
    for eos in (None, 65535):
        got = collect(pack_loader(directory, Pack(seq_len=SEQ_LEN, eos=eos, positions=True)))
        want = batched(reference(docs, np.arange(NUM_DOCS), SEQ_LEN, eos, False, 1, 0), BATCH, False)
        assert got[0]["tokens"].dtype == torch.uint16 and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same({k: v.to(torch.int64) for k, v in g.items()}, w)


def test_shifted_rows_overlap_by_one_token(corpus):
    directory, _ = corpus
    rows = torch.cat(
        [b["tokens"] for b in collect(pack_loader(directory, Pack(seq_len=SEQ_LEN, shift=True)))]
    )
    assert torch.equal(rows[:-1, -1], rows[1:, 0])


@pytest.mark.parametrize(
    ("schema", "found"),
    [
        ({"tokens": ("int32", (4,))}, "int32 (4,)"),
        ({"tokens": "bytes"}, "bytes"),
        ({"tokens": ("float32", None)}, "float32"),
        ({"tokens": ("int32", None)}, None),
    ],
    ids=["fixed", "bytes", "float", "missing"],
)
def test_field_that_is_not_a_token_array_is_named(tmp_path, schema, found):
    value = {"int32 (4,)": np.ones(4, np.int32), "bytes": b"abc", "float32": np.ones(3, np.float32)}
    sample = {"tokens": value.get(found, np.ones(3, np.int32))}
    with fastio.ShardWriter(tmp_path / "d", schema=schema) as w:
        w.write(sample)
    field = "tokens" if found else "text"
    with pytest.raises(fastio.SchemaMismatchError, match=field) as err:
        pack_loader(tmp_path / "d", Pack(field, seq_len=2), batch_size=1)
    assert "1-D variable-length integer array" in str(err.value)
    assert (found or "no such field") in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [{"seq_len": 0}, {"seq_len": -3}, {"seq_len": 2.5}, {"eos": 1.5}, {"dtype": torch.float32}],
    ids=["zero", "negative", "float", "eos-float", "dtype-float"],
)
def test_bad_pack_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Pack("tokens", **{"seq_len": 8, **kwargs})


def test_eos_and_dtype_must_fit(corpus, tmp_path):
    directory, _ = corpus
    with pytest.raises(ValueError, match="wrap"):
        pack_loader(directory, Pack(seq_len=8, dtype=torch.int16))
    docs = [np.arange(1, 30, dtype=np.uint16)] * 4
    small = write_docs(tmp_path / "u16", docs, dtype="uint16")
    with pytest.raises(ValueError, match="eos=70000"):
        pack_loader(small, Pack(seq_len=8, eos=70000))
    rows = torch.cat(
        [b["tokens"] for b in collect(pack_loader(small, Pack(seq_len=8, eos=70000, dtype=torch.int32)))]
    )
    assert rows.dtype == torch.int32 and (rows == 70000).sum() == 4


@pytest.mark.parametrize("drop_last", [False, True])
def test_too_few_tokens_for_one_batch(tmp_path, drop_last):
    directory = write_docs(tmp_path / "tiny", [np.arange(10, dtype=np.int32), np.arange(5, dtype=np.int32)])
    with pytest.raises(fastio.EmptySourceError, match="15 tokens"):
        pack_loader(directory, Pack(seq_len=16), batch_size=1)  # no row at all
    with pytest.raises(fastio.EmptySourceError, match="fewer than one batch"):
        pack_loader(
            directory,
            Pack(seq_len=4),
            batch_size=2,
            order=fastio.OrderOptions(world_size=2, rank=0),
            drop_last=True,
        )
    assert (
        len(
            pack_loader(
                directory, Pack(seq_len=4), batch_size=2, order=fastio.OrderOptions(world_size=2, rank=0)
            )
        )
        == 1
    )


def test_pack_refuses_python_path_options(corpus):
    directory, _ = corpus
    with pytest.raises(ValueError, match="transform"):
        pack_loader(directory, Pack(seq_len=8), transform=lambda s: s)
    with pytest.raises(ValueError, match="process"):
        pack_loader(directory, Pack(seq_len=8), workers=fastio.WorkerOptions(mode="process"))


def test_pack_needs_a_shard_directory():
    dataset = [{"tokens": np.arange(5)}] * 4
    with pytest.raises(TypeError, match="shard directory"):
        fastio.StreamLoader(dataset, batch_size=1, pack=Pack(seq_len=2))


def test_stats_count_tokens(corpus):
    directory, _ = corpus
    loader = pack_loader(directory, Pack(seq_len=SEQ_LEN))
    for _ in loader:
        pass
    stats = loader.stats()
    assert stats["batches"] == len(loader) and stats["tokens"] == stats["samples"] * SEQ_LEN > 0


def test_flipped_token_byte_is_a_named_error(tmp_path):
    rng = seeded_rng("flipped")
    docs = [rng.integers(0, 1000, size=n).astype(np.int32) for n in rng.integers(1, 60, size=40)]
    directory = write_docs(tmp_path / "docs", docs)
    shard = sorted(directory.glob("*.fio"))[1]
    offsets, base = fastio.ShardReader(shard).variable_layout("tokens")
    data = bytearray(shard.read_bytes())
    data[base + int(offsets[3])] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(fastio.CorruptShardError, match=shard.name):
        collect(pack_loader(directory, Pack(seq_len=SEQ_LEN)))


def _write_tar(path: Path, docs: list[np.ndarray]) -> str:
    import webdataset as wds

    with wds.TarWriter(str(path)) as sink:
        for i, doc in enumerate(docs):
            sink.write({"__key__": f"d{i:05d}", "tokens.npy": doc, "cls": i})
    return str(path)


@pytest.mark.parametrize("eos", [None, -4])
def test_tar_npy_documents_match_reference(corpus, tmp_path, eos):
    _, docs = corpus
    tars = [_write_tar(tmp_path / f"part-{k}.tar", docs[k * 60 : (k + 1) * 60]) for k in range(2)]
    order = epoch_order([60, NUM_DOCS - 60], seed=8, epoch=0, shuffle=True)
    pack = Pack("tokens.npy", seq_len=SEQ_LEN, eos=eos, shift=True, positions=True)
    loader = fastio.StreamLoader(
        tars,
        batch_size=BATCH,
        shuffle=True,
        seed=8,
        order=fastio.OrderOptions(world_size=2, rank=0),
        pack=pack,
    )
    want = batched(reference(docs, order, SEQ_LEN, eos, True, 2, 0), BATCH, False)
    got = collect(loader)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


def test_tar_member_that_is_not_a_token_array_is_named(tmp_path):
    tar = _write_tar(tmp_path / "a.tar", [np.ones((3, 2), np.int32), np.ones(4, np.int32)])
    with pytest.raises(fastio.SchemaMismatchError, match=r"tokens\.npy") as err:
        fastio.StreamLoader(tar, batch_size=1, pack=Pack("tokens.npy", seq_len=2))
    assert "(3, 2)" in str(err.value)
    with pytest.raises(fastio.SchemaMismatchError, match="cls"):
        fastio.StreamLoader(tar, batch_size=1, pack=Pack("cls", seq_len=2))


def test_tar_npy_member_shorter_than_its_header_says(tmp_path):
    import io
    import tarfile

    path = tmp_path / "short.tar"
    with tarfile.open(path, "w") as tar:
        for i, n in enumerate((9, 12)):
            buf = io.BytesIO()
            np.save(buf, np.arange(n, dtype=np.int32))
            data = buf.getvalue()[: -8 if i == 1 else None]  # the second member lost 2 tokens
            info = tarfile.TarInfo(f"d{i}.tokens.npy")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(fastio.CorruptShardError, match="sample 1") as err:
        fastio.StreamLoader(str(path), batch_size=1, pack=Pack("tokens.npy", seq_len=2))
    assert "short.tar" in str(err.value) and "48 bytes" in str(err.value)


def test_state_dict_reports_a_pending_resume_and_a_running_pass_is_left_alone(corpus):
    directory, _ = corpus
    pack = Pack(seq_len=SEQ_LEN)
    loader = pack_loader(directory, pack, shuffle=True, seed=6)
    full = collect(loader)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    other = pack_loader(directory, pack, shuffle=True, seed=6)
    running = iter(other)
    next(running)
    with pytest.warns(UserWarning, match="continues unchanged"):
        other.load_state_dict(state)
    assert other.state_dict() == state  # the pending point, until the next iter()
    assert torch.equal(next(running)["tokens"], full[1]["tokens"])
    assert torch.equal(next(iter(other))["tokens"], full[4]["tokens"])
