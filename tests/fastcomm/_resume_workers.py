"""Rank processes for the resume test: train, checkpoint mid-run, resume in fresh processes, compare.

The first run trains ``STEPS`` steps with every hook and writes, at step ``CHECKPOINT_AT``, the model, the
optimizer and the hook state (``state_dict()``) to disk, then records every later step's gradients and
weights. The second run starts new processes and a new process group, builds a fresh DDP model with
DDP's default bucket settings (its first iteration runs under DDP's initial one-bucket layout, the
checkpoint was taken under the rebuilt one), restores the checkpoint and must reproduce the recorded steps
bit for bit. A third run resumes as the second did, checkpoints after its first step (taken right after
a fresh DDP's one-bucket iteration) and resumes that in another fresh DDP: the later steps, bit for bit too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from _hooks_workers import loss_of, make_mlp
from torch import nn

import fastcomm

STEPS = 6
CHECKPOINT_AT = 3

# hook name and options per case; min_compress_numel=0 so every bucket is compressed
RESUME_HOOKS = {
    "topk": ("topk", {"ratio": 0.1, "min_compress_numel": 0}),
    "q8": ("quantize", {"bits": 8, "block": 64, "min_compress_numel": 0}),
    "q4": ("quantize", {"bits": 4, "block": 64, "min_compress_numel": 0}),
    "sign": ("sign", {"chunk": 256, "min_compress_numel": 0}),
    "cast": ("cast", {}),
    # dense first step and a small bucket that stays dense: a layout the store holds no tensors for
    "sign_dense_start": ("sign", {"chunk": 256, "start_iter": 1, "min_compress_numel": 2000}),
}
# DDP keyword arguments: the default bucket size (one bucket for this model in both layouts, parameters
# in another order) and a small one (the rebuilt layout has several buckets, the initial one only one)
RESUME_LAYOUTS = {"default": {}, "small_buckets": {"bucket_cap_mb": 0.004}}


def _cases() -> list[tuple[str, str]]:
    return [(hook, layout) for hook in RESUME_HOOKS for layout in RESUME_LAYOUTS]


def _build(hook: str, layout: str, seed: int) -> tuple[nn.Module, nn.Module, object, torch.optim.Optimizer]:
    model = make_mlp(seed, (16, 96, 96, 4))
    ddp = nn.parallel.DistributedDataParallel(model, **RESUME_LAYOUTS[layout])
    name, options = RESUME_HOOKS[hook]
    state = fastcomm.register(ddp, name, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    return model, ddp, state, optimizer


def _step(model: nn.Module, ddp: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> dict:
    optimizer.zero_grad()
    loss_of(ddp, rank, step).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return {"grads": grads, "weights": [p.detach().clone() for p in model.parameters()]}


def _checkpoint(model: nn.Module, state: object, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "comm": state.state_dict()}


def train_and_checkpoint_worker(rank: int, world_size: int, workdir: str) -> None:
    """Every case: ``STEPS`` steps, a checkpoint at ``CHECKPOINT_AT``, the later steps recorded."""
    for hook, layout in _cases():
        model, ddp, state, optimizer = _build(hook, layout, seed=50)
        recorded = []
        for step in range(STEPS):
            if step == CHECKPOINT_AT:
                checkpoint = _checkpoint(model, state, optimizer)
                torch.save(checkpoint, Path(workdir) / f"checkpoint_{hook}_{layout}_{rank}.pt")
            result = _step(model, ddp, optimizer, rank, step)
            if step >= CHECKPOINT_AT:
                recorded.append(result)
        torch.save(recorded, Path(workdir) / f"recorded_{hook}_{layout}_{rank}.pt")


def _restored(
    hook: str, layout: str, checkpoint: dict
) -> tuple[nn.Module, nn.Module, object, torch.optim.Optimizer]:
    """A fresh DDP model, hook state and optimizer (other initial weights) loaded from ``checkpoint``."""
    model, ddp, state, optimizer = _build(hook, layout, seed=51)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    state.load_state_dict(checkpoint["comm"])
    return model, ddp, state, optimizer


def _compare(got: dict, expected: dict, what: str) -> list[str]:
    """A line per tensor kind of ``got`` that is not bit-identical to ``expected``."""
    failures = []
    for kind in ("grads", "weights"):
        diff = max(float((g - e).abs().max()) for g, e in zip(got[kind], expected[kind], strict=True))
        if diff != 0.0:
            failures.append(f"{what} {kind} differ by up to {diff:.3g}")
    return failures


def resume_and_compare_worker(rank: int, world_size: int, workdir: str, again: bool) -> None:
    """Every case: a fresh DDP restored from the checkpoint reproduces the recorded steps bit for bit.

    With ``again``, the restored run checkpoints after its first step and another fresh DDP restored
    from that reproduces the steps after it.
    """
    failures = []
    for hook, layout in _cases():
        checkpoint = torch.load(Path(workdir) / f"checkpoint_{hook}_{layout}_{rank}.pt")
        recorded = torch.load(Path(workdir) / f"recorded_{hook}_{layout}_{rank}.pt")
        model, ddp, state, optimizer = _restored(hook, layout, checkpoint)
        first = CHECKPOINT_AT
        if again:
            _step(model, ddp, optimizer, rank, first)
            model, ddp, state, optimizer = _restored(hook, layout, _checkpoint(model, state, optimizer))
            first += 1
        for step in range(first, STEPS):
            got = _step(model, ddp, optimizer, rank, step)
            failures += _compare(got, recorded[step - CHECKPOINT_AT], f"{hook}/{layout}: step {step}")
    assert not failures, "resume is not bit-identical:\n" + "\n".join(failures)
