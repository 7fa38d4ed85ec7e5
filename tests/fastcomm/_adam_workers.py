"""Rank processes for the CompressedAdam tests (spawned by tests/fastcomm/test_compressed_adam.py)."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import torch
import torch.distributed as dist
from _hooks_workers import _blobs, assert_same_on_all_ranks, batch_for, make_mlp
from torch import nn

import fastcomm
from fastcomm.optim import precondition_

LAYOUT: dict = {}  # DDP defaults: the resumed run starts on the initial bucket layout, then rebuilds
ADAM = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _local_grads(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """This rank's gradient of ``model`` (no DDP), accumulated over ``batches`` as ``no_sync`` does."""
    local = copy.deepcopy(model)
    for x, y in batches:
        nn.functional.cross_entropy(local(x), y).backward()
    return [p.grad.detach().clone() for p in local.parameters()]


def _mean_over_ranks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for t in tensors:
        t = t.clone()
        dist.all_reduce(t)
        out.append(t / dist.get_world_size())
    return out


def momentum_worker(rank: int, world_size: int) -> None:
    """The hook's result is beta1 * m + (1 - beta1) * mean(g), with and without no_sync accumulation."""
    for accumulate in (1, 2):
        model = make_mlp(11)
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = fastcomm.CompressedAdam(
            ddp.parameters(),
            **ADAM,
            warmup_steps=2,
            compressor="quantize",
            bits=8,
            stochastic=False,
            min_compress_numel=0,
        )
        state = fastcomm.register(ddp, optimizer)
        for step in range(5):
            batches = [batch_for(rank, 10 * step + micro) for micro in range(accumulate)]
            expected = None
            if optimizer.compressing:
                # each rank's gradient through the frozen preconditioner (floored by its own |g|), averaged
                local = [
                    precondition_(g, optimizer.frozen_denom_of(p), ADAM["betas"][1])
                    for p, g in zip(model.parameters(), _local_grads(model, batches), strict=True)
                ]
                expected = [
                    0.9 * optimizer.momentum_of(p) + 0.1 * g
                    for p, g in zip(model.parameters(), _mean_over_ranks(local), strict=True)
                ]
            optimizer.zero_grad()
            for micro, (x, y) in enumerate(batches):
                if micro + 1 < len(batches):
                    with ddp.no_sync():
                        nn.functional.cross_entropy(ddp(x), y).backward()
                else:
                    nn.functional.cross_entropy(ddp(x), y).backward()
            for p in model.parameters():
                assert_same_on_all_ranks(p.grad, f"momentum after step {step}")
            if expected is not None:
                # 8-bit codes with nearest rounding, two phases, plus last step's residuals sent now: within
                # a few quantization steps of the largest entry (scales are per block of the whole bucket)
                bound = 4.0 * max(float(e.abs().max()) for e in expected) / 127
                for p, e in zip(model.parameters(), expected, strict=True):
                    error = float((p.grad - e).abs().max())
                    assert error <= bound, (step, accumulate, error, bound)
            optimizer.step()
        stats = state.stats()
        assert stats["phase"] == "compressed" and stats["compressed_buckets"] > 0, stats
        for p in model.parameters():
            assert_same_on_all_ranks(p, "weights")


def _train(
    rank: int, ddp: nn.Module, optimizer: torch.optim.Optimizer, steps: range, data=batch_for
) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        x, y = data(rank, step)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def resume_worker(rank: int, world_size: int, compressor: str, warmup_compressor: str | None = None) -> None:
    """Optimizer and hook state saved mid-run and restored into a fresh DDP continue bit for bit.

    With a ``warmup_compressor`` the save falls inside warm-up, and the resumed run crosses into the
    compressed phase.
    """
    warmup_steps = 3 if warmup_compressor is None else 8
    options = {"sign": {"chunk": 64}, "quantize": {"bits": 4, "block": 64}, "topk": {"ratio": 0.1}}[
        compressor
    ]
    options = {**options, "min_compress_numel": 0}

    def build(seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, object]:
        model = make_mlp(seed)
        ddp = nn.parallel.DistributedDataParallel(model, **LAYOUT)
        optimizer = fastcomm.CompressedAdam(
            ddp.parameters(),
            **ADAM,
            warmup_steps=warmup_steps,
            compressor=compressor,
            warmup_compressor=warmup_compressor,
            **options,
        )
        return model, ddp, optimizer, fastcomm.register(ddp, optimizer)

    model, ddp, optimizer, state = build(21)
    _train(rank, ddp, optimizer, range(6))
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "comm": state.state_dict()}, buffer
    )
    _train(rank, ddp, optimizer, range(6, 10))
    fresh, fresh_ddp, fresh_optimizer, fresh_state = build(22)
    buffer.seek(0)
    saved = torch.load(buffer)
    fresh.load_state_dict(saved["model"])
    fresh_optimizer.load_state_dict(saved["optimizer"])
    fresh_state.load_state_dict(saved["comm"])
    assert fresh_optimizer.steps == 6 and fresh_optimizer.compressing == (warmup_compressor is None)
    _train(rank, fresh_ddp, fresh_optimizer, range(6, 10))
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), f"{compressor}: weights differ after resume"


def grad_scaler_worker(rank: int, world_size: int) -> None:
    """An inf on one rank in the compressed phase: the step is skipped everywhere, nothing owed changes."""
    model = make_mlp(31)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = fastcomm.CompressedAdam(
        ddp.parameters(), **ADAM, warmup_steps=2, chunk=64, min_compress_numel=0
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state = fastcomm.register(ddp, optimizer, grad_scaler=scaler)
    for step in range(7):
        optimizer.zero_grad()
        x, y = batch_for(rank, step)
        loss = nn.functional.cross_entropy(ddp(x), y)
        if step == 4 and rank == 1:
            loss = loss * float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        owed = [state.inner.residual_of(p) for p in model.parameters()]
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step == 4:
            assert scaler.get_scale() < scale, "GradScaler did not see the inf"
            assert optimizer.steps == 4, optimizer.steps
            for b, p in zip(before, model.parameters(), strict=True):
                assert torch.equal(b, p), "the skipped step moved a weight"
            for o, p in zip(owed, model.parameters(), strict=True):
                assert torch.equal(o, state.inner.residual_of(p)), "the skipped step changed a residual"
        else:
            assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), step
    assert optimizer.steps == 6
    for p in model.parameters():
        assert_same_on_all_ranks(p, "weights after a skipped step")


def _blob_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _blobs(32, seed=step * 2 + rank + 1)


def convergence_worker(rank: int, world_size: int, result_dir: str) -> None:
    """Loss curves of dense AdamW and CompressedAdam with each compressor on a small MLP."""
    curves: dict[str, list[float]] = {}
    cases = {
        "dense": None,
        "dense_seed2": None,
        "sign": {"compressor": "sign", "chunk": 256},
        "sign_momentum": {"compressor": "sign", "chunk": 256, "exchange": "momentum"},
        "quantize": {"compressor": "quantize", "bits": 4, "block": 64},
        "topk": {"compressor": "topk", "ratio": 0.1},
    }
    for name, options in cases.items():
        model = make_mlp(41 if name != "dense_seed2" else 42, (20, 64, 64, 4))
        ddp = nn.parallel.DistributedDataParallel(model)
        if options is None:
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(ddp.parameters(), **ADAM)
        else:
            optimizer = fastcomm.CompressedAdam(
                ddp.parameters(), **ADAM, warmup_steps=20, min_compress_numel=0, **options
            )
            fastcomm.register(ddp, optimizer)
        curves[name] = _train(rank, ddp, optimizer, range(150), _blob_batch)
    if rank == 0:
        Path(result_dir, "curves.json").write_text(json.dumps(curves))
