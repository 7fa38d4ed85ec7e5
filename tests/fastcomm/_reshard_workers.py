"""Rank processes for the elastic-restart test: 2 ranks train, 3 resume from their states, 2 resume again.

:func:`elastic_worker` runs on 3 gloo ranks, and for every case of :data:`CASES` runs three groups in turn,
each with a fresh model, DDP and hook state: ranks 0-1 train from scratch; all 3 ranks load
``merge_state_dicts`` of the 2 saved states and train on; ranks 0-1 load the merge of those 3 and train
on. Each run saves its hook state, what each rank owes per
parameter (at the save, and right after a load), and the model and optimizer, for the next run and for the
test file, which compares what the old and the new ranks owe on average. One spawn serves the three runs
(process start-up is most of the cost on a loaded machine); a merge is pure data, so fresh state objects
and DDP models on fresh process groups are what a restart gives it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _hooks_workers import batch_for, make_mlp
from torch import nn

import fastcomm
from fastcomm.collectives._lane import lane_for
from fastcomm.compress import QuantCompressor, TopKCompressor
from fastcomm.hooks.momentum import CompressedAdamState

DIMS = (13, 37, 29, 5)  # parameters of 481, 37, 1073, 29, 145 and 5 elements
SMALL_BUCKETS = {"bucket_cap_mb": 0.002}  # about 500 fp32 elements per bucket: 4 buckets after the rebuild
ADAM = {"lr": 1e-2, "betas": (0.9, 0.95)}

# case -> (hook name or "cadam", options, DDP keyword arguments)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "topk": ("topk", {"ratio": 0.1, "min_compress_numel": 0}, SMALL_BUCKETS),
    "dgc": (
        "topk",
        {"ratio": 0.1, "momentum": 0.9, "clip_norm": 1.0, "warmup_steps": 2, "min_compress_numel": 0},
        SMALL_BUCKETS,
    ),
    "dgc_nesterov": ("topk", {"ratio": 0.2, "momentum": 0.8, "nesterov": True, "min_compress_numel": 0}, {}),
    "sign": ("sign", {"chunk": 64, "min_compress_numel": 0}, SMALL_BUCKETS),
    "q8": ("quantize", {"bits": 8, "block": 32, "min_compress_numel": 0}, SMALL_BUCKETS),
    "q4": (
        "quantize",
        {"bits": 4, "block": 32, "min_compress_numel": 0, "overlap_phase2": False},
        SMALL_BUCKETS,
    ),
    "cast": ("cast", {}, SMALL_BUCKETS),
    "compressor_blockwise": ("reshard_q8", {"bits": 8, "block": 32, "min_compress_numel": 0}, SMALL_BUCKETS),
    "compressor_gather": ("reshard_topk", {"k": 9, "min_compress_numel": 0}, SMALL_BUCKETS),
    # two allreduces per bucket; its warm-start Q's are a store tensor besides the residual
    "powersgd": ("powersgd", {"rank": 2, "min_compress_numel": 0}, SMALL_BUCKETS),
    # past warm-up: the sign compressor holds residuals of momentum
    "cadam": ("cadam", {"warmup_steps": 2, "chunk": 64, "min_compress_numel": 0}, SMALL_BUCKETS),
    # a quantized warm-up (a default QuantState: one bucket of 1770, compressed; its residuals stay in the
    # warm-up state) and top-k momentum after it
    "cadam_warmup_q": (
        "cadam",
        {"warmup_steps": 3, "warmup_compressor": "quantize", "compressor": "topk", "ratio": 0.1},
        {},
    ),
}


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch_for(rank, step, n=6, dim=DIMS[0])
    return nn.functional.cross_entropy(model(x), y)


def _build(case: str, group: dist.ProcessGroup) -> tuple[nn.Module, nn.Module, Any, torch.optim.Optimizer]:
    name, options, ddp_options = CASES[case]
    model = make_mlp(61, DIMS)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, **ddp_options)
    if name == "cadam":
        optimizer: torch.optim.Optimizer = fastcomm.CompressedAdam(ddp.parameters(), **ADAM, **options)
        state = fastcomm.register(ddp, optimizer, process_group=group)
    else:
        state = fastcomm.register(ddp, name, process_group=group, **options)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    return model, ddp, state, optimizer


def compression_states(state: Any) -> dict[str, Any]:
    """The states holding residuals: the state itself, or CompressedAdam's compressor and warm-up one."""
    if isinstance(state, CompressedAdamState):
        parts = {"inner": state.inner}
        if state.warmup is not None:
            parts["warmup"] = state.warmup[0]
        return parts
    return {"state": state} if isinstance(state, fastcomm.hooks.CompressionState) else {}


def owed_by(state: Any, model: nn.Module) -> dict[str, list[torch.Tensor | None]]:
    """What this rank still owes per parameter, for each residual-holding part of ``state``."""
    return {
        part: [None if (owed := sub.residual_of(p)) is None else owed.clone() for p in model.parameters()]
        for part, sub in compression_states(state).items()
    }


def run_file(workdir: str, kind: str, tag: str, case: str, rank: int) -> Path:
    """``kind`` ``checkpoint`` (what a run saved) or ``loaded`` (what it restored) of a run's rank."""
    return Path(workdir) / f"{kind}_{tag}_{case}_{rank}.pt"


def _run(
    case: str, group: dist.ProcessGroup, workdir: str, tag: str, steps: int, source: tuple[str, int] | None
) -> None:
    """One run on ``group``: (merge and load ``source``'s saved states,) train ``steps`` steps, save."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    model, ddp, state, optimizer = _build(case, group)
    first_step = 0
    if source is not None:
        old_tag, old_world = source
        old = [
            torch.load(run_file(workdir, "checkpoint", old_tag, case, r), weights_only=False)
            for r in range(old_world)
        ]
        model.load_state_dict(old[0]["model"])  # replicated: every old rank's is the same
        optimizer.load_state_dict(old[0]["optimizer"])
        merged, why = type(state).merge_state_dicts([o["comm"] for o in old], world_size, rank)
        state.load_state_dict(merged)
        first_step = old[0]["next_step"]
        loaded = {"merged": merged, "why": why, "owed": owed_by(state, model)}
        torch.save(loaded, run_file(workdir, "loaded", tag, case, rank))
    compressed_before = _compressed_buckets(state)
    for step in range(first_step, first_step + steps):
        optimizer.zero_grad()
        _loss(ddp, rank, step).backward()
        optimizer.step()
    assert _compressed_buckets(state) > compressed_before or case == "cast", f"{case}: nothing compressed"
    for p in model.parameters():
        assert torch.isfinite(p).all(), f"{case}: non-finite weights"
        gathered = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(gathered, p.detach().contiguous(), group=group)
        assert all(torch.equal(g, gathered[0]) for g in gathered), (
            f"{case} {tag}: weights differ across ranks"
        )
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "comm": state.state_dict(),
        "owed": owed_by(state, model),
        "next_step": first_step + steps,
    }
    torch.save(checkpoint, run_file(workdir, "checkpoint", tag, case, rank))


def elastic_worker(rank: int, world_size: int, workdir: str) -> None:
    """On 3 ranks, every case: ranks 0-1 train 4 steps; ranks 0-2 resume (2 steps); ranks 0-1 resume (2)."""
    assert world_size == 3
    fastcomm.hooks.add_compressor("reshard_q8", QuantCompressor)
    fastcomm.hooks.add_compressor("reshard_topk", TopKCompressor)
    # A phase-2 lane is a group made by new_group(use_local_synchronization=True) on its ranks alone. In
    # torch 2.13 (gloo) that hangs or times out when its ranks made different numbers of groups they are
    # not in: the 3-rank lane after the pair group (rank 2 is outside it), or the pair's after a group of
    # ranks 1-2. So the 3-rank lane is made first, and one pair group serves both 2-rank runs.
    lane_for(dist.group.WORLD)
    pair = dist.new_group([0, 1])
    for case in CASES:
        if rank in (0, 1):
            _run(case, pair, workdir, "w2", 4, None)
        dist.barrier()
        _run(case, dist.group.WORLD, workdir, "w3", 2, ("w2", 2))
        dist.barrier()
        if rank in (0, 1):
            _run(case, pair, workdir, "w2b", 2, ("w3", 3))
        dist.barrier()


def _compressed_buckets(state: Any) -> int:
    return int(state.stats()["compressed_buckets"])
