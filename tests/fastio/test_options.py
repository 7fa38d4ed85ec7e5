"""fastio.options: StreamLoader keeps DataLoader's keyword names flat and groups its own options by concern;
the old flat names still work for one release with a DeprecationWarning that names the new form, and the
one table in docs/loader.md lists every field of every group."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import warnings

import numpy as np
import pytest
import torch

import fastio
from fastio.options import FLAT_NAMES, GROUPS, OpenOptions, grouped_options

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "loader.md"


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("options") / "train"
    with fastio.ShardWriter(root, max_samples=13) as writer:
        for i in range(37):
            writer.write({"x": np.full(4, i, np.int32), "y": i})
    return str(root)


# A value for each old flat name that differs from its default, on a loader it applies to.
FLAT_VALUES = {
    "decode": "pil",
    "verify": True,
    "tar_strict": False,
    "cache_dir": "/tmp/fastio-options-test",
    "cache_limit": "1GB",
    "storage_options": {"anon": True},
    "rank": 1,
    "world_size": 2,
    "shuffle_block": 8,
    "shuffle_window": 2,
    "shuffle_parts": 3,
    "worker_mode": "thread",
    "threads": 2,
    "prefetch": 3,
    "stages": (),
    "reuse_buffers": False,
    "progress": True,
    "mix": "batch",
    "epoch_size": 10,
}


def test_every_flat_name_has_a_test_value():
    assert set(FLAT_VALUES) == set(FLAT_NAMES)


@pytest.mark.parametrize("name", sorted(FLAT_NAMES))
def test_a_flat_name_warns_with_its_new_form_and_lands_in_its_group(name):
    keyword, field = FLAT_NAMES[name]
    kind = GROUPS[keyword]
    with pytest.warns(DeprecationWarning, match=rf"{keyword}=fastio\.{kind.__name__}\({field}=\.\.\.\)"):
        groups = grouped_options({}, {name: FLAT_VALUES[name]})
    assert groups[keyword] == kind(**{field: FLAT_VALUES[name]})
    others = {k: v for k, v in groups.items() if k != keyword}
    assert others == {k: GROUPS[k]() for k in others}


def test_the_flat_name_warning_points_at_the_callers_line(shard_dir):
    with pytest.warns(DeprecationWarning) as caught:
        fastio.StreamLoader(shard_dir, batch_size=4, shuffle_window=2)
    assert [pathlib.Path(w.filename).name for w in caught] == ["test_options.py"]


def test_flat_and_grouped_forms_give_the_same_loader(shard_dir):
    with pytest.warns(DeprecationWarning):
        old = fastio.StreamLoader(
            shard_dir, batch_size=5, shuffle="shard", seed=3, shuffle_window=2, shuffle_block=4, rank=1,
            world_size=2, threads=2, reuse_buffers=False,
        )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = fastio.StreamLoader(
            shard_dir, batch_size=5, shuffle="shard", seed=3,
            order=fastio.OrderOptions(shuffle_window=2, shuffle_block=4, rank=1, world_size=2),
            workers=fastio.WorkerOptions(threads=2), batches=fastio.BatchOptions(reuse_buffers=False),
        )  # fmt: skip
    assert (old.order, old.workers, old.assembly) == (new.order, new.workers, new.assembly)
    assert [b["y"].tolist() for b in old] == [b["y"].tolist() for b in new]


def test_collate_is_the_old_name_of_collate_fn(shard_dir):
    def first(samples):
        return samples[0]

    with pytest.warns(DeprecationWarning, match="collate_fn="):
        loader = fastio.StreamLoader(shard_dir, batch_size=2, collate=first)
    assert loader.collate is first
    with pytest.raises(ValueError, match="collate_fn= .* only"):
        fastio.StreamLoader(shard_dir, batch_size=2, collate=first, collate_fn=first)


def test_a_flat_name_beside_its_group_is_refused(shard_dir):
    with pytest.raises(ValueError, match=r"cache_limit=.*remote=fastio\.RemoteOptions"):
        fastio.StreamLoader(shard_dir, batch_size=2, remote=fastio.RemoteOptions(), cache_limit="1GB")


def test_a_group_of_the_wrong_type_is_refused(shard_dir):
    with pytest.raises(TypeError, match=r"remote=\.\.\.\) takes a fastio\.RemoteOptions, got dict"):
        fastio.StreamLoader(shard_dir, batch_size=2, remote={"cache_dir": "/tmp/c"})


def test_an_unknown_keyword_is_a_type_error(shard_dir):
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache_size'"):
        fastio.StreamLoader(shard_dir, batch_size=2, cache_size="1GB")


def test_only_dataloaders_positions_are_positional(shard_dir):
    with pytest.raises(TypeError):
        fastio.StreamLoader(shard_dir, 2, False, 0, 0, None, False, 3)  # 3: the old positional prefetch


def test_worker_mode_is_checked_by_its_option_object():
    with pytest.raises(ValueError, match="'auto', 'thread' or 'process', got 'fiber'"):
        fastio.WorkerOptions(mode="fiber")


def test_mixing_options_apply_only_to_streams(shard_dir):
    with pytest.raises(ValueError, match=r"mixing= \(mix, epoch_size\) apply to a list of fastio.Stream"):
        fastio.StreamLoader(shard_dir, batch_size=2, mixing=fastio.MixingOptions(mix="batch"))


def test_open_options_join_read_and_remote():
    read = fastio.ReadOptions(decode="pil", verify=True, tar_strict=False)
    remote = fastio.RemoteOptions(cache_dir=pathlib.Path("/tmp/c"), cache_limit=10, storage_options={"a": 1})
    assert OpenOptions.of(read, remote) == OpenOptions("pil", True, False, "/tmp/c", 10, {"a": 1})


def _table_rows(text: str) -> dict[str, set[str]]:
    """docs/loader.md's options table: group keyword -> the fields its rows name."""
    start = text.index("## fastio's own options")
    rows: dict[str, set[str]] = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)=fastio\.\w+`", cells[0]) if line.startswith("|") else None
        field = re.fullmatch(r"`(\w+)`", cells[1]) if match and len(cells) > 1 else None
        if match and field:
            rows.setdefault(match.group(1), set()).add(field.group(1))
    return rows


def test_the_docs_table_lists_every_field_of_every_group():
    rows = _table_rows(DOCS.read_text())
    expected = {keyword: {f.name for f in dataclasses.fields(kind)} for keyword, kind in GROUPS.items()}
    assert rows == expected


def test_the_docs_table_names_each_old_flat_name():
    text = DOCS.read_text()
    table = text[text.index("## fastio's own options") :]
    for name in FLAT_NAMES:
        assert f"`{name}=`" in table, name


def test_grouped_options_survive_a_loader_with_workers(shard_dir):
    loader = fastio.StreamLoader(shard_dir, batch_size=4, num_workers=2,
                                 workers=fastio.WorkerOptions(mode="thread", prefetch=1))  # fmt: skip
    assert (loader.worker_mode, loader.prefetch) == ("thread", 1)
    assert torch.cat([b["y"] for b in loader]).tolist() == list(range(37))
