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

# resume cases: every step around the end of warm-up, DDP's default bucket size (one bucket in both
# layouts, parameters in another order) and a small one (several buckets after the rebuild)
RESUME_WARMUP_STEPS = 3
RESUME_STEPS = (RESUME_WARMUP_STEPS - 1, RESUME_WARMUP_STEPS, RESUME_WARMUP_STEPS + 1)
RESUME_TOTAL_STEPS = RESUME_WARMUP_STEPS + 4
RESUME_LAYOUTS = {"default": {}, "small_buckets": {"bucket_cap_mb": 0.004}}
RESUME_OPTIONS = {"sign": {"chunk": 64}, "quantize": {"bits": 4, "block": 64}, "topk": {"ratio": 0.1}}
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


def resume_case(
    compressor: str, warmup_compressor: str | None, layout: str, resume_step: int, again: bool
) -> str:
    """The key of one resume case in ``resume_worker``'s results."""
    return f"{compressor}/{warmup_compressor}/{layout}/{resume_step}" + ("/again" if again else "")


def _build_adam(
    seed: int, compressor: str, warmup_compressor: str | None, layout: str
) -> tuple[nn.Module, nn.Module, fastcomm.CompressedAdam, object]:
    model = make_mlp(seed)
    ddp = nn.parallel.DistributedDataParallel(model, **RESUME_LAYOUTS[layout])
    optimizer = fastcomm.CompressedAdam(
        ddp.parameters(),
        **ADAM,
        warmup_steps=RESUME_WARMUP_STEPS,
        compressor=compressor,
        warmup_compressor=warmup_compressor,
        **RESUME_OPTIONS[compressor],
        min_compress_numel=0,
    )
    return model, ddp, optimizer, fastcomm.register(ddp, optimizer)


def _checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, state: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "comm": state.state_dict()}, buffer
    )
    return buffer.getvalue()


def _restored(blob: bytes, *case: object) -> tuple[nn.Module, nn.Module, fastcomm.CompressedAdam, object]:
    """A fresh DDP model, optimizer and hook state (other initial weights) loaded from ``blob``."""
    model, ddp, optimizer, state = _build_adam(22, *case)
    checkpoint = torch.load(io.BytesIO(blob))
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    state.load_state_dict(checkpoint["comm"])
    return model, ddp, optimizer, state


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    with torch.no_grad():
        return max(float((x - y).abs().max()) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def resume_worker(rank: int, world_size: int, result_file: str) -> None:
    """Every compressor, warm-up compressor and layout: optimizer and hook state saved at each of
    ``RESUME_STEPS`` and restored into a fresh DDP; the resumed run saves again after its first step, and
    that is restored into another fresh DDP. Rank 0 writes each case's max |dW| against the uninterrupted
    run after ``RESUME_TOTAL_STEPS`` steps (0.0 when bit-identical).

    A fresh DDP reduces its first iteration in one bucket, in forward order, and rebuilds after it; the
    uninterrupted run crosses from warm-up into the compressed phase on the rebuilt layout.
    """
    results = {}
    for compressor in fastcomm.optim.COMPRESSORS:
        for warmup_compressor in fastcomm.optim.WARMUP_COMPRESSORS:
            for layout in RESUME_LAYOUTS:
                case = (compressor, warmup_compressor, layout)
                model, ddp, optimizer, state = _build_adam(21, *case)
                saved = {}
                for step in range(RESUME_TOTAL_STEPS):
                    if step in RESUME_STEPS:
                        saved[step] = _checkpoint(model, optimizer, state)
                    _train(rank, ddp, optimizer, range(step, step + 1))
                for step, blob in saved.items():
                    resumed, resumed_ddp, resumed_optimizer, resumed_state = _restored(blob, *case)
                    assert resumed_optimizer.steps == step
                    _train(rank, resumed_ddp, resumed_optimizer, range(step, step + 1))
                    again_blob = _checkpoint(resumed, resumed_optimizer, resumed_state)
                    _train(rank, resumed_ddp, resumed_optimizer, range(step + 1, RESUME_TOTAL_STEPS))
                    again, again_ddp, again_optimizer, _ = _restored(again_blob, *case)
                    _train(rank, again_ddp, again_optimizer, range(step + 1, RESUME_TOTAL_STEPS))
                    results[resume_case(*case, step, again=False)] = _max_diff(model, resumed)
                    results[resume_case(*case, step, again=True)] = _max_diff(model, again)
    if rank == 0:
        Path(result_file).write_text(json.dumps(results))


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
