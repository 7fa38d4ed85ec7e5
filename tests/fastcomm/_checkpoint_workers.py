"""Worker bodies for tests/fastcomm/test_checkpoint.py (spawned gloo ranks; see _hooks_workers.spawn)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import fastcomm


class Position:
    """A replicated stateful object (like a loader's position): the same on every rank."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _objects(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Position]:
    torch.manual_seed(0)  # the same model on every rank, as DDP makes it
    model = torch.nn.Sequential(torch.nn.Linear(11, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, Position()


def _draws() -> tuple[torch.Tensor, float, float]:
    return torch.rand(4), random.random(), float(np.random.rand())


def save_worker(rank: int, world: int, directory: str) -> None:
    model, optimizer, position = _objects(rank)
    torch.manual_seed(100 + rank)  # per-rank streams (dropout, augmentation)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    ckpt = fastcomm.Checkpointer(
        directory, every=2, keep=2, model=model, optimizer=optimizer, position=position
    )
    assert ckpt.restore() == 0
    for step in range(1, 5):
        # Per-rank gradients: the optimizers' momentum differs across ranks (as CompressedAdam's does);
        # the weights are then made equal again (as DDP keeps them).
        model(torch.randn(3, 11)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p, 0)
        position.value = step * 10
        ckpt.maybe_save(step)
    expected = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "draws": _draws(),
    }
    torch.save(expected, Path(directory).parent / f"expected_rank{rank}.pt")


def restore_same_world_worker(rank: int, world: int, directory: str) -> None:
    model, optimizer, position = _objects(rank)
    torch.manual_seed(9)
    ckpt = fastcomm.Checkpointer(directory, model=model, optimizer=optimizer, position=position)
    assert ckpt.restore() == 4
    expected = torch.load(Path(directory).parent / f"expected_rank{rank}.pt", weights_only=False)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected["model"][name]), name
    for pid, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, expected["optimizer"]["state"][pid][key]), (pid, key)
    assert position.value == 40
    draws = _draws()
    assert torch.equal(draws[0], expected["draws"][0]) and draws[1:] == expected["draws"][1:]


def restore_other_world_worker(rank: int, world: int, directory: str) -> None:
    assert world == 3
    model, optimizer, position = _objects(rank)
    lines: list[str] = []
    ckpt = fastcomm.Checkpointer(
        directory, model=model, optimizer=optimizer, position=position, log=lines.append
    )
    assert ckpt.restore() == 4
    old = [torch.load(Path(directory).parent / f"expected_rank{r}.pt", weights_only=False) for r in range(2)]
    for name, value in model.state_dict().items():
        assert torch.equal(value, old[0]["model"][name]), name
    state = optimizer.state_dict()["state"]
    for pid in state:
        mean = (
            old[0]["optimizer"]["state"][pid]["exp_avg"] + old[1]["optimizer"]["state"][pid]["exp_avg"]
        ) / 2
        torch.testing.assert_close(state[pid]["exp_avg"], mean, rtol=1e-6, atol=1e-8)
        assert torch.equal(state[pid]["step"], old[0]["optimizer"]["state"][pid]["step"])
    assert position.value == 40
    if rank == 0:
        (text,) = lines
        assert "saved by 2 ranks, now 3" in text and "optimizer:" in text and "mean" in text, text
        assert "position: the same on every old rank" in text and "RNG: re-seeded" in text, text
    else:
        assert lines == []
    # Every rank draws its own stream, none an old rank's continuation.
    draws = _draws()[0]
    gathered = [torch.empty(4) for _ in range(world)]
    dist.all_gather(gathered, draws)
    assert len({tuple(g.tolist()) for g in gathered}) == world
    assert all(not torch.equal(draws, o["draws"][0]) for o in old)


def restore_agrees_worker(rank: int, world: int, directory: str) -> None:
    model, optimizer, position = _objects(rank)
    lines: list[str] = []
    ckpt = fastcomm.Checkpointer(
        directory, model=model, optimizer=optimizer, position=position, log=lines.append
    )
    assert ckpt.restore() == 2  # rank 1's file of step 4 is corrupt: both ranks fall back together
    assert position.value == 20
    if rank == 0:
        assert len(lines) == 2 and "rank1.pt: SHA-256 mismatch" in lines[0], lines
