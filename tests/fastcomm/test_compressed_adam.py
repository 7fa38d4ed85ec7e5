"""fastcomm.CompressedAdam: AdamW in warm-up, frozen variance and compressed momentum after it (1-bit Adam).

Single-process checks hold the optimizer to torch's AdamW and to a reference written here; 2-rank gloo runs
check the hook's momentum against the mean of the ranks' gradients, resume, GradScaler skips and convergence.
"""

import json
import math
import sys
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

import fastcomm

sys.path.insert(0, str(Path(__file__).parent))
import _adam_workers as adam_workers  # noqa: E402
import _hooks_workers as workers  # noqa: E402


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))


def _fill_grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("grad", step)).encode()))
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def test_warmup_steps_equal_torch_adamw():
    ours, theirs = _model(1), _model(1)
    options = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    optimizer = fastcomm.CompressedAdam(ours.parameters(), **options, warmup_steps=6)
    reference = torch.optim.AdamW(theirs.parameters(), **options, foreach=False)
    for step in range(6):
        _fill_grads(ours, step)
        _fill_grads(theirs, step)
        optimizer.step()
        reference.step()
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step}: CompressedAdam's warm-up is not AdamW"
    assert optimizer.compressing and optimizer.steps == 6


@pytest.mark.parametrize("exchange", ["update", "momentum"])
def test_frozen_phase_without_hook_matches_reference(exchange):
    model, twin = _model(2), _model(2)
    lr, (beta1, beta2), eps, wd, warmup = 2e-3, (0.8, 0.99), 1e-6, 0.05, 3
    optimizer = fastcomm.CompressedAdam(
        model.parameters(),
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        weight_decay=wd,
        warmup_steps=warmup,
        exchange=exchange,
    )
    m = [torch.zeros_like(p) for p in twin.parameters()]
    v = [torch.zeros_like(p) for p in twin.parameters()]
    bound = (1 - beta1) / ((1 - beta2) ** 0.5 * (1 - beta1 / beta2**0.5))  # Adam's own largest step
    for step in range(1, 9):
        _fill_grads(model, step)
        _fill_grads(twin, step)
        list(model.parameters())[0].grad[0] *= 1e4  # one coordinate far beyond its frozen variance
        list(twin.parameters())[0].grad[0] *= 1e4
        optimizer.step()
        with torch.no_grad():
            for i, p in enumerate(twin.parameters()):
                g = p.grad
                if step <= warmup:
                    m[i] = beta1 * m[i] + (1 - beta1) * g
                    v[i] = beta2 * v[i] + (1 - beta2) * g * g
                    update = m[i] / ((v[i] / (1 - beta2**step)).sqrt() + eps)
                else:
                    denom = (v[i] / (1 - beta2**warmup)).sqrt() + eps
                    if exchange == "update":  # u = m / denom, each gradient floored as Adam's v would be
                        if step == warmup + 1:
                            m[i] = m[i] / denom
                        floored = torch.maximum(denom, (1 - beta2) ** 0.5 * g.abs())
                        m[i] = beta1 * m[i] + (1 - beta1) * g / floored
                        update = m[i]
                    else:  # raw momentum through the frozen denom, clamped to Adam's bound
                        m[i] = beta1 * m[i] + (1 - beta1) * g
                        update = (m[i] / denom).clamp(-bound, bound)
                p.mul_(1 - lr * wd)
                p.sub_(lr * update / (1 - beta1**step))
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{exchange} step {step}")


def test_momentum_exchange_never_moves_a_coordinate_without_warmup_gradient():
    model = _model(4)
    optimizer = fastcomm.CompressedAdam(model.parameters(), lr=0.1, warmup_steps=2, exchange="momentum")
    weight = list(model.parameters())[0]
    for step in range(6):
        _fill_grads(model, step)
        if step < 2:
            weight.grad[0] = 0.0  # row 0 has no gradient in warm-up, then a large one
        optimizer.step()
        assert torch.isfinite(weight).all()
    frozen_row = weight.detach()[0].clone()
    _fill_grads(model, 7)
    optimizer.step()
    assert torch.equal(weight.detach()[0], frozen_row * (1 - 0.1 * 1e-2)), "only weight decay moves it"


def test_precondition_floors_a_frozen_variance_by_the_gradient():
    gen = torch.Generator().manual_seed(zlib.crc32(b"precondition"))
    grad = torch.randn(1003, generator=gen) * 10
    denom = torch.rand(1003, generator=gen) + 1e-8
    denom[::7] = 1e-8  # coordinates that had no gradient in warm-up
    expected = grad / torch.maximum(denom, 0.05**0.5 * grad.abs() / 4.0)
    out = fastcomm.optim.precondition_(grad.clone(), denom, beta2=0.95, grad_scale=4.0)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
    assert float((out / 4.0).abs().max()) <= 1 / 0.05**0.5 + 1e-5


@pytest.mark.parametrize(
    "options, error",
    [
        ({"lr": -1.0}, ValueError),
        ({"lr": "0.1"}, TypeError),
        ({"betas": (0.9, 1.0)}, ValueError),
        ({"betas": 0.9}, TypeError),
        ({"eps": math.nan}, ValueError),
        ({"weight_decay": True}, TypeError),
        ({"warmup_steps": 0}, ValueError),
        ({"warmup_steps": 10.0}, TypeError),
        ({"compressor": "zip"}, ValueError),
        ({"warmup_compressor": "sign"}, ValueError),
        ({"exchange": "gradient"}, ValueError),
        ({"start_iter": 5}, ValueError),
    ],
)
def test_bad_options_are_named(options, error):
    with pytest.raises(error, match=next(iter(options)).split("[")[0]):
        fastcomm.CompressedAdam(_model(0).parameters(), **options)


def test_parameter_without_warmup_gradient_is_reported():
    model = _model(3)
    optimizer = fastcomm.CompressedAdam(model.parameters(), warmup_steps=1)
    for p in list(model.parameters())[:-1]:
        p.grad = torch.randn(p.shape)
    optimizer.step()
    _fill_grads(model, 1)
    with pytest.raises(RuntimeError, match="no gradient during the 1 warm-up"):
        optimizer.step()


def test_register_rejects_a_plain_optimizer():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        fastcomm.register(_model(0), fastcomm.CompressedAdam(_model(0).parameters()))


@pytest.mark.distributed
def test_hook_momentum_equals_mean_gradient_momentum_with_and_without_no_sync(tmp_path):
    workers.spawn(tmp_path, 2, adam_workers.momentum_worker)


@pytest.fixture(scope="module")
def resumed_weight_diffs(tmp_path_factory) -> dict[str, float]:
    """Max |dW| of every resume case against its uninterrupted run (one process group runs them all)."""
    workdir = tmp_path_factory.mktemp("adam_resume")
    workers.spawn(workdir, 2, adam_workers.resume_worker, str(workdir / "diffs.json"))
    return json.loads((workdir / "diffs.json").read_text())


RESUME_CASES = pytest.mark.parametrize(
    "compressor, warmup_compressor, resume_step, layout",
    [
        (compressor, warmup_compressor, resume_step, layout)
        for compressor in fastcomm.optim.COMPRESSORS
        for warmup_compressor in fastcomm.optim.WARMUP_COMPRESSORS
        for resume_step in adam_workers.RESUME_STEPS
        for layout in adam_workers.RESUME_LAYOUTS
    ],
)


@RESUME_CASES
def test_resume_around_the_end_of_warmup_is_bit_identical(
    resumed_weight_diffs, compressor, warmup_compressor, resume_step, layout
):
    # at resume_step == warmup_steps a fresh DDP's first iteration (one bucket) is the compressor's first
    case = adam_workers.resume_case(compressor, warmup_compressor, layout, resume_step, again=False)
    diff = resumed_weight_diffs[case]
    assert diff == 0.0, f"{case}: weights differ by up to {diff:.3g}"


@RESUME_CASES
def test_resume_from_a_checkpoint_taken_one_step_after_a_resume_is_bit_identical(
    resumed_weight_diffs, compressor, warmup_compressor, resume_step, layout
):
    # that checkpoint follows a fresh DDP's one-bucket iteration, reduced as the rebuilt layout's buckets
    case = adam_workers.resume_case(compressor, warmup_compressor, layout, resume_step, again=True)
    diff = resumed_weight_diffs[case]
    assert diff == 0.0, f"{case}: weights differ by up to {diff:.3g}"


@pytest.mark.distributed
def test_grad_scaler_skip_leaves_weights_momentum_and_residuals(tmp_path):
    workers.spawn(tmp_path, 2, adam_workers.grad_scaler_worker)


@pytest.mark.distributed
def test_loss_goes_down_like_dense_adamw(tmp_path):
    workers.spawn(tmp_path, 2, adam_workers.convergence_worker, str(tmp_path))
    curves = json.loads((tmp_path / "curves.json").read_text())

    def final(name: str) -> float:
        return sum(curves[name][-20:]) / 20

    start = sum(curves["dense"][:5]) / 5
    dense = final("dense")
    assert dense < 0.6 * start, curves["dense"][::10]  # the task is learnable
    # tolerance from dense itself: the spread of two dense seeds, and at least 5% of dense's progress
    tolerance = max(abs(final("dense_seed2") - dense), 0.05 * (start - dense))
    for name in ("sign", "sign_momentum", "quantize", "topk"):
        assert final(name) <= dense + tolerance, (
            f"{name}: {final(name):.4f} vs dense {dense:.4f} (+{tolerance:.4f})"
        )
