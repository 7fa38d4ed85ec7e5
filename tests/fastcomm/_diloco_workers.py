"""Rank processes for tests/fastcomm/test_diloco.py: DiLoCo against a plain simulation, resume, a dead peer.

Simulation: the inner optimizer is plain SGD on gradients seeded by (case, step, rank), so every rank can
compute every rank's local weights; the outer loop (pseudo-gradients, their mean through the compressor's
own arithmetic with per-rank residuals, outer Nesterov momentum, fragments on a staggered schedule, an
exchange applied ``delay`` steps late keeping the local steps taken meanwhile) is re-done here in plain
arithmetic on flat tensors. Each case's outcome goes to ``results_<rank>.json``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
import traceback
import zlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _collectives_workers import COMPRESSORS, Mismatches, SimulatedAllReduce
from torch import nn

import fastcomm
from fastcomm.diloco.fragments import split_parameters

SHAPES = ((7, 13), (29,), (5, 3, 3), (101,), (3, 11))
INNER_LR = 0.05
STEPS = 20


def _seeded(case: object, *key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr((case, *key)).encode()))


class Params(nn.Module):
    """Parameters of odd shapes, the same on every rank (seeded by the case)."""

    def __init__(self, case: object) -> None:
        super().__init__()
        gen = _seeded(case, "init")
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES)


def gradient(case: object, step: int, rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=_seeded(case, step, rank)) * (1 + rank)


def _simulate(
    case: object, world: int, numel: int, bounds: list[tuple[int, int]], offsets: list[int], *,
    sync_every: int, delay: int, lr: float | Callable[[int], float], momentum: float, compressor: str,
    mixing: float | None, residual_dtype: torch.dtype | None = None, eager: bool = False,
) -> list[torch.Tensor]:  # fmt: skip
    """Every rank's flat weights after ``STEPS`` steps of the simulated run (residuals rounded to
    ``residual_dtype`` after each exchange, as DiLoCo keeps them; ``eager``: at the issue each rank takes
    the outer step with its own pseudo-gradient, the momentum left as it is, and trains on from there)."""
    start = torch.cat([p.detach().reshape(-1) for p in Params(case).parameters()])
    local = [start.clone() for _ in range(world)]
    global_ = start.clone()
    moment = torch.zeros(numel)
    make = COMPRESSORS.get(compressor)
    sims = [None if make is None else SimulatedAllReduce(make(), b - a, world, True) for a, b in bounds]
    pending: list[tuple[int, int, torch.Tensor, list[torch.Tensor]]] = []  # due, fragment, mean, sent

    def apply(fragment: int, mean: torch.Tensor, sent: list[torch.Tensor] | None, step: int) -> None:
        a, b = bounds[fragment]
        moment[a:b].mul_(momentum).add_(mean)
        global_[a:b].add_(mean.add(moment[a:b], alpha=momentum), alpha=-(lr(step) if callable(lr) else lr))
        for r in range(world):
            if sent is None:
                local[r][a:b] = global_[a:b]
            elif mixing is None:
                local[r][a:b] = global_[a:b] + (local[r][a:b] - sent[r])
            else:  # alpha * local + (1 - alpha) * global
                local[r][a:b] = torch.lerp(global_[a:b], local[r][a:b], mixing)

    for step in range(1, STEPS + 1):
        for r in range(world):
            local[r].add_(gradient(case, step, r, numel), alpha=-INNER_LR)
        for item in [p for p in pending if p[0] <= step]:
            pending.remove(item)
            apply(item[1], item[2], item[3], step)
        for fragment, (a, b) in enumerate(bounds):
            if step % sync_every != offsets[fragment]:
                continue
            deltas = [global_[a:b] - local[r][a:b] for r in range(world)]
            sim = sims[fragment]
            mean = sum(deltas[1:], deltas[0].clone()) / world if sim is None else sim.step(deltas).clone()
            if sim is not None and residual_dtype is not None:
                for kept in (sim.worker, sim.server):
                    kept[:] = [t.to(residual_dtype).float() for t in kept]
            if delay == 0:
                apply(fragment, mean, None, step)
                continue
            if eager:
                rate = lr(step) if callable(lr) else lr
                for r in range(world):
                    kept = moment[a:b].mul(momentum).add_(deltas[r])
                    local[r][a:b] = global_[a:b].add(deltas[r].add(kept, alpha=momentum), alpha=-rate)
            pending.append((step + delay, fragment, mean, [local[r][a:b].clone() for r in range(world)]))
    return local


def _ramp(step: int) -> float:
    """An outer lr that differs at every sync of the simulated run (independent of outer_lr_ramp)."""
    return 0.3 + 0.05 * step


def _simulation_case(
    rank: int, world: int, compressor: str, fragments: int, delay: int | None, mixing: float | None = None,
    schedule: bool = False, residual_dtype: torch.dtype | None = None, eager: bool = False,
) -> None:
    case = ("diloco", world, compressor, fragments, delay, mixing, schedule, *(("eager",) if eager else ()))
    sync_every, lr, momentum = 6, _ramp if schedule else 0.7, 0.5
    model = Params(case)
    params = list(model.parameters())
    inner = torch.optim.SGD(params, lr=INNER_LR, foreach=False)
    outer = fastcomm.DiLoCo(
        model, inner, sync_every=sync_every, outer_lr=lr, outer_momentum=momentum, fragments=fragments,
        delay=delay, mixing=mixing, compressor=None if compressor == "fp32" else COMPRESSORS[compressor](),
        residual_dtype=residual_dtype, eager=eager,
    )  # fmt: skip
    numel = sum(p.numel() for p in params)
    for step in range(1, STEPS + 1):
        grad = gradient(case, step, rank, numel)
        start = 0
        for p in params:
            p.grad = grad[start : start + p.numel()].view_as(p).clone()
            start += p.numel()
        outer.step()
    sizes = [sum(p.numel() for p in group) for group in split_parameters(params, fragments)]
    bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(fragments)]
    period = sync_every // fragments
    expected = _simulate(
        case, world, numel, bounds, [(i + 1) * period % sync_every for i in range(fragments)],
        sync_every=sync_every, delay=outer.delay, lr=lr, momentum=momentum, compressor=compressor,
        mixing=mixing, residual_dtype=residual_dtype, eager=eager,
    )[rank]  # fmt: skip
    got = torch.cat([p.detach().reshape(-1) for p in params])
    checks = Mismatches()
    if compressor == "fp32" and world > 2:  # gloo's ring need not add in rank order
        checks.close(got, expected, "weights")
    else:
        checks.equal(got, expected, "weights")
    if outer.syncs < STEPS // sync_every * fragments - 1:
        checks.found.append(f"the schedule did not run as planned: {outer.syncs} syncs")
    if residual_dtype is not None:
        _check_kept_narrow(outer, residual_dtype, checks)
    checks.raise_any()


def _check_kept_narrow(outer: fastcomm.DiLoCo, residual_dtype: torch.dtype, checks: Mismatches) -> None:
    """After the last exchange: every fragment's residual held in ``residual_dtype`` only (half the bytes of
    fp32 for bf16), and saved so."""
    outer.finish()
    for fragment in outer.fragments:
        saved = fragment.residual.state_dict()
        held = [saved[name] for name in ("worker", "server") if saved[name] is not None]
        wide = sum(t.numel() * 4 for t in held)
        if not held or any(t.dtype != residual_dtype for t in held):
            checks.found.append(f"fragment {fragment.index} saves {[t.dtype for t in held]}")
        if fragment.residual.nbytes() * 4 != wide * residual_dtype.itemsize:
            checks.found.append(f"fragment {fragment.index} holds {fragment.residual.nbytes()} bytes of "
                                f"residual, {wide} in fp32")


def cases(world: int) -> dict[str, Callable[[int], None]]:
    """Case id -> the check each rank runs."""
    table: dict[str, Callable[[int], None]] = {}
    for compressor in ("fp32", "q4"):
        for fragments, delay, mixing, schedule in ((1, None, None, False), (1, 2, None, False),
                                                   (3, None, None, False), (3, 0, None, False),
                                                   (3, None, 0.5, False), (1, None, None, True),
                                                   (3, None, None, True)):  # fmt: skip
            key = f"{compressor}-F{fragments}-delay{delay}" + ("" if mixing is None else f"-mixing{mixing}")
            key += "-lr-schedule" if schedule else ""
            table[key] = lambda r, a=(compressor, fragments, delay, mixing, schedule): _simulation_case(
                r, world, *a)
        # eager updates: each rank's own outer step at the issue, the exact one kept under it when it lands
        for fragments, delay in ((1, 2), (3, None)):  # one fragment; streaming, each overlapped a period
            table[f"{compressor}-F{fragments}-delay{delay}-eager"] = functools.partial(
                _simulation_case, world=world, compressor=compressor, fragments=fragments, delay=delay,
                eager=True,
            )
    for fragments in (1, 3):  # one exchange at a time, and overlapped ones (kept narrow between them)
        table[f"q4-F{fragments}-residual-bf16"] = lambda r, f=fragments: _simulation_case(
            r, world, "q4", f, None, residual_dtype=torch.bfloat16)
    return table


def run_all(rank: int, world: int, workdir: str) -> None:
    """Every case in order on every rank; outcomes to ``results_<rank>.json`` (a failed case goes on)."""
    run_table(cases(world), rank, workdir)


def run_table(table: dict[str, Callable[[int], None]], rank: int, workdir: str) -> None:
    """Each ``table`` check in order on this rank, the ranks meeting after each; its outcome ("ok" or
    the traceback) to ``results_<rank>.json``, by check id (a failed check does not stop the others)."""
    outcomes = {}
    for key, check in table.items():
        try:
            check(rank)
            outcomes[key] = "ok"
        except Exception:  # noqa: BLE001 - recorded per case; the test reports it
            outcomes[key] = traceback.format_exc()
        dist.barrier()
    Path(workdir, f"results_{rank}.json").write_text(json.dumps(outcomes))


# ------------------------------------------------------------------------------------------------ resume
RESUME_STEPS, SAVE_AT = 17, 8


def _mlp() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def _training(rank: int, config: dict, directory: Path) -> tuple[nn.Module, fastcomm.DiLoCo, object]:
    model = _mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-2)
    outer = fastcomm.DiLoCo(model, inner, sync_every=6, outer_lr=0.7, outer_momentum=0.9, **config)
    ckpt = fastcomm.Checkpointer(directory, keep=1, model=model, inner=inner, outer=outer)
    return model, outer, ckpt


def _train_steps(
    rank: int, model: nn.Module, outer: fastcomm.DiLoCo, ckpt: object, first: int, save: bool
) -> None:
    for step in range(first, RESUME_STEPS + 1):
        gen = _seeded("resume", step, rank)
        x = torch.randn(9, 13, generator=gen)
        noise = torch.randn(9, 3) * 0.01  # the global RNG: restored by the checkpoint
        loss = ((model(x) - x[:, :3].sin() - noise) ** 2).mean()
        outer.zero_grad()
        loss.backward()
        outer.step()
        if save and step == SAVE_AT:
            ckpt.save(step)  # type: ignore[attr-defined]


RESUME_CONFIGS = {
    "q4-streaming": {"compressor": "quantize", "bits": 4, "block": 16, "fragments": 2},
    "q4-delayed": {"compressor": "quantize", "bits": 4, "block": 16, "delay": 3},  # one fragment, overlapped
    "q4-eager": {"compressor": "quantize", "bits": 4, "block": 16, "delay": 3, "eager": True},
    "fp32": {"compressor": None},
}


def resume_worker(rank: int, world: int, workdir: str, phase: str) -> None:
    """``phase`` "whole": train every step, saving at SAVE_AT, and write the final weights; "resumed": restore
    in fresh processes, train on, and write the final weights too."""
    for name, config in RESUME_CONFIGS.items():
        torch.manual_seed(100 + rank)
        model, outer, ckpt = _training(rank, config, Path(workdir) / name)
        first = 1
        if phase == "resumed":
            first = ckpt.restore() + 1  # type: ignore[attr-defined]
            assert first == SAVE_AT + 1, first
            overlapped = config.get("fragments", 1) > 1 or config.get("delay", 0) > 0
            assert outer.in_flight or not overlapped, "the checkpoint held no exchange in flight"
        _train_steps(rank, model, outer, ckpt, first, save=phase == "whole")
        final = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save({"model": final, "outer": outer.state_dict()},
                   Path(workdir) / f"{name}-{phase}-{rank}.pt")  # fmt: skip


# ------------------------------------------------------------------------------------------------ a dead peer
FAULT_SYNC_STEP = 6


FAULT_OPTIONS = {
    "fp32": {"compressor": None},
    "q4": {"compressor": "quantize", "bits": 4},
    "q4-eager": {"compressor": "quantize", "bits": 4, "delay": 2, "eager": True},  # in flight at the death
}


def fault_step(compressor: str) -> int:
    """The step at whose start rank 1 dies: before the first sync, or (eager) with it in flight."""
    return FAULT_SYNC_STEP + (1 if FAULT_OPTIONS[compressor].get("delay") else 0)


def fault_worker(rank: int, world: int, workdir: str, compressor: str, timeout_s: float) -> None:
    """Rank 1 dies (SIGKILL) at :func:`fault_step`; rank 0 reports what its DiLoCo step raised."""
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s))
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    options = FAULT_OPTIONS[compressor]
    outer = fastcomm.DiLoCo(model, inner, sync_every=FAULT_SYNC_STEP, process_group=group, **options)
    report = {"step": None, "type": None, "message": "", "seconds": 0.0}
    for step in range(1, 3 * FAULT_SYNC_STEP + 1):
        loss = model(torch.randn(4, 13, generator=_seeded("fault", step, rank))).square().mean()
        outer.zero_grad()
        loss.backward()
        if rank == 1 and step == fault_step(compressor):
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            outer.step()
        except Exception as error:  # noqa: BLE001 - the survivor reports what it got
            report = {"step": step, "type": type(error).__name__, "message": str(error),
                      "seconds": time.monotonic() - started}  # fmt: skip
            break
    if rank == 0:
        Path(workdir, "survivor.json").write_text(json.dumps(report))
        os._exit(0)  # a group with a dead peer cannot be destroyed cleanly
