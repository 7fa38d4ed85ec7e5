"""Rank processes for the PowerSGD tests: an independent simulation of every rank, DDP layouts, resume.

Spawned through ``_hooks_workers.spawn`` (gloo, a collective timeout, a bounded wait for hangs).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from _hooks_workers import FakeBucket, assert_same_on_all_ranks, grad_for, run_hook, sum_sent_and_raw
from torch import nn

import fastcomm
from fastcomm.hooks.engine.util import seed_for
from fastcomm.hooks.powersgd import PowerSGDState, powersgd_hook

# parameter shapes per bucket: matrices that compress, a bias, a 3-d tensor (viewed 6 x 20), a matrix
# the factors would not shrink (3 x 4 at rank 3), one below min_compress_numel (5 x 10 = 50 < 64)
SIM_BUCKETS = [
    [(48, 20), (48,), (6, 4, 5), (3, 4), (5, 10)],
    [(30, 64)],
    [(7,), (40, 33)],
]
SIM_RANK = 3
SIM_MIN_NUMEL = 64
SIM_STEPS = 3


# ------------------------------------------------------------------------------- independent simulation
def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """Classical Gram-Schmidt, written here without the library's code (float64)."""
    columns: list[torch.Tensor] = []
    for i in range(p.shape[1]):
        v = p[:, i].clone()
        for u in columns:
            v = v - (u @ p[:, i]) * u
        columns.append(v / v.norm())
    return torch.stack(columns, dim=1)


class Simulation:
    """PowerSGD of every rank by the paper's equations, float64: P = M Q, orthogonalize, Q = M^T P."""

    def __init__(self, world_size: int, warm_start: bool) -> None:
        self.world_size, self.warm_start = world_size, warm_start
        self.residuals: dict[tuple[int, int, int], torch.Tensor] = {}  # (rank, bucket, param) -> M - PQ^T
        self.warm: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, param) -> Q

    def step(self, bucket: int, key: tuple[int, ...], shapes, grads: list[torch.Tensor], step: int):
        """Mean over ranks for one bucket; ``grads[r]`` is rank r's flat gradient."""
        out, offset, matrix_index = [], 0, 0
        for index, shape in enumerate(shapes):
            numel = math.prod(shape)
            ms = []
            for rank in range(self.world_size):
                g = grads[rank][offset : offset + numel].double()
                ms.append(g + self.residuals.get((rank, bucket, index), torch.zeros_like(g)))
            rows = shape[0]
            cols = numel // rows
            compress = len(shape) >= 2 and numel >= SIM_MIN_NUMEL and (rows + cols) * SIM_RANK < numel
            if not compress:
                out.append(sum(ms) / self.world_size)
                for rank in range(self.world_size):
                    self.residuals[(rank, bucket, index)] = torch.zeros_like(ms[rank])
            else:
                q = self.warm.get((bucket, index)) if self.warm_start else None
                if q is None or not bool(q.any()):
                    # the hook's documented start: randn from seed_for(0, step, key, 0, 1) + matrix index
                    gen = torch.Generator().manual_seed(seed_for(0, step, key, 0, 1) + matrix_index)
                    q = torch.randn(cols, SIM_RANK, generator=gen).double()
                mats = [m.view(rows, cols) for m in ms]
                p = _orthonormal(sum(m @ q for m in mats))
                q = sum(m.T @ p for m in mats) / self.world_size
                approx = p @ q.T
                out.append(approx.reshape(-1))
                for rank in range(self.world_size):
                    self.residuals[(rank, bucket, index)] = (mats[rank] - approx).reshape(-1)
                self.warm[(bucket, index)] = q
                matrix_index += 1
            offset += numel
        return torch.cat(out)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


SIM_VARIANTS = {
    "qr": {},
    "gram_schmidt": {"orthogonalization": "gram_schmidt"},
    "cold_start": {"warm_start": False},
    "deferred": {"overlap_phase2": False},
    "fp16_bucket": {},
}


def simulation_worker(rank: int, world_size: int, variants: tuple[str, ...]) -> None:
    """The hook's output and residuals equal the simulation of all ranks, for each variant, over steps."""
    for variant in variants:
        options = SIM_VARIANTS[variant]
        dtype = torch.float16 if variant == "fp16_bucket" else torch.float32
        state = PowerSGDState(SIM_RANK, min_compress_numel=SIM_MIN_NUMEL, **options)
        sim = Simulation(world_size, options.get("warm_start", True))
        params = [[torch.zeros(shape, dtype=dtype) for shape in shapes] for shapes in SIM_BUCKETS]
        keys, next_key = [], 0
        for shapes in SIM_BUCKETS:
            keys.append(tuple(range(next_key, next_key + len(shapes))))
            next_key += len(shapes)
        for step in range(SIM_STEPS):
            numels = [sum(math.prod(s) for s in shapes) for shapes in SIM_BUCKETS]
            grads = [
                [grad_for(r, b, step, numels[b], dtype) for b in range(len(SIM_BUCKETS))]
                for r in range(world_size)
            ]
            buckets = [FakeBucket(b, params[b], grads[rank][b]) for b in range(len(SIM_BUCKETS))]
            outs = run_hook(powersgd_hook, state, buckets)
            for b, shapes in enumerate(SIM_BUCKETS):
                want = sim.step(b, keys[b], shapes, [grads[r][b] for r in range(world_size)], step)
                # fp32 arithmetic (summed in another order by gloo) against float64: a few ulps times the
                # condition of the 3-column orthogonalization; fp16 buckets: the output's own rounding
                bound = 2e-3 if dtype == torch.float16 else 2e-5
                err = _relative(outs[b], want)
                where = f"{variant} W={world_size} step {step} bucket {b}"
                assert err < bound, f"{where}: relative error {err:.3g}"
                assert_same_on_all_ranks(outs[b], f"{variant} bucket {b}")
        for b, shapes in enumerate(SIM_BUCKETS):
            for index, param in enumerate(params[b]):
                owed = state.residual_of(param)
                want = sim.residuals[(rank, b, index)].view(shapes[index])
                err = float((owed.double() - want).abs().max() / want.abs().max().clamp_min(1.0))
                bound = 1e-3 if dtype == torch.float16 else 2e-5
                where = f"{variant} W={world_size}: residual of bucket {b} param {index}"
                assert err < bound, f"{where} off by {err:.3g}"
        stats = state.stats()
        assert stats["steps"] == SIM_STEPS and stats["compression_ratio"] > 1.0, stats
        _check_skipped_step(state, params, rank, dtype, variant)


def _check_skipped_step(state: PowerSGDState, params, rank: int, dtype: torch.dtype, variant: str) -> None:
    """inf on rank 0: every rank's output is non-finite, the step is skipped, residuals stay as they were."""
    before = [[state.residual_of(p).clone() for p in bucket] for bucket in params]
    numels = [sum(p.numel() for p in bucket) for bucket in params]
    grads = [grad_for(rank, b, 99, numels[b], dtype) for b in range(len(params))]
    if rank == 0:
        grads[0][5] = float("inf")
    outs = run_hook(powersgd_hook, state, [FakeBucket(b, params[b], grads[b]) for b in range(len(params))])
    assert not bool(torch.isfinite(outs[0]).all()), f"{variant}: an inf gradient came back finite"
    stats = state.stats()
    assert stats["skipped_steps"] == 1 and stats["steps"] == SIM_STEPS, f"{variant}: {stats}"
    for bucket, kept in zip(params, before, strict=True):
        for p, residual in zip(bucket, kept, strict=True):
            assert torch.equal(state.residual_of(p), residual), f"{variant}: a skipped step moved a residual"


# --------------------------------------------------------------------------------------- DDP, layouts
def _deep_mlp(seed: int, width: int = 24, depth: int = 25) -> nn.Module:
    """``depth`` Linear layers: 2 * depth parameters, so a tiny bucket cap gives ~2 * depth buckets."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _batch(rank: int, step: int, width: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(104729 * rank + step)
    return torch.randn(16, width, generator=gen), torch.randn(16, width, generator=gen)


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return nn.functional.mse_loss(model(x), y)


# DDP keyword arguments: DDP's defaults, one bucket, one bucket per parameter (50 buckets)
LAYOUTS = {
    "default": {},
    "one_bucket": {"bucket_cap_mb": 200.0},
    "mixed_buckets": {"bucket_cap_mb": 0.01},
    "fifty_buckets": {"bucket_cap_mb": 1e-6},
}


def _bucket_count(hook):
    counts: list[int] = []

    def counting_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
        if bucket.index() == 0:
            counts.append(0)
        counts[-1] += 1
        return hook(state, bucket)

    return counting_hook, counts


def layouts_worker(rank: int, world_size: int) -> None:
    """DDP over gloo with each bucket layout: it runs, ranks agree, and error feedback loses nothing.

    Checked per layout over steps that span DDP's bucket rebuild: biases (dense) equal the mean raw
    gradient; for every parameter, what the hook returned plus the mean residual equals the mean of the
    raw gradients (the error-feedback invariant); matrices come back with rank at most ``rank``.
    """
    for layout, kwargs in LAYOUTS.items():
        model = _deep_mlp(60)
        local = copy.deepcopy(model)
        ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
        if layout == "default":  # by name: the registry's CompressorState serving PowerSGDCompressor
            state = fastcomm.register(ddp, "powersgd", rank=2, min_compress_numel=0)
            counts: list[int] = []
        else:
            state = PowerSGDState(2, min_compress_numel=0)
            state.bind(ddp.module)
            hook, counts = _bucket_count(powersgd_hook)
            ddp.register_comm_hook(state, hook)

        def low_rank(grad: torch.Tensor, layout: str = layout) -> None:
            if grad.dim() == 2:
                rank_of = int(torch.linalg.matrix_rank(grad.double(), rtol=1e-4))
                assert rank_of <= 2, f"{layout}: a matrix gradient of rank {rank_of} > 2"

        sent, raw = sum_sent_and_raw(ddp, local, rank, 4, loss=_loss, check=low_rank)
        if layout == "fifty_buckets":
            assert counts[-1] == 50, f"expected 50 buckets, DDP made {counts[-1]}"
        for index, (s, r, p) in enumerate(zip(sent, raw, model.parameters(), strict=True)):
            owed = state.residual_of(p).double()
            dist.all_reduce(owed)
            dist.all_reduce(r)
            err = float((s + owed / world_size - r / world_size).abs().max())
            assert err < 1e-5, f"{layout}: parameter {index}: error-feedback invariant broken by {err:.3g}"
            if p.dim() == 1:
                assert float(owed.abs().max()) == 0.0, f"{layout}: a bias kept a residual"
        for p in model.parameters():
            assert_same_on_all_ranks(p.grad, f"{layout} gradient")
        assert state.stats()["compressed_buckets"] > 0


# --------------------------------------------------------------------------------------------- resume
RESUME_LAYOUTS = {"default": {}, "small_buckets": {"bucket_cap_mb": 0.004}}
RESUME_STEPS, CHECKPOINT_AT = 6, 3


def _resume_model(seed: int, layout: str):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 4))
    ddp = nn.parallel.DistributedDataParallel(model, **RESUME_LAYOUTS[layout])
    state = PowerSGDState(4, min_compress_numel=0)
    state.bind(ddp.module)
    ddp.register_comm_hook(state, powersgd_hook)
    return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


def _resume_step(model, ddp, optimizer, rank: int, step: int) -> list[torch.Tensor]:
    optimizer.zero_grad()
    gen = torch.Generator().manual_seed(7919 * rank + step)
    x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    nn.functional.cross_entropy(ddp(x), y).backward()
    optimizer.step()
    return [p.grad.clone() for p in model.parameters()] + [p.detach().clone() for p in model.parameters()]


def resume_worker(rank: int, world_size: int) -> None:
    """A fresh DDP and state restored from ``state_dict()`` reproduce the later steps bit for bit."""
    for layout in RESUME_LAYOUTS:
        model, ddp, state, optimizer = _resume_model(70, layout)
        recorded = []
        for step in range(RESUME_STEPS):
            if step == CHECKPOINT_AT:
                saved = copy.deepcopy({
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "comm": state.state_dict(),
                })
            result = _resume_step(model, ddp, optimizer, rank, step)
            if step >= CHECKPOINT_AT:
                recorded.append(result)
        assert any("compressor_state" in b["tensors"] for b in saved["comm"]["buckets"]), "no warm start kept"
        model, ddp, state, optimizer = _resume_model(71, layout)  # other weights: all restored
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["comm"])
        for offset, expected in enumerate(recorded):
            got = _resume_step(model, ddp, optimizer, rank, CHECKPOINT_AT + offset)
            for g, e in zip(got, expected, strict=True):
                assert torch.equal(g, e), f"{layout}: step {CHECKPOINT_AT + offset} differs after resume"


def ddp_worker(rank: int, world_size: int) -> None:
    """:func:`layouts_worker`, then :func:`resume_worker`: one process group for both (start-up costs)."""
    layouts_worker(rank, world_size)
    resume_worker(rank, world_size)
