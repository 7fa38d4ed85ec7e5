"""The Python path's default collate gives what ``default_collate`` gives, with and without workers."""

from __future__ import annotations

import collections
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

import fastio
from fastio.assembly.collate import collate_samples

Pair = collections.namedtuple("Pair", "left right")

# Leaf kinds: each makes a value from a numpy Generator, so every sample of a batch has the same structure
# and fresh values.
_LEAVES = {
    "int": lambda g: int(g.integers(-(2**40), 2**40)),
    "float": lambda g: float(g.normal()),
    "bool": lambda g: bool(g.integers(2)),
    "str": lambda g: "s" * int(g.integers(0, 4)) + str(int(g.integers(100))),
    "bytes": lambda g: bytes(g.integers(0, 256, int(g.integers(0, 5))).astype(np.uint8)),
    "np_float32": lambda g: np.float32(g.normal()),
    "np_int16": lambda g: np.int16(g.integers(-300, 300)),
    "np_bool": lambda g: np.bool_(g.integers(2)),
    "np_array": lambda g: g.normal(size=(2, 3)).astype(np.float32),
    "np_uint8": lambda g: g.integers(0, 256, size=(4,)).astype(np.uint8),
    "tensor": lambda g: torch.from_numpy(g.normal(size=(3,))),
    "tensor_int": lambda g: torch.from_numpy(g.integers(-9, 9, size=(2, 2))).to(torch.int32),
    "tensor_scalar": lambda g: torch.tensor(float(g.normal()), dtype=torch.bfloat16),
}

_templates = st.recursive(
    st.sampled_from(sorted(_LEAVES)),
    lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(["a", "b", "c", "label"]), inner, min_size=1, max_size=3).map(
            lambda d: ("dict", d)
        ),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: ("list", xs)),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: ("tuple", xs)),
        st.tuples(inner, inner).map(lambda xs: ("pair", list(xs))),
    ),
    max_leaves=6,
)


def _make(template, g: np.random.Generator):
    if isinstance(template, str):
        return _LEAVES[template](g)
    kind, body = template
    if kind == "dict":
        return {k: _make(v, g) for k, v in body.items()}
    items = [_make(v, g) for v in body]
    return {"list": list, "tuple": tuple, "pair": lambda xs: Pair(*xs)}[kind](items)


def _assert_same(got, want, where="batch"):
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{got.shape}"
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


class _Listed(torch.utils.data.Dataset):
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def _samples(template, size: int):
    g = np.random.default_rng(zlib.crc32(repr((template, size)).encode()))
    return [_make(template, g) for _ in range(size)]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(template=_templates, size=st.integers(1, 5))
def test_collate_matches_default_collate(template, size):
    samples = _samples(template, size)
    _assert_same(collate_samples(samples), default_collate(samples))


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(template=_templates, size=st.integers(1, 4))
def test_collate_matches_default_collate_through_worker_processes(template, size):
    samples = _samples(template, 2 * size)
    loader = fastio.StreamLoader(_Listed(samples), batch_size=size, num_workers=2)
    assert loader.worker_mode == "process"
    batches = list(loader)
    assert len(batches) == 2
    for k, batch in enumerate(batches):
        _assert_same(batch, default_collate(samples[k * size : (k + 1) * size]))


@pytest.mark.parametrize("workers", [0, 2])
def test_ragged_tensors_and_missing_values_become_lists(workers):
    samples = [{"tokens": torch.arange(n), "extra": None if n % 2 else n} for n in (3, 5, 4, 1)]
    batch = next(iter(fastio.StreamLoader(_Listed(samples), batch_size=4, num_workers=workers)))
    assert isinstance(batch["tokens"], list) and [len(t) for t in batch["tokens"]] == [3, 5, 4, 1]
    assert torch.equal(batch["tokens"][1], torch.arange(5))
    assert batch["extra"] == [None, None, 4, None]


@pytest.mark.parametrize("workers", [0, 2])
def test_shard_fields_collate_like_default_collate(shard_dir, fio, workers):
    loader = fastio.StreamLoader(shard_dir, batch_size=9, transform=lambda s: s, num_workers=workers)
    batch = next(iter(loader))
    assert batch["y"].dtype == torch.int64 and batch["x"].shape == (9, 3, 5)
    assert isinstance(batch["tokens"], list) and isinstance(batch["text"], list)
    fio.check_batch(batch)


def test_strings_in_arrays_are_refused_like_default_collate():
    samples = [np.array(["a", "b"]), np.array(["c", "d"])]
    with pytest.raises(TypeError):
        default_collate(samples)
    with pytest.raises(TypeError):
        collate_samples(samples)
