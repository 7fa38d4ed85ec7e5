"""PowerSGD (``fastcomm.hooks.powersgd``): an independent simulation at 2 and 4 ranks, DDP bucket layouts
over gloo, bit-identical resume, option validation, and the orthogonalization on its own."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _hooks_workers as workers  # noqa: E402
import _powersgd_workers  # noqa: E402

from fastcomm.compress.powersgd import PowerSGDCompressor, orthogonalize_  # noqa: E402
from fastcomm.hooks.powersgd import PowerSGDState  # noqa: E402


@pytest.mark.distributed
def test_result_equals_simulation_of_all_ranks_at_2_ranks(tmp_path):
    variants = tuple(_powersgd_workers.SIM_VARIANTS)
    workers.spawn(tmp_path, 2, _powersgd_workers.simulation_worker, variants, timeout_s=120)


@pytest.mark.distributed
def test_result_equals_simulation_of_all_ranks_at_4_ranks(tmp_path):
    # 4 processes on a 2-core machine: the default path and the deferred second allreduce only
    variants = ("qr", "deferred")
    workers.spawn(tmp_path, 4, _powersgd_workers.simulation_worker, variants, timeout_s=120)


@pytest.mark.distributed
def test_ddp_default_one_and_fifty_buckets_keep_error_feedback_and_resume_bit_identical(tmp_path):
    # one process group for both checks: on a loaded 2-core machine starting the ranks costs ~10 s
    workers.spawn(tmp_path, 2, _powersgd_workers.ddp_worker, timeout_s=150)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": 2.0}, "2.0"),
        ({"rank": True}, "True"),
        ({"warm_start": 1}, "warm_start"),
        ({"orthogonalization": "svd"}, "'svd'"),
        ({"start_iter": -1}, "start_iter"),
        ({"min_compress_numel": 1.5}, "min_compress_numel"),
    ],
)
def test_bad_option_raises_value_error_naming_it(options, named):
    with pytest.raises(ValueError, match=named):
        PowerSGDState(**options)


@pytest.mark.parametrize("method", ["qr", "gram_schmidt"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (4096, 4)])
def test_orthogonalize_gives_orthonormal_columns_of_the_same_span(method, shape):
    gen = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    p = torch.randn(*shape, generator=gen)
    q = orthogonalize_(p.clone(), method)
    eye = torch.eye(shape[1])
    assert torch.allclose(q.T @ q, eye, atol=1e-5)
    # same span: projecting p onto q's columns gives p back
    assert torch.allclose(q @ (q.T @ p), p, atol=1e-4 * float(p.abs().max()))


def test_gram_schmidt_keeps_a_zero_matrix_finite():
    assert torch.equal(orthogonalize_(torch.zeros(10, 3), "gram_schmidt"), torch.zeros(10, 3))


def test_plan_sizes_follow_from_shapes_alone():
    compressor = PowerSGDCompressor(rank=4)
    shapes = [torch.Size(s) for s in [(64, 32), (64,), (3, 3), (10, 2, 5), (100, 1)]]
    plan = compressor.plan(shapes, min_compress_numel=0)
    # (64, 32) compresses: P 64x4, Q 32x4; (10, 2, 5) is 10x10: 20*4=80 < 100, compresses; the rest dense
    assert [(m.rows, m.cols) for m in plan.matrices] == [(64, 32), (10, 10)]
    assert plan.dense_numel == 64 + 9 + 100
    assert plan.first_numel == plan.dense_numel + 64 * 4 + 10 * 4
    assert plan.second_numel == 32 * 4 + 10 * 4
    high = compressor.plan(shapes, min_compress_numel=101)
    assert [(m.rows, m.cols) for m in high.matrices] == [(64, 32)]


def test_state_pickles_with_its_options():
    import pickle

    state = PowerSGDState(2, warm_start=False, orthogonalization="gram_schmidt", start_iter=3)
    restored = pickle.loads(pickle.dumps(state))
    assert restored.options() == state.options() and restored.rank == 2


def _one_bucket_round(compressor, plan, x, state_in, state_out, fused):
    """One rank's rounds (world size 1) of a bucket; returns the mean and the residual."""
    first, second = torch.empty(plan.first_numel), torch.empty(plan.second_numel)
    residual = torch.empty_like(x)
    if fused:
        gradient, owed = x * 0.75, x * 0.25
        compressor.first_round_from(plan, first, residual, gradient, owed, state_in, seed=5)
    else:
        residual.copy_(x)
        compressor.first_round(plan, first, residual, state_in, seed=5)
    compressor.second_round(plan, second, first, residual)
    mean = torch.empty_like(x)
    compressor.finish(plan, mean, residual, state_out, first, second, world_size=1)
    return mean, residual


def test_first_round_from_forms_x_as_the_plain_path_does():
    compressor = PowerSGDCompressor(rank=3)
    shapes = [torch.Size([40, 30]), torch.Size([30]), torch.Size([17, 5, 3]), torch.Size([2, 2])]
    plan = compressor.plan(shapes, min_compress_numel=0)
    numel = sum(s.numel() for s in shapes)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    state = torch.zeros(numel)
    plain = _one_bucket_round(compressor, plan, x, state, torch.empty(numel), fused=False)
    fused = _one_bucket_round(compressor, plan, x, state, torch.empty(numel), fused=True)
    for a, b in zip(plain, fused, strict=True):
        # x * 0.75 + x * 0.25 is x up to one rounding; the rest of the rounds are the same ops
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert plain[1].abs().sum() > 0  # a rank-3 approximation leaves something owed


def test_state_is_zero_outside_the_warm_q_even_from_a_dirty_buffer():
    compressor = PowerSGDCompressor(rank=2)
    shapes = [torch.Size([20, 12]), torch.Size([12]), torch.Size([9, 8])]
    plan = compressor.plan(shapes, min_compress_numel=0)
    other = compressor.plan(
        [torch.Size([12, 20]), torch.Size([12]), torch.Size([8, 9])], min_compress_numel=0
    )
    numel = sum(s.numel() for s in shapes)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(4))
    q_slots = torch.zeros(numel, dtype=torch.bool)
    for slot in plan.matrices:
        q_slots[slot.offset : slot.offset + slot.cols * plan.rank] = True
    state_out = torch.full((numel,), float("nan"))  # an uninitialised spare
    _one_bucket_round(compressor, plan, x, torch.zeros(numel), state_out, fused=True)
    assert torch.isfinite(state_out).all() and (state_out[~q_slots] == 0).all() and state_out[q_slots].any()
    # the same buffer again for the same plan (its zeros kept), then dirtied and used for another plan
    _one_bucket_round(compressor, plan, x, state_out.clone(), state_out, fused=True)
    assert (state_out[~q_slots] == 0).all()
    state_out.fill_(7.0)
    _one_bucket_round(compressor, other, x, torch.zeros(numel), state_out, fused=True)
    other_slots = torch.zeros(numel, dtype=torch.bool)
    for slot in other.matrices:
        other_slots[slot.offset : slot.offset + slot.cols * other.rank] = True
    assert (state_out[~other_slots] == 0).all()


def test_a_written_state_saves_and_loads_with_weights_only(tmp_path):
    # torch.load's default (weights_only=True) refuses a pickled Python object: nothing of ours may ride
    # along with the state tensor (its "already zero outside the Q's" mark lives in the compressor module)
    compressor = PowerSGDCompressor(rank=2)
    shapes = [torch.Size([20, 12]), torch.Size([12])]
    plan = compressor.plan(shapes, min_compress_numel=0)
    numel = sum(s.numel() for s in shapes)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(6))
    state_out = torch.empty(numel)
    _one_bucket_round(compressor, plan, x, torch.zeros(numel), state_out, fused=True)
    torch.save({"compressor_state": state_out}, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)["compressor_state"]
    assert torch.equal(loaded, state_out) and not loaded.__dict__
