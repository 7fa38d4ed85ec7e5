"""The one error-feedback store (:class:`fastcomm.collectives.Residual`): what a rank owes, the narrow
``residual_dtype``, checkpoints (its own and the formats it replaced), re-sharding to another world size,
and the DDP hooks' bucket entries seen through it."""

from __future__ import annotations

import zlib

import pytest
import torch

import fastcomm
from fastcomm.collectives import Residual, mean_over_ranks
from fastcomm.compress import QuantCompressor
from fastcomm.hooks.engine.store import BucketEntry


def _gen(*case: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def _ranks(case: tuple, world_size: int, numel: int, segment: int) -> list[Residual]:
    """``world_size`` ranks' residuals of one ``numel``-element tensor, each with its phase-2 segment."""
    gen = _gen(*case)
    return [
        Residual(
            worker=torch.randn(numel, generator=gen),
            server=torch.randn(segment, generator=gen),
            segment_start=rank * segment,
            world_size=world_size,
        )
        for rank in range(world_size)
    ]


def _owed_by_hand(residual: Residual, numel: int) -> torch.Tensor:
    """worker + W * server over the segment, element by element."""
    out = residual.worker.float().clone()
    for i in range(residual.server.numel()):
        if residual.segment_start + i < numel:
            out[residual.segment_start + i] += residual.world_size * residual.server[i]
    return out


# ------------------------------------------------------------------------------------------ what is owed
@pytest.mark.parametrize("numel", [1, 7, 1001])
def test_owed_is_the_worker_plus_w_times_the_segment(numel):
    segment = -(-numel // 3)
    for residual in _ranks(("owed", numel), 3, numel, segment):
        torch.testing.assert_close(residual.owed(), _owed_by_hand(residual, numel), rtol=0, atol=1e-6)


def test_nothing_held_owes_nothing():
    assert Residual().owed() is None


def test_owed_of_a_span_is_that_span_of_the_whole():
    residual = _ranks(("span",), 2, 50, 25)[1]
    torch.testing.assert_close(residual.owed(20, 10), residual.owed()[20:30], rtol=0, atol=0)


# --------------------------------------------------------------------------------------- residual_dtype
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 7, 1001])
def test_a_narrow_residual_keeps_its_bytes_narrow_and_widens_for_a_call(dtype, numel):
    values = torch.randn(numel, generator=_gen("narrow", numel)) * 3
    residual = Residual(dtype)
    residual.take("worker", values, numel).copy_(values)  # what an exchange leaves behind
    residual.keep()
    assert residual.worker is None and residual.nbytes() == 2 * numel
    worker = residual.take("worker", values, numel)
    assert worker.dtype == torch.float32
    assert torch.equal(worker, values.to(dtype).float())


def test_a_full_precision_residual_stays_as_the_call_left_it():
    values = torch.randn(13, generator=_gen("fp32"))
    residual = Residual()
    residual.take("worker", values, 13).copy_(values)
    residual.keep()
    assert torch.equal(residual.worker, values) and residual.nbytes() == 4 * 13


def test_residual_dtype_must_be_floating_point():
    with pytest.raises(ValueError, match="residual_dtype"):
        Residual(torch.int8)


def test_a_bf16_all_reduce_residual_is_the_fp32_one_rounded(one_rank):
    x = torch.randn(1000, generator=_gen("bf16 all_reduce"))
    compressor = QuantCompressor(bits=4, block=32, stochastic=False)
    full, narrow = Residual(), Residual(torch.bfloat16)
    for residual in (full, narrow):
        fastcomm.collectives.all_reduce(x.clone(), compressor, residual=residual)
        residual.keep()
    assert narrow.nbytes() * 2 == full.nbytes()
    narrow.lend()
    assert torch.equal(narrow.worker, full.worker.to(torch.bfloat16).float())
    assert torch.equal(narrow.server, full.server.to(torch.bfloat16).float())


# ------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_dict_round_trips(dtype):
    residual = _ranks(("state", str(dtype)), 2, 40, 24)[1]
    residual.residual_dtype = dtype
    residual.compressor_state = torch.randn(40, generator=_gen("state", "compressor"))
    residual.keep()
    again = Residual(dtype)
    again.load_state_dict(residual.state_dict())
    assert (again.segment_start, again.world_size) == (24, 2)
    assert torch.equal(again.owed(), residual.owed())
    assert torch.equal(again.lend().compressor_state, residual.lend().compressor_state)


def test_state_dict_is_a_copy():
    residual = Residual(worker=torch.zeros(4))
    saved = residual.state_dict()
    residual.worker += 1
    assert not saved["worker"].any()


def test_an_empty_residual_saves_only_nones():
    assert all(value is None for value in Residual().state_dict().values())


def test_an_fsdp_error_feedback_checkpoint_loads():
    kept = torch.randn(9, generator=_gen("fsdp format")).to(torch.bfloat16)
    old = {"tensors": {"worker": kept}, "working": {"worker": "torch.float32"}}
    for dtype in (torch.bfloat16, None):
        residual = Residual(dtype)
        residual.load_state_dict(old)
        worker = residual.lend().worker
        assert worker.dtype == torch.float32 and torch.equal(worker, kept.float())


def test_a_plain_residual_checkpoint_loads():
    worker = torch.randn(9, generator=_gen("plain format"))
    residual = Residual()
    residual.load_state_dict({"worker": worker, "server": None, "compressor_state": None})
    assert torch.equal(residual.owed(), worker)


# ------------------------------------------------------------------------------------------- re-sharding
@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (4, 1)])
@pytest.mark.parametrize("numel", [7, 1001])
def test_resharding_keeps_the_mean_owed_over_ranks(old, new, numel):
    segment = -(-numel // old)
    olds = _ranks(("reshard", old, new, numel), old, numel, segment)
    states = [residual.state_dict() for residual in olds]
    mean_owed = torch.stack([_owed_by_hand(residual, numel) for residual in olds]).mean(0)
    merged = []
    for rank in range(new):
        state, why = Residual.merge_state_dicts(states, new, rank)
        assert f"{old} -> {new} ranks" in why and state["server"] is None
        merged.append(Residual())
        merged[-1].load_state_dict(state)
    for residual in merged:
        torch.testing.assert_close(residual.owed(), mean_owed, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        torch.stack([r.owed() for r in merged]).mean(0), mean_owed, rtol=1e-6, atol=1e-6
    )


def test_resharding_to_the_same_world_size_keeps_each_ranks_own():
    states = [residual.state_dict() for residual in _ranks(("same",), 2, 30, 15)]
    for rank in range(2):
        state, why = Residual.merge_state_dicts(states, 2, rank)
        assert state is states[rank] and "same world size" in why


def test_resharding_averages_a_compressor_state():
    states = [
        {"worker": None, "server": None, "compressor_state": torch.full((3,), float(r))} for r in range(2)
    ]
    state, _ = Residual.merge_state_dicts(states, 3, 0)
    assert torch.equal(state["compressor_state"], torch.full((3,), 0.5))


def test_resharding_refuses_tensors_of_two_sizes():
    states = [Residual(worker=torch.zeros(n)).state_dict() for n in (3, 4)]
    with pytest.raises(ValueError, match="elements"):
        Residual.merge_state_dicts(states, 3, 0)


def test_mean_over_ranks_counts_a_missing_rank_as_zeros_in_the_first_holders_dtype():
    mean = mean_over_ranks([None, torch.ones(2), torch.full((2,), 2.0)], [None, torch.float16, torch.float32])
    assert mean.dtype == torch.float16 and torch.equal(mean, torch.ones(2, dtype=torch.float16))
    assert mean_over_ranks([None], [None]) is None


# --------------------------------------------------------------------------------- the hooks' bucket store
def test_a_bucket_entry_is_seen_as_a_residual():
    gen = _gen("bucket entry")
    entry = BucketEntry(numels=(6, 4), world_size=2, segment_start=8)
    entry.tensors = {
        "residual": torch.randn(10, generator=gen),
        "server_residual": torch.randn(8, generator=gen),
    }
    feedback = entry.feedback()
    assert (
        feedback.worker is entry.tensors["residual"] and feedback.server is entry.tensors["server_residual"]
    )
    torch.testing.assert_close(entry.owed(), _owed_by_hand(feedback, 10), rtol=0, atol=1e-6)


def test_a_kept_residual_refused_for_another_size_keeps_its_values():
    values = torch.randn(8, generator=_gen("refused"))
    residual = Residual(torch.bfloat16)
    residual.take("worker", values, 8).copy_(values)
    residual.keep()
    with pytest.raises(ValueError, match="one Residual per tensor"):
        residual.take("worker", values, 9)
    assert torch.equal(residual.take("worker", values, 8), values.to(torch.bfloat16).float())
