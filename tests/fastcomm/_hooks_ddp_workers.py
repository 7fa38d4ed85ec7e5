"""Rank processes for the DDP tests of the hooks (test_hooks_ddp.py): ``register()`` and its misuse,
per-model default states, bucket rebuilds, checkpoints, and the training modes (GradScaler, fp16 and bf16
models, ``no_sync``). Spawned through :func:`_hooks_workers.spawn`.
"""

from __future__ import annotations

import copy
import io
import pickle

import torch
import torch.distributed as dist
from _hooks_workers import (
    assert_same_on_all_ranks,
    batch_for,
    loss_of,
    make_mlp,
    recording,
    sgd_steps,
    sum_sent_and_raw,
)
from torch import nn

import fastcomm

HOOK_CASES = {
    "topk": ("topk", {"ratio": 0.1, "min_compress_numel": 0}),
    "quantize": ("quantize", {"bits": 4, "block": 64, "min_compress_numel": 0}),
    "sign": ("sign", {"chunk": 256, "min_compress_numel": 0}),
}


def ddp_worker(rank: int, world_size: int) -> None:
    """DDP integration: register(), per-model defaults, bucket rebuilds, checkpoints, misuse."""
    _check_register_and_misuse()
    _check_default_state_per_model(rank)
    for name in HOOK_CASES:
        _check_rebuild_keeps_residuals(rank, world_size, name)
        _check_checkpoint_resume(rank, name)


def _check_register_and_misuse() -> None:
    import pytest

    ddp = nn.parallel.DistributedDataParallel(make_mlp(0))
    with pytest.raises(ValueError, match="unknown hook"):
        fastcomm.register(ddp, "no_such_hook")
    with pytest.raises(ValueError, match="ratio"):
        fastcomm.register(ddp, "topk", ratio=2.0)
    with pytest.raises(ValueError, match="bits"):
        fastcomm.register(ddp, fastcomm.HookName.QUANTIZE, bits=3)
    state = fastcomm.register(ddp, fastcomm.HookName.TOPK, ratio=0.5)
    assert isinstance(state, fastcomm.TopKState) and state.ratio == 0.5
    other = nn.parallel.DistributedDataParallel(make_mlp(1))
    with pytest.raises(ValueError, match="another model"):
        fastcomm.register(other, state)
    # a state handed straight to a second model is caught at its first bucket
    loose = fastcomm.TopKState(min_compress_numel=0)
    first = nn.parallel.DistributedDataParallel(make_mlp(2))
    second = nn.parallel.DistributedDataParallel(make_mlp(3))
    first.register_comm_hook(loose, fastcomm.topk_hook)
    second.register_comm_hook(loose, fastcomm.topk_hook)
    loss_of(first, 0, 0).backward()
    with pytest.raises(Exception, match="two models"):
        loss_of(second, 0, 0).backward()
    for name in ("topk", "quantize", "sign", "cast"):
        state = fastcomm.register(nn.parallel.DistributedDataParallel(make_mlp(4)), name)
        restored = pickle.loads(pickle.dumps(state))
        assert restored.process_group is None and type(restored).__name__.lower().startswith(name[:4])


def _check_default_state_per_model(rank: int) -> None:
    """state=None: two models in one process keep separate states; each matches an explicit-state twin."""
    twin = nn.parallel.DistributedDataParallel(make_mlp(10, (16, 64, 64, 4)))
    fastcomm.register(twin, "topk")
    models = [nn.parallel.DistributedDataParallel(make_mlp(10, (16, 64, 64, 4))) for _ in range(2)]
    for model in models:
        model.register_comm_hook(None, fastcomm.topk_hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (twin, *models)]
    for step in range(5):
        for i, model in enumerate((twin, *models)):
            optimizers[i].zero_grad()
            loss_of(model, rank + 10 * (i == 2), step).backward()
            optimizers[i].step()
        for p_twin, p_model in zip(twin.parameters(), models[0].parameters(), strict=True):
            assert torch.equal(p_twin, p_model), f"default-state model diverged from its twin at step {step}"
    states = [fastcomm.hooks.default_state(m, fastcomm.TopKState) for m in models]
    assert states[0] is not None and states[1] is not None and states[0] is not states[1]
    assert states[0].stats()["steps"] == 5 and states[1].stats()["steps"] == 5


def _check_rebuild_keeps_residuals(rank: int, world_size: int, name: str) -> None:
    """Compression from step 0 across DDP's bucket rebuild: the error-feedback invariant still holds."""
    hook_name, options = HOOK_CASES[name]
    model = make_mlp(20)
    local = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    row = fastcomm.hooks.HOOKS[fastcomm.HookName(hook_name)]
    state, hook = row.state(**options), row.hook
    state.bind(ddp.module)
    layouts: list[list[int]] = []
    ddp.register_comm_hook(state, recording(hook, layouts))
    sent, raw = sum_sent_and_raw(ddp, local, rank, 6)
    assert layouts[0] != layouts[1], f"DDP did not rebuild its buckets: {layouts[:2]}"
    for s, r, p in zip(sent, raw, model.parameters(), strict=True):
        owed = state.residual_of(p).double()
        dist.all_reduce(owed)
        dist.all_reduce(r)
        err = float((s + owed / world_size - r / world_size).abs().max())
        assert err < 1e-5, f"{name}: error-feedback invariant broken across the rebuild by {err}"


def _check_checkpoint_resume(rank: int, name: str) -> None:
    """A state saved at step N and restored into a fresh DDP gives bit-identical gradients at step N+1."""
    hook_name, options = HOOK_CASES[name]
    kwargs = {"bucket_cap_mb": 0.004, "find_unused_parameters": True}  # stable bucket layout
    model = make_mlp(30)
    ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
    state = fastcomm.register(ddp, hook_name, **options)
    optimizer = sgd_steps(ddp, rank)
    saved_model = copy.deepcopy(model.state_dict())
    saved_state = state.state_dict()
    pickled = pickle.dumps(state)
    buffer = io.BytesIO()
    torch.save(saved_state, buffer)
    optimizer.zero_grad()
    loss_of(ddp, rank, 3).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    for restore in ("pickle", "state_dict"):
        fresh = make_mlp(31)
        fresh.load_state_dict(saved_model)
        fresh_ddp = nn.parallel.DistributedDataParallel(fresh, **kwargs)
        if restore == "pickle":
            restored = fastcomm.register(fresh_ddp, pickle.loads(pickled))
        else:
            restored = fastcomm.register(fresh_ddp, hook_name, **options)
            buffer.seek(0)
            restored.load_state_dict(torch.load(buffer))
        assert restored.stats()["steps"] == 3
        loss_of(fresh_ddp, rank, 3).backward()
        for p, e in zip(fresh.parameters(), expected, strict=True):
            assert torch.equal(p.grad, e), f"{name} via {restore}: step N+1 gradient differs after resume"


# ------------------------------------------------------------------------ AMP, half precision, no_sync
def training_modes_worker(rank: int, world_size: int) -> None:
    for name in HOOK_CASES:
        _check_grad_scaler_skip(rank, name)
    _check_dense_steps_count_a_skip(rank, world_size)
    _check_cast_steps_are_the_bf16_mean(rank, world_size)
    _check_half_precision_models(rank, world_size)
    _check_no_sync(rank, world_size)


def _check_grad_scaler_skip(rank: int, name: str) -> None:
    """inf on one rank reaches GradScaler on all ranks; the skipped step leaves residuals and steps alone."""
    hook_name, options = HOOK_CASES[name]
    model = make_mlp(40)
    ddp = nn.parallel.DistributedDataParallel(model)
    state = fastcomm.register(ddp, hook_name, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    owed_before = None
    for step in range(5):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(ddp, rank, step)
        if step == 2 and rank == 1:
            loss = loss * float("inf")
        if step == 2:
            owed_before = [state.residual_of(p).clone() for p in model.parameters()]
        scale_before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step == 2:
            assert scaler.get_scale() < scale_before, f"{name}: GradScaler did not see the inf"
            for before, p in zip(owed_before, model.parameters(), strict=True):
                after = state.residual_of(p)
                assert torch.equal(before, after), f"{name}: the skipped step changed a residual"
            state.scale_residuals(scaler.get_scale() / scale_before)  # owed gradients follow the loss scale
            for before, p in zip(owed_before, model.parameters(), strict=True):
                assert torch.equal(before * 0.5, state.residual_of(p)), f"{name}: scale_residuals"
        else:
            assert all(torch.isfinite(p.grad).all() for p in model.parameters()), f"{name} step {step}"
    stats = state.stats()
    assert stats["steps"] == 4 and stats["skipped_steps"] == 1, stats
    assert all(torch.isfinite(state.residual_of(p)).all() for p in model.parameters())


def _check_dense_steps_count_a_skip(rank: int, world_size: int) -> None:
    """Dense buckets (before ``start_iter``): the mean is the sum divided after it arrives, checked in the
    same pass; an inf on one rank is a skipped step on every rank, finite steps are the plain mean."""
    model = make_mlp(41)
    local = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    state = fastcomm.register(ddp, "quantize", bits=8, start_iter=100)
    for step in range(4):
        ddp.zero_grad()
        local.zero_grad()
        loss = loss_of(ddp, rank, step)
        (loss * float("inf") if step == 2 and rank == 1 else loss).backward()
        if step == 2:
            assert all(not torch.isfinite(p.grad).all() for p in model.parameters()), "the inf did not spread"
            continue
        loss_of(local, rank, step).backward()
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            grads = [torch.empty_like(q.grad) for _ in range(world_size)]
            dist.all_gather(grads, q.grad)
            torch.testing.assert_close(p.grad, torch.stack(grads).sum(0) / world_size)
    stats = state.stats()
    assert stats["steps"] == 3 and stats["skipped_steps"] == 1 and stats["compressed_buckets"] == 0, stats


def _check_cast_steps_are_the_bf16_mean(rank: int, world_size: int) -> None:
    """cast (bf16) over several steps, across DDP's bucket rebuild (its wire tensors are kept per bucket):
    each gradient is exactly the bf16 allreduce of bf16(g_r / W) (2 ranks: one rounded sum, any order)."""
    assert world_size == 2
    model = make_mlp(42)
    local = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
    fastcomm.register(ddp, "cast")
    for step in range(4):
        ddp.zero_grad()
        local.zero_grad()
        loss_of(ddp, rank, step).backward()
        loss_of(local, rank, step).backward()
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            grads = [torch.empty_like(q.grad) for _ in range(world_size)]
            dist.all_gather(grads, q.grad)
            wire = [(g / world_size).to(torch.bfloat16) for g in grads]
            expected = (wire[0] + wire[1]).float()
            assert torch.equal(p.grad, expected), f"cast step {step}: not the bf16 mean"


def _check_half_precision_models(rank: int, world_size: int) -> None:
    """DDP over fp16 and bf16 models: every hook returns finite buckets of that dtype near the dense mean."""
    for dtype in (torch.float16, torch.bfloat16):
        for name, (hook_name, options) in {**HOOK_CASES, "cast": ("cast", {})}.items():
            model = make_mlp(50).to(dtype)
            local = copy.deepcopy(model)
            ddp = nn.parallel.DistributedDataParallel(model)
            fastcomm.register(ddp, hook_name, **options)
            x, y = batch_for(rank, 0)
            nn.functional.cross_entropy(ddp(x.to(dtype)).float(), y).backward()
            nn.functional.cross_entropy(local(x.to(dtype)).float(), y).backward()
            for p, q in zip(model.parameters(), local.parameters(), strict=True):
                assert p.grad.dtype == dtype and torch.isfinite(p.grad).all(), f"{name} {dtype}"
                mean = q.grad.float()
                dist.all_reduce(mean)
                mean /= world_size
                if name == "cast":
                    tol = 0.02 * float(mean.abs().max()) + 1e-3
                    assert float((p.grad.float() - mean).abs().max()) <= tol, f"{name} {dtype}"
                assert_same_on_all_ranks(p.grad, f"{name} {dtype}")


class WithUnused(nn.Module):
    """A model with a parameter that never receives a gradient (for find_unused_parameters=True)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net, self.unused = net, nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _check_no_sync(rank: int, world_size: int) -> None:
    """Accumulation under no_sync reduces once, on the sync step, also with static_graph (lossless top-k)."""
    configs = [
        {},
        {"static_graph": True},
        {"gradient_as_bucket_view": True},
        {"static_graph": True, "gradient_as_bucket_view": True},
        {"find_unused_parameters": True},
    ]
    for config in configs:
        model = WithUnused(make_mlp(60)) if config.get("find_unused_parameters") else make_mlp(60)
        local = copy.deepcopy(model)
        ddp = nn.parallel.DistributedDataParallel(model, **config)
        state = fastcomm.register(ddp, "topk", ratio=1.0, min_compress_numel=0)
        # DDP itself (no hook involved) asserts if a static_graph model's first iteration is a no_sync one,
        # so every config starts with one synchronised iteration.
        loss_of(ddp, rank, 99).backward()
        for step in range(3):
            ddp.zero_grad()
            local.zero_grad()
            for micro in range(3):
                loss_of(local, rank, 10 * step + micro).backward()
                if micro < 2:
                    with ddp.no_sync():
                        loss_of(ddp, rank, 10 * step + micro).backward()
                else:
                    loss_of(ddp, rank, 10 * step + micro).backward()
            for p, q in zip(model.parameters(), local.parameters(), strict=True):
                if q.grad is None:  # the unused layer
                    continue
                mean = q.grad.clone()
                dist.all_reduce(mean)
                mean /= world_size
                err = float((p.grad - mean).abs().max())
                assert err < 1e-5, f"{config} step {step}: sync step did not reduce the accumulation ({err})"
        stats = state.stats()
        assert stats["steps"] == 4 and stats["compressed_buckets"] == 4, (config, stats)
