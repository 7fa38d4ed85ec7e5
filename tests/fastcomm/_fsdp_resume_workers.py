"""Rank processes for tests/fastcomm/test_fsdp_resume.py: checkpoints and a failing peer under fastcomm.fsdp.

Resume: 2 ranks train a nested FSDP2 MLP with 8-bit stochastic rounding and error feedback (Adam), save at
step ``SAVE_AT`` (model and optimizer through ``torch.distributed.checkpoint``, the compression state per
rank with ``torch.save``), train on to ``STEPS`` and write every parameter's full tensor; fresh processes
restore the checkpoint, train the same steps, and compare bit for bit. Restored on 3 ranks, the residuals
are re-sharded (every parameter owes the mean over the old ranks of what each owed) and training goes on.

Fault: rank 1 ends itself (``SIGKILL``) or stops (``SIGSTOP``, past the group's timeout) between forward
and backward of step ``FAULT_STEP``; the survivor's backward, in the compressed reduce-scatter, must raise
:class:`~fastcomm.PeerCollectiveError` within the timeout. It writes what it saw to ``survivor.json``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import _fsdp_workers as fsdp
import _hooks_workers as workers
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fastcomm.fsdp
from fastcomm.collectives import Residual
from fastcomm.fsdp.reshard import FSDPReshardError, GroupLayout

STEPS, SAVE_AT = 6, 3
FAULT_STEP, MAX_STEPS = 2, 30


def _setup(mesh: DeviceMesh, nested: bool = True) -> tuple:
    model = fsdp.build(mesh, nested=nested, reshard=nested)
    compression = fastcomm.fsdp.compress(model, "quantize", bits=8, stochastic=True, seed=11)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer, compression


def _step(model, optimizer, step: int, rank: int) -> None:
    model(fsdp.batch("resume", step, rank)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().full_tensor().clone() for name, p in model.named_parameters()}


def train_and_save(rank: int, world: int, workdir: str) -> None:
    """Train ``STEPS`` steps, saving at ``SAVE_AT``; write the final parameters (rank 0)."""
    model, optimizer, compression = _setup(init_device_mesh("cpu", (world,)))
    for step in range(STEPS):
        if step == SAVE_AT:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{workdir}/checkpoint")
            torch.save(compression.state_dict(), f"{workdir}/checkpoint/fastcomm_fsdp_rank{rank}.pt")
        _step(model, optimizer, step, rank)
    final = _full(model)
    if rank == 0:
        torch.save(final, f"{workdir}/uninterrupted.pt")


def restore_and_compare(rank: int, world: int, workdir: str) -> None:
    """Restore at ``SAVE_AT`` in fresh processes, train to ``STEPS``, compare with the uninterrupted run."""
    model, optimizer, compression = _setup(init_device_mesh("cpu", (world,)))
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=f"{workdir}/checkpoint")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    compression.load_state_dict(torch.load(f"{workdir}/checkpoint/fastcomm_fsdp_rank{rank}.pt"))
    restored_steps = compression.stats()["steps"]
    for step in range(SAVE_AT, STEPS):
        _step(model, optimizer, step, rank)
    resumed = _full(model)
    expected = torch.load(f"{workdir}/uninterrupted.pt")
    assert restored_steps == SAVE_AT, f"the restored state counts {restored_steps} steps, not {SAVE_AT}"
    differ = [name for name, tensor in resumed.items() if not torch.equal(tensor, expected[name])]
    assert not differ, f"rank {rank}: resumed parameters differ from the uninterrupted run's: {differ}"


def train_with_fault(rank: int, world: int, workdir: str, fault: str, timeout_s: float) -> None:
    """Train until something raises; rank 1 faults before backward of ``FAULT_STEP``; rank 0 reports."""
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s))
    # the root alone, kept unsharded from forward to backward: the first collective of backward is the
    # compressed reduce-scatter, not FSDP's own all-gather
    model, optimizer, _ = _setup(DeviceMesh.from_group(group, "cpu"), nested=False)
    report = {"step": MAX_STEPS, "phase": "finished", "type": None, "message": "", "seconds": 0.0}
    for step in range(MAX_STEPS):
        phase, started = "forward", time.monotonic()
        try:
            loss = model(fsdp.batch("fault", step, rank)).square().mean()
            if rank == 1 and step == FAULT_STEP:
                workers.signal_self(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            phase = "backward"
            loss.backward()
            phase = "optimizer step"
            optimizer.step()
            optimizer.zero_grad()
        except Exception as error:  # noqa: BLE001 - the survivor reports what it got
            report = {
                "step": step,
                "phase": phase,
                "type": type(error).__name__,
                "message": str(error),
                "seconds": time.monotonic() - started,
            }
            break
    if rank == 0:
        Path(workdir, "survivor.json").write_text(json.dumps(report))
        os._exit(0)  # a group with a dead peer cannot be destroyed cleanly: leave at once


def run_with_fault(workdir: Path, fault: str, timeout_s: float, limit_s: float) -> dict:
    """Run :func:`train_with_fault` on 2 ranks; the survivor's report, both ranks ended by ``limit_s``.

    Raises:
        AssertionError: the survivor did not report within ``limit_s`` (a hang), or a rank failed before
            the fault (its traceback is in the message).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    # forked by a forkserver that imported torch, FSDP and this module once: a rank starts in milliseconds
    ctx = workers.mp.get_context("forkserver")
    ctx.set_forkserver_preload(fsdp.PRELOAD)  # no effect once the server runs
    args = (str(workdir), fault, timeout_s)
    procs = [
        ctx.Process(target=workers._entry, args=(rank, 2, str(workdir), train_with_fault, args), daemon=True)
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + limit_s
    try:
        while procs[0].is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()  # SIGKILL ends a SIGSTOPped process too
            proc.join(5)
    errors = [path.read_text() for path in sorted(workdir.glob("error_*.txt"))]
    if errors:
        raise AssertionError("a rank failed before the fault:\n" + "\n".join(errors))
    report_file = workdir / "survivor.json"
    if not report_file.exists():
        raise AssertionError(f"the survivor neither raised nor finished within {limit_s} s (hang)")
    return json.loads(report_file.read_text())


def _owed_by_parameter(reduction_state: dict) -> list[torch.Tensor]:
    """What one rank's saved reduction owes, cut into its parameters (fp32)."""
    layout = GroupLayout.from_state_dict(reduction_state["layout"])
    residual = Residual()
    residual.load_state_dict(reduction_state["feedback"])
    return layout.split(residual.owed())


def restore_at_another_world_size(rank: int, world: int, workdir: str) -> None:
    """Restore the ``SAVE_AT`` checkpoint of 2 ranks on ``world`` ranks: the residuals re-sharded.

    1. Loading an old rank's state as it is raises FSDPReshardError (it names merge_state_dicts).
    2. The merged state's layout is the new group's (FSDP's own parameter order and world size), and every
       parameter owes the mean over the 2 old ranks of what each owed (so does the mean over new ranks).
    3. Training goes on at ``world`` ranks from the restored step, through the re-sharded residuals.
    """
    model, optimizer, compression = _setup(init_device_mesh("cpu", (world,)))
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=f"{workdir}/checkpoint")  # DCP re-shards the model and optimizer
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    old = [torch.load(f"{workdir}/checkpoint/fastcomm_fsdp_rank{r}.pt") for r in range(2)]
    try:
        compression.load_state_dict(old[rank % 2])
    except FSDPReshardError as error:
        assert "merge_state_dicts" in str(error), error
    else:
        raise AssertionError("a state saved by 2 ranks loaded as it is on 3")
    merged, why = fastcomm.fsdp.FSDPCompression.merge_state_dicts(old, world, rank)
    assert "mean over the old ranks" in why, why
    compression.load_state_dict(merged)
    for name, reduction in compression.reductions.items():
        assert reduction.layout is not None and reduction.layout.world_size == world, reduction.layout
        assert merged["reductions"][name]["layout"] == reduction.layout.state_dict(), name
        olds = [_owed_by_parameter(state["reductions"][name]) for state in old]
        assert any(bool(t.any()) for t in olds[0]), f"{name}: nothing was owed at the checkpoint"
        mine = _owed_by_parameter(reduction.state_dict())
        for index, (got, *before) in enumerate(zip(mine, *olds, strict=True)):
            expected = (before[0] + before[1]) / 2
            assert torch.allclose(got, expected, rtol=0, atol=1e-7), f"{name} parameter {index}"
            mean = got.clone()
            dist.all_reduce(mean)
            assert torch.allclose(mean / world, expected, rtol=0, atol=1e-6), f"{name} parameter {index}"
    for step in range(SAVE_AT, STEPS):
        _step(model, optimizer, step, rank)
    assert compression.stats()["steps"] == STEPS, compression.stats()
