"""The one seed formula reproduces, to the integer, what each mode seeded with before it was shared."""

from __future__ import annotations

import random
import zlib

import pytest

from fastcomm.collectives import bucket_stream, exchange_seed, group_stream, piece_seed
from fastcomm.compress import QuantCompressor
from fastcomm.fsdp._reduction import Reduction
from fastcomm.hooks.engine.util import seed_for

CASES = range(6)


def _draws(case: int) -> random.Random:
    return random.Random(zlib.crc32(repr(("seeds", case)).encode()))


def _big(draws: random.Random) -> int:
    return draws.choice([0, 1, draws.randrange(2**16), draws.randrange(2**40), draws.randrange(2**63)])


@pytest.mark.parametrize("case", CASES)
def test_seed_for_is_the_hooks_formula(case: int) -> None:
    draws = _draws(case)
    base, step, first = _big(draws), draws.randrange(10**6), draws.randrange(10**4)
    rank, phase = draws.randrange(64), draws.choice([1, 2])
    # the DDP hooks' formula, written out
    expected = ((((base * 1_000_003 + step) * 65_537 + first) * 4_099 + rank) * 4 + phase) % (2**62)
    assert seed_for(base, step, (first, first + 1), rank, phase) == expected
    assert exchange_seed(bucket_stream(base, step, first), rank, phase) == expected


def test_seed_for_of_an_empty_key_uses_zero() -> None:
    assert seed_for(3, 4, (), 1, 1) == exchange_seed(bucket_stream(3, 4, 0), 1, 1)


@pytest.mark.parametrize("case", CASES)
def test_exchange_seed_is_a_plain_calls_formula(case: int) -> None:
    draws = _draws(case)
    seed, rank, phase = _big(draws), draws.randrange(64), draws.choice([1, 2])
    assert exchange_seed(seed, rank, phase) == ((seed * 4_099 + rank) * 4 + phase) % (2**62)


@pytest.mark.parametrize("case", CASES)
def test_fsdp_stream_is_its_step_seed(case: int) -> None:
    draws = _draws(case)
    seed, index, calls = _big(draws), draws.randrange(500), draws.randrange(10**5)
    reduction = Reduction(QuantCompressor(bits=8), seed=seed, index=index)
    reduction.traffic.calls = calls
    expected = ((seed * 7_919 + index) * 1_000_003 + calls) % (2**61)
    assert reduction.step_seed() == group_stream(seed, index, calls) == expected


@pytest.mark.parametrize("case", CASES)
def test_piece_seed_formula(case: int) -> None:
    draws = _draws(case)
    base, index = _big(draws) % (2**62), draws.randrange(4096)
    assert piece_seed(base, index) == (base ^ (index * 0x9E3779B97F4A7C15)) % (2**62)


def test_streams_differ_between_steps_ranks_and_phases() -> None:
    seeds = {exchange_seed(bucket_stream(0, step, 0), rank, phase) for step in range(3) for rank in range(3)
             for phase in (1, 2)}  # fmt: skip
    assert len(seeds) == 18
