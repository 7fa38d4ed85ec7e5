"""fastcomm.DiLoCo's outer step: its defaults (the outer lr that follows the inner LR, momentum 0.5, a
compressor's own outer step), an explicit setting winning over them, and eager updates (one gloo rank)."""

import pytest
import torch
from torch import nn

import fastcomm
from fastcomm.diloco.schedule import InnerLRFollower


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))


def test_the_defaults_follow_the_inner_lr_with_momentum_half_and_explicit_settings_win():
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = fastcomm.DiLoCo(model, inner, sync_every=10, compressor="quantize", bits=4)
    assert isinstance(outer.outer_lr, InnerLRFollower) and outer.outer_momentum == 0.5
    mine = fastcomm.DiLoCo(model, inner, sync_every=10, outer_lr=0.7, outer_momentum=0.9)
    assert (mine.outer_lr, mine.outer_momentum) == (0.7, 0.9)


def test_the_follower_is_low_until_the_peak_then_rises_as_the_inner_lr_decays():
    follow = InnerLRFollower(low=0.5, high=1.0)
    assert [follow(lr) for lr in (1e-4, 1e-3, 2e-3, 2e-3)] == [0.5, 0.5, 0.5, 0.5]  # warm-up, peak
    assert follow(1e-3) == pytest.approx(0.75) and follow(0.0) == pytest.approx(1.0)
    again = InnerLRFollower()
    again.load_state_dict(follow.state_dict())
    assert again(5e-4) == pytest.approx(0.875)
    with pytest.raises(ValueError, match="for low"):
        InnerLRFollower(low=0.0)


def _train(outer: fastcomm.DiLoCo, inner: torch.optim.Optimizer, model: nn.Module, steps: int):
    generator = torch.Generator().manual_seed(11)
    warmed_and_decayed = lambda s: min(1.0, (s + 1) / 4) * (1 - s / (steps + 1))  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, warmed_and_decayed)
    for _ in range(steps):
        inner.zero_grad()
        x = torch.randn(8, 12, generator=generator)
        model(x).sub(x[:, :3]).square().mean().backward()
        outer.step()
        schedule.step()
    outer.finish()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _run(steps: int = 24, **options) -> tuple[torch.Tensor, fastcomm.DiLoCo]:
    model = _model(1)
    inner = torch.optim.AdamW(model.parameters(), lr=5e-2)
    outer = fastcomm.DiLoCo(model, inner, sync_every=4, **options)
    return _train(outer, inner, model, steps), outer


def test_eager_updates_on_one_rank_match_the_sync_applied_at_once(one_rank):
    # one rank: the estimate (this rank's own pseudo-gradient) is the mean
    constant = {"outer_lr": 0.7, "outer_momentum": 0.5}  # the same outer lr at the issue and 2 steps later
    at_once, _ = _run(delay=0, **constant)
    eager, outer = _run(delay=2, eager=True, **constant)
    late, _ = _run(delay=2, **constant)
    torch.testing.assert_close(eager, at_once, rtol=0, atol=1e-5)
    assert (late - at_once).abs().max() > 1e-3  # without eager, two steps late is another run
    assert outer.syncs == 6


def test_eager_needs_a_delay_and_no_mixing():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="eager needs delay >= 1"):
        fastcomm.DiLoCo(model, inner, sync_every=4, eager=True)
    with pytest.raises(ValueError, match="mixing=None"):
        fastcomm.DiLoCo(model, inner, sync_every=4, delay=1, mixing=0.5, eager=True)


def test_the_followers_peak_is_in_the_checkpoint(one_rank):
    _, outer = _run(steps=8)
    state = outer.state_dict()
    assert state["outer_lr"]["peak"] == pytest.approx(5e-2 * (1 - 3 / 9))  # the schedule's top, step 3
    model = _model(1)
    fresh = fastcomm.DiLoCo(model, torch.optim.AdamW(model.parameters()), sync_every=4)
    fresh.load_state_dict(state)
    assert fresh.outer_lr.peak == outer.outer_lr.peak
