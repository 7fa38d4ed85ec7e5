"""Randomness of the loader's Python and batch stages: a pure function of ``(seed, epoch, sample)``.

Every random draw a transform or a built-in stage makes for a sample comes from seeds derived here from the
loader's ``seed``, the ``epoch`` and the sample's global index in the dataset. Nothing depends on
``num_workers``, the world size, the batch size or which process runs the sample, so a resumed run (or one
with more workers) draws exactly the same augmentations.

1. :func:`sample_seeds` mixes ``(seed, epoch, index)`` with SplitMix64 (vectorized, numpy uint64) into one
   64-bit seed per sample; ``stream`` separates independent uses (transform reseeding, crop geometry...).
2. :func:`sample_uniforms` turns those seeds into ``count`` uniform floats in ``[0, 1)`` per sample, for the
   built-in stages that need a handful of numbers per sample and no generator object.
3. :func:`seed_global_rngs` seeds torch's default CPU generator, ``random`` and ``numpy.random`` from one such
   seed, for user code (a ``transform``, a Dataset's ``__getitem__``, a ``collate``) that draws from the
   global generators; :func:`global_rngs_kept` puts the caller's global states back afterwards.

Example::

    seeds = sample_seeds(seed=0, epoch=3, indices=np.array([5, 9]))          # uint64 [2]
    u = sample_uniforms(0, 3, np.array([5, 9]), count=4, stream=STREAM_IMAGE)  # float64 [2, 4]
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

__all__ = [
    "STREAM_COLLATE",
    "STREAM_FETCH",
    "STREAM_IMAGE",
    "STREAM_TRANSFORM",
    "STREAM_WORKER",
    "global_rngs_kept",
    "sample_seeds",
    "sample_uniforms",
    "seed_global_rngs",
]

STREAM_TRANSFORM = 1  # reseeding torch / random / numpy before a user's transform
STREAM_IMAGE = 2  # the image stage's crop, ratio and flip draws
STREAM_FETCH = 3  # reseeding before a Dataset's __getitem__s: one seed per batch, from its first sample
STREAM_COLLATE = 4  # reseeding before a user's collate: one seed per batch, from its first sample
STREAM_WORKER = 5  # the seed torch.utils.data.get_worker_info() reports in worker process ``index``

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    z = z.copy()
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def sample_seeds(seed: int, epoch: int, indices: np.ndarray, stream: int = STREAM_TRANSFORM) -> np.ndarray:
    """One 64-bit seed per sample index, a pure function of ``(seed, epoch, index, stream)``.

    Example::

        a = sample_seeds(0, 0, np.arange(4)); b = sample_seeds(0, 1, np.arange(4))
        assert (a != b).all()
    """
    idx = np.asarray(indices, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        key = _mix(np.array([int(seed) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) + _GOLDEN)
        key = _mix(key ^ (np.array([int(epoch) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) + _GOLDEN))
        key = _mix(key ^ (np.array([int(stream) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) * _GOLDEN))
        return _mix(key ^ (idx * _GOLDEN + _GOLDEN))


def sample_uniforms(
    seed: int, epoch: int, indices: np.ndarray, count: int, stream: int = STREAM_IMAGE
) -> np.ndarray:
    """``count`` uniform floats in ``[0, 1)`` per sample (float64 ``[len(indices), count]``).

    Example::

        u = sample_uniforms(0, 0, np.arange(8), count=3)
        assert u.shape == (8, 3) and ((0 <= u) & (u < 1)).all()
    """
    base = sample_seeds(seed, epoch, indices, stream)
    with np.errstate(over="ignore"):
        counters = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
        bits = _mix(base[:, None] + counters[None, :])
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def seed_global_rngs(seed: int) -> None:
    """Seed torch's default CPU generator, ``random`` and ``numpy.random``'s global state from one 64-bit
    ``seed`` (numpy from both 32-bit halves, so no two seeds share a numpy stream). CUDA generators are left
    alone: worker processes never touch CUDA, and the consumer's CUDA draws stay the training's own.

    Example::

        seed_global_rngs(int(sample_seeds(0, 0, np.array([7]))[0]))
        a = torch.rand(())
    """
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed((seed & 0xFFFFFFFF, seed >> 32))


@contextlib.contextmanager
def global_rngs_kept() -> Iterator[None]:
    """Put the global torch (CPU), ``random`` and ``numpy.random`` states back as they were on exit, so
    reseeding inside does not change the caller's own randomness (dropout, its own shuffles).

    Example::

        with global_rngs_kept():
            seed_global_rngs(3)
            torch.rand(4)
    """
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
