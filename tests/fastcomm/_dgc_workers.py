"""Rank processes for the DGC recipe tests of ``topk_hook`` (local clipping, momentum correction, masking).

Spawned children import workers by module name, so they live here rather than in ``test_dgc.py``. The
spawn harness and the fake buckets come from :mod:`_hooks_workers`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from _hooks_workers import FakeBucket, assert_same_on_all_ranks, grad_for, make_mlp, run_hook
from torch import nn

import fastcomm
from fastcomm import reference

# buckets of awkward sizes; grad_for scales bucket b's gradient by 1 + b % 3, so with CLIP_NORM below the
# threshold clips buckets 1 and 2 on every rank and leaves bucket 0 alone (checked in the worker)
BUCKET_SIZES = ((300, 211), (1000,), (37, 90))
CLIP_NORM = 85.0
RATIO = 0.05
STEPS = 4


def _clip(g: torch.Tensor, threshold: float) -> tuple[torch.Tensor, bool]:
    norm = float(g.double().norm())
    return (g * (threshold / norm) if norm > threshold else g.clone()), norm > threshold


def _simulate(case: dict, world_size: int) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], set]:
    """The test's own DGC for every rank: outputs per step and bucket, final residuals, buckets clipped."""
    model_numel = sum(sum(sizes) for sizes in BUCKET_SIZES)
    numels = [sum(sizes) for sizes in BUCKET_SIZES]
    velocity = [[torch.zeros(n) for n in numels] for _ in range(world_size)]
    residual = [[torch.zeros(n) for n in numels] for _ in range(world_size)]
    clipped = set()
    outputs = []
    for step in range(STEPS):
        step_out = []
        for b, numel in enumerate(numels):
            k = math.ceil(RATIO * numel)
            out = torch.zeros(numel)
            threshold = CLIP_NORM * math.sqrt(numel / model_numel) / math.sqrt(world_size)
            for rank in range(world_size):
                g, was_clipped = _clip(grad_for(rank, b, step, numel, torch.float32), threshold)
                if was_clipped:
                    clipped.add(b)
                m = case["momentum"]
                if case["nesterov"]:
                    velocity[rank][b] = m * (velocity[rank][b] + g)
                    acc = velocity[rank][b] + g + residual[rank][b]
                else:
                    velocity[rank][b] = m * velocity[rank][b] + g
                    acc = velocity[rank][b] + residual[rank][b]
                values, indices = reference.topk_select(acc, k, exact=True)
                sent = indices.long()
                residual[rank][b] = acc.clone()
                residual[rank][b][sent] = 0
                if case["momentum_masking"]:
                    velocity[rank][b][sent] = 0
                out[sent] += values
            step_out.append(out / world_size)
        outputs.append(step_out)
    return outputs, residual, clipped


def clip_momentum_worker(rank: int, world_size: int, case: dict) -> None:
    """topk_hook with clipping and momentum correction against :func:`_simulate`, step by step."""
    params = [[nn.Parameter(torch.zeros(n)) for n in sizes] for sizes in BUCKET_SIZES]
    module = nn.ParameterList([p for bucket in params for p in bucket])
    state = fastcomm.TopKState(
        ratio=RATIO,
        exact=True,
        momentum=case["momentum"],
        nesterov=case["nesterov"],
        momentum_masking=case["momentum_masking"],
        clip_norm=CLIP_NORM,
        min_compress_numel=0,
    )
    state.bind(module)
    expected, residuals, clipped = _simulate(case, world_size)
    assert clipped == {1, 2}, f"the case must clip some buckets and not others, clipped {clipped}"
    unmasked, _, _ = _simulate({**case, "momentum_masking": not case["momentum_masking"]}, world_size)
    for step in range(STEPS):
        buckets = [
            FakeBucket(b, params[b], grad_for(rank, b, step, sum(sizes), torch.float32))
            for b, sizes in enumerate(BUCKET_SIZES)
        ]
        outs = run_hook(fastcomm.topk_hook, state, buckets)
        for b, (out, ref) in enumerate(zip(outs, expected[step], strict=True)):
            assert_same_on_all_ranks(out, f"step {step} bucket {b}")
            error = float((out - ref).norm() / ref.norm())
            assert error < 1e-5, f"{case} step {step} bucket {b}: relative error {error:.2e} vs reference"
    # the masking choice must be visible: the other choice's reference differs at the last step
    last = torch.cat(outs)
    other = torch.cat(unmasked[-1])
    assert float((last - other).norm() / other.norm()) > 1e-3, "momentum_masking changed nothing"
    for b in range(len(BUCKET_SIZES)):
        owed = torch.cat([state.residual_of(p).reshape(-1) for p in params[b]])
        error = float((owed - residuals[rank][b]).norm() / residuals[rank][b].norm())
        assert error < 1e-5, f"{case} bucket {b}: residual relative error {error:.2e}"


# ---------------------------------------------------------------------------------------------- training
def _blob_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A noisy 4-class problem in 20 dimensions (fixed centres, samples from ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, 20, generator=torch.Generator().manual_seed(123)) * 0.5
    labels = torch.randint(0, 4, (n,), generator=gen)
    return centres[labels] + torch.randn(n, 20, generator=gen), labels


def _train(rank: int, seed: int, hook_options: dict | None, steps: int, lr: float) -> float:
    model = make_mlp(seed, (20, 64, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    if hook_options is None:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    else:
        fastcomm.register(ddp, "topk", **hook_options)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.0)  # momentum lives in the hook
    for step in range(steps):
        x, y = _blob_batch(32, seed=1000 * seed + 2 * step + rank)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    test_x, test_y = _blob_batch(4000, seed=77)
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(test_x), test_y))


def training_worker(rank: int, world_size: int, runs: dict, steps: int, lr: float, result_dir: str) -> None:
    """Train each named run ``(seed, hook options or None for dense SGD m0.9)``; rank 0 writes the losses."""
    losses = {name: _train(rank, seed, options, steps, lr) for name, (seed, options) in runs.items()}
    losses["untrained"] = _train(rank, 1, None, 0, lr)
    dist.barrier()
    if rank == 0:
        Path(result_dir, "losses.json").write_text(json.dumps(losses))
