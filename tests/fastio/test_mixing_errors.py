"""Weighted streams refuse bad input with errors that name it: weights, stream lists, arguments, and streams
whose fields disagree."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fastio

sys.path.insert(0, str(Path(__file__).parent))
from _mixing_helpers import Ids, mixed_loader, write_shards, write_tar  # noqa: E402


# -- bad input --
@pytest.mark.parametrize("weight", [0, -1, float("nan"), float("inf"), "heavy"])
def test_stream_weight_must_be_positive(weight):
    with pytest.raises(ValueError, match="weight"):
        fastio.Stream("data", weight=weight)


def test_bad_stream_lists_and_arguments(shard_dir):
    with pytest.raises(fastio.EmptySourceError, match="empty list"):
        fastio.StreamLoader([], batch_size=2)
    with pytest.raises(ValueError, match="wrap every source"):
        fastio.StreamLoader([fastio.Stream(shard_dir), shard_dir], batch_size=2)
    with pytest.raises(ValueError, match="mix must be one of"):
        mixed_loader([5, 5], [1, 1], mixing=fastio.MixingOptions(mix="round-robin"))
    with pytest.raises(ValueError, match="epoch_size"):
        mixed_loader([5, 5], [1, 1], mixing=fastio.MixingOptions(epoch_size=0))
    with pytest.raises(ValueError, match="apply to a list of fastio.Stream"):
        fastio.StreamLoader(shard_dir, mixing=fastio.MixingOptions(mix="batch"))
    with pytest.raises(ValueError, match="fastio's own order of the streams"):
        mixed_loader([5, 5], [1, 1], shuffle=False, sampler=range(10))


def test_streams_with_incompatible_fields_are_named():
    streams = [
        fastio.Stream(Ids(5, 0), name="web"),
        fastio.Stream(Ids(5, 9, dtype=torch.int32), name="code"),
    ]
    with pytest.raises(ValueError, match=r"'web' and 'code' disagree on field 'id'"):
        fastio.StreamLoader(streams)
    with pytest.raises(ValueError, match="cannot share a batch"):
        fastio.StreamLoader([fastio.Stream(Ids(5, 0)), fastio.Stream([{"v": 1}])])


def test_a_field_named_stream_is_refused(tmp_path):
    tars = [write_tar(tmp_path / f"{k}.tar", 9 * k, 5, extra="stream") for k in range(2)]  # "s00000.stream"
    with pytest.raises(ValueError, match="provenance field"):
        list(fastio.StreamLoader([fastio.Stream(t) for t in tars], batch_size=20))


def test_streams_whose_batches_differ_in_fields_are_named(tmp_path, fio):
    shards, tar = write_shards(tmp_path / "a", 0, 10, fio), write_tar(tmp_path / "b.tar", 0, 10)
    with pytest.raises(ValueError, match="disagree on field"):
        fastio.StreamLoader([fastio.Stream(shards), fastio.Stream(tar)])
