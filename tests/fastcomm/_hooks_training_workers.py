"""Rank processes for whole training runs with the hooks: stress (test_hooks_stress.py: every hook over
20+ buckets of mixed sizes with rank-skewed timing) and convergence (test_hooks_ddp.py: test accuracy per
hook on seeded blobs). Spawned through :func:`_hooks_workers.spawn`.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _hooks_workers import _blobs, assert_same_on_all_ranks, make_mlp, recording
from torch import nn

import fastcomm


# -------------------------------------------------------------------------------------- stress (W = 4)
class _MeanInBackward(torch.autograd.Function):
    """Identity forward; backward averages the gradient over ranks (a collective mid-backward, as
    SyncBatchNorm's backward issues on the default group between DDP's hook calls)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()


class MixedModel(nn.Module):
    """24 parameters from 1 to ~2000 elements, so a tiny bucket cap gives 20+ buckets; one collective of
    the model's own in the middle of its backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        widths = [12, 40, 3, 33, 1, 25, 64, 7, 30, 16, 9, 12, 4]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers[:-1]):
            x = torch.tanh(layer(x))
            if i == 5:
                x = _MeanInBackward.apply(x)
        return self.layers[-1](x)


def stress_worker(rank: int, world_size: int, steps: int) -> None:
    """Every hook over 20+ buckets of mixed sizes (dense and compressed mixed) with rank-skewed timing."""
    jitter = random.Random(rank)
    cases = [
        ("topk", {"ratio": 0.05, "exact": False, "min_compress_numel": 16}),
        # quantize and sign share the two-phase engine (hooks/engine/twophase.py): one with the second phase
        # overlapped, the other without, covers both of its orders
        ("quantize", {"bits": 2, "block": 32, "min_compress_numel": 16}),
        ("sign", {"chunk": 64, "min_compress_numel": 16, "overlap_phase2": False}),
        ("cast", {}),
    ]
    for hook_name, options in cases:
        model = MixedModel()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.00002)
        layouts: list[list[int]] = []
        row = fastcomm.hooks.HOOKS[fastcomm.HookName(hook_name)]
        state, hook = row.state(**options), row.hook
        state.bind(model)
        ddp.register_comm_hook(state, recording(hook, layouts))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for step in range(steps):
            gen = torch.Generator().manual_seed(rank * 100_003 + step)
            x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen)
            if jitter.random() < 0.3:
                time.sleep(jitter.random() * 0.002)
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
        assert len(layouts[-1]) >= 20, f"only {len(layouts[-1])} buckets"
        stats = state.stats()
        assert stats["steps"] == steps, stats
        if hook_name != "cast":  # small buckets go dense, the rest compressed: both kinds of collective mix
            assert stats["dense_buckets"] > 0 and stats["compressed_buckets"] > 0, stats
        for p in model.parameters():
            assert torch.isfinite(p).all()
            assert_same_on_all_ranks(p, f"{hook_name}: parameters after {steps} steps")


# ---------------------------------------------------------------------------------------------- training

CONVERGENCE_CASES = {
    "dense": None,
    "topk": ("topk", {"ratio": 0.05, "min_compress_numel": 0}),
    "topk_momentum_warmup": (
        "topk",
        {"ratio": 0.05, "momentum": 0.9, "warmup_steps": 40, "min_compress_numel": 0},
    ),
    "quantize": ("quantize", {"bits": 4, "min_compress_numel": 0}),
    "quantize8": ("quantize", {"bits": 8, "min_compress_numel": 0}),
    "sign": ("sign", {"min_compress_numel": 0}),
    "cast": ("cast", {}),
}


def convergence_worker(rank: int, world_size: int, steps: int, result_dir: str) -> None:
    """Train a small MLP on seeded blobs with each hook; rank 0 writes the test accuracies."""
    test_x, test_y = _blobs(2000, seed=999)
    accuracies = {}
    for name, case in CONVERGENCE_CASES.items():
        model = make_mlp(70, (20, 32, 4))
        ddp = nn.parallel.DistributedDataParallel(model)
        momentum = 0.9
        if case is not None:
            state = fastcomm.register(ddp, case[0], **case[1])
            if getattr(state, "momentum", 0.0) > 0.0:
                momentum = 0.0  # the hook applies momentum (DGC momentum correction)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=momentum)
        for step in range(steps):
            x, y = _blobs(32, seed=step * 2 + rank + 1)
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        with torch.no_grad():
            accuracies[name] = float((model(test_x).argmax(dim=1) == test_y).float().mean()) * 100
    if rank == 0:
        Path(result_dir, "accuracy.json").write_text(json.dumps(accuracies))


def read_accuracies(result_dir: Path) -> dict[str, float]:
    return json.loads((result_dir / "accuracy.json").read_text())
