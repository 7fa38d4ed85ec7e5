"""Rank processes for the fault tests (2 gloo ranks train a DDP model until rank 1 dies or stops) and one
option test (sign_hook with a chunk that is not a multiple of 8).

Rank 1 sends itself ``SIGKILL`` (a dead peer) or ``SIGSTOP`` (a peer stopped past the process group's
timeout) at the start of step ``FAULT_STEP``, or in that step just before its first phase-2 all-gather.
The survivor, rank 0, trains on until something raises and writes what it saw to ``survivor.json``: the
step and the phase (forward, backward, optimizer step) that raised, the exception's type and message, the
seconds from the start of that step to the exception, and the warnings it was given meanwhile. Both ranks
start each step together (every step's collectives need both), so a hook that surfaces the failure raises
in step ``FAULT_STEP`` itself; a hook that hides it trains on to ``MAX_STEPS``.

The ranks reuse the hook tests' process entry (:func:`_hooks_workers._entry`); the parent side here is its
own because one rank is meant to die and the survivor to fail.
"""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import _hooks_workers as workers
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastcomm
from fastcomm.collectives import two_phase as _twophase
from fastcomm.hooks.registry import build_state

# Ranks are forked by a forkserver that imported torch, fastcomm and what DDP's constructor imports
# (torch._dynamo: 5-10 s) once: a rank then starts in milliseconds, where a spawned one imports for seconds.
# The server is a fresh single-threaded process, so no thread of the test process is forked with it.
PRELOAD = [*workers.PRELOAD, "_fault_workers"]  # the harness's own, and these workers
FAULT_STEP = 4
MAX_STEPS = 60
# case -> (fastcomm.register name, options): small buckets compress too, so the compressed path is what
# fails; "-inline" finishes two-phase buckets from the next hook call, "-warmup" is the hooks' dense path
HOOK_CASES = {
    "topk": ("topk", {"ratio": 0.1, "min_compress_numel": 0}),
    "topk-warmup": ("topk", {"ratio": 0.1, "min_compress_numel": 0, "start_iter": MAX_STEPS}),
    "quantize": ("quantize", {"bits": 8, "min_compress_numel": 0}),
    "quantize-inline": ("quantize", {"bits": 8, "min_compress_numel": 0, "overlap_phase2": False}),
    "sign": ("sign", {"min_compress_numel": 0}),
    "cast": ("cast", {}),
    # 2 nodes x 2 ranks (hierarchical needs the default group, so the default timeout): rank 1 dies inside
    # node 0, where rank 0 waits on its point-to-point shard
    "sign-hier": ("sign", {"min_compress_numel": 0, "node_size": 2}),
    "quantize-hier": ("quantize", {"bits": 8, "min_compress_numel": 0, "node_size": 2}),
}
HIERARCHICAL = frozenset(case for case, (_, options) in HOOK_CASES.items() if options.get("node_size"))
# case -> CompressedAdam options: dense warm-up through the fault step, or compressed (sign) momentum by then
ADAM_CASES = {
    "adam-warmup": {"warmup_steps": MAX_STEPS},
    "adam": {"warmup_steps": 2, "min_compress_numel": 0},
}
FAULTS = ("kill", "kill-first", "stop", "stop-before-phase2")


def _stop_before_phase2(workdir: str, step: list[int]) -> None:
    """Make this rank stop itself just before it issues its first phase-2 all-gather (two-phase hooks),
    writing the step it stops in (``step[0]`` then) to ``peer_stopped.json`` first, for the report.

    The thread that would issue it never does, whenever the stop lands (:func:`_hooks_workers.signal_self`).
    """

    def stop_instead_of_issuing(*args: object, **kwargs: object) -> object:
        Path(workdir, "peer_stopped.json").write_text(json.dumps({"step": step[0]}))
        workers.signal_self(signal.SIGSTOP)

    _twophase.all_gather_flat = stop_instead_of_issuing


def _train(rank: int, world_size: int, workdir: str, hook: str, fault: str, timeout_s: float) -> None:
    # the short timeout on a group of its own: init (ranks starting on a busy machine) keeps the long one
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    model = workers.make_mlp(0)
    # several buckets, so the two-phase hooks pipeline phase 2 across them as in a real model
    hierarchical = hook in HIERARCHICAL
    ddp = nn.parallel.DistributedDataParallel(
        model, process_group=None if hierarchical else group, bucket_cap_mb=0.004
    )
    optimizer: torch.optim.Optimizer
    if hook in ADAM_CASES:
        optimizer = fastcomm.CompressedAdam(ddp.parameters(), lr=1e-3, **ADAM_CASES[hook])
        fastcomm.register(ddp, optimizer, process_group=group)
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        if hook != "dense":
            name, options = HOOK_CASES[hook]
            if fault == "kill-first" and hierarchical:  # torch's own registration: the node groups are made
                ddp.register_comm_hook(*build_state(name, options))  # at the first compressed bucket
            else:
                fastcomm.register(ddp, name, **options, **({} if hierarchical else {"process_group": group}))
    with warnings.catch_warnings(record=True) as seen:  # what the survivor was warned of, for the report
        warnings.simplefilter("always")
        report = _steps_until_a_failure(ddp, optimizer, rank, workdir, fault)
    report["warnings"] = [f"{w.category.__name__}: {w.message}" for w in seen]
    if rank == 0:
        Path(workdir, "survivor.json").write_text(json.dumps(report))
        # a group with a dead peer cannot be destroyed cleanly (gloo may abort or wait): leave at once
        os._exit(0)


def _steps_until_a_failure(ddp: nn.Module, optimizer: torch.optim.Optimizer, rank: int, workdir: str,
                           fault: str) -> dict:  # fmt: skip
    """Train until a step raises (rank 1 faulting itself on the way); the report of what raised, or of
    ``MAX_STEPS`` steps finished."""
    current = [0]  # the step the loop is in, for _stop_before_phase2's report
    for step in range(MAX_STEPS):
        current[0] = step
        if rank == 1 and step == (0 if fault == "kill-first" else FAULT_STEP):
            if fault == "stop-before-phase2":
                _stop_before_phase2(workdir, current)
            else:
                workers.signal_self(signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        started = time.monotonic()
        phase = "forward"
        try:
            loss = workers.loss_of(ddp, rank, step)
            phase = "backward"
            loss.backward()
            phase = "optimizer step"
            optimizer.step()
            optimizer.zero_grad()
        except Exception as error:  # noqa: BLE001 - the survivor reports what it got
            return {
                "step": step,
                "phase": phase,
                "type": type(error).__name__,
                "message": str(error),
                "seconds": time.monotonic() - started,
            }
    return {"step": MAX_STEPS, "phase": "finished", "type": None, "message": "", "seconds": 0.0}


def _fault_entry(rank: int, world_size: int, workdir: str, args: tuple) -> None:
    workers._entry(rank, world_size, workdir, _train, (workdir, *args))


_GET_CONTEXT = mp.get_context


def _context() -> mp.context.BaseContext:
    context = _GET_CONTEXT("forkserver")
    context.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    return context


def spawn_preloaded(workdir: Path, world_size: int, worker: Callable, *args: object) -> None:
    """:func:`_hooks_workers.spawn` (bounded, a failing rank's traceback raised) with preloaded ranks."""
    workers.mp.get_context = lambda method=None: _context()
    try:
        workers.spawn(workdir, world_size, worker, *args, timeout_s=60)
    finally:
        workers.mp.get_context = _GET_CONTEXT


def run_with_fault(workdir: Path, hook: str, fault: str, timeout_s: float, limit_s: float) -> dict:
    """Train ``hook`` (``"dense"``, a :data:`HOOK_CASES` or :data:`ADAM_CASES` key) on 2 ranks (4 as 2 nodes
    for the :data:`HIERARCHICAL` cases), fault rank 1.

    ``fault``: ``"kill"`` (``SIGKILL`` at the start of step ``FAULT_STEP``), ``"stop"`` (``SIGSTOP`` there),
    ``"stop-before-phase2"`` (``SIGSTOP`` in that step, just before rank 1's first phase-2 all-gather: the
    survivor's phase 2 waits on the second process group of the two-phase hooks).

    Bounded: both ranks are killed (a stopped one too) once the survivor has reported or after
    ``limit_s`` seconds, whichever comes first.

    Raises:
        AssertionError: the survivor did not report within ``limit_s`` (a hang), or a rank failed
            before the fault (its traceback is in the message).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = _context()
    world_size = 4 if hook in HIERARCHICAL else 2
    procs = [
        ctx.Process(
            target=_fault_entry, args=(rank, world_size, str(workdir), (hook, fault, timeout_s)), daemon=True
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    report_file = workdir / "survivor.json"
    deadline = time.monotonic() + limit_s
    try:
        while procs[0].is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        procs[0].join(max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()  # SIGKILL ends a SIGSTOPped process too
            proc.join(5)
    errors = [path.read_text() for path in sorted(workdir.glob("error_*.txt"))]
    if errors:
        raise AssertionError("a rank failed before the fault:\n" + "\n".join(errors))
    if not report_file.exists():
        raise AssertionError(f"the survivor neither raised nor finished within {limit_s} s (hang)")
    report = json.loads(report_file.read_text())
    stopped = workdir / "peer_stopped.json"  # "stop-before-phase2": where rank 1 really stopped
    if stopped.exists():
        report["peer_stopped_step"] = json.loads(stopped.read_text())["step"]
    return report


# ------------------------------------------------------------------------------------------ options
def odd_chunk_worker(rank: int, world_size: int) -> None:
    """sign_hook with chunk=3 (one piece, and many small pieces) equals the test's reference simulation."""
    sizes = [(7,), (300,), (2000, 1000)]
    for wire in ({}, {"wire_chunk_bytes": 40}):
        state = fastcomm.SignState(chunk=3, min_compress_numel=0, **wire)
        params = workers.make_buckets(sizes, torch.float32)
        sims = [{"res": [torch.zeros(sum(s)) for _ in range(world_size)], "server": None} for s in sizes]
        for step in range(3):
            grads = [
                [workers.grad_for(r, b, step, sum(s), torch.float32) for r in range(world_size)]
                for b, s in enumerate(sizes)
            ]
            buckets = [workers.FakeBucket(b, params[b], grads[b][rank].clone()) for b in range(len(sizes))]
            outputs = workers.run_hook(fastcomm.sign_hook, state, buckets)
            for b, out in enumerate(outputs):
                numel = grads[b][0].numel()
                segment, compress, decompress = workers.sign_codec(numel, world_size, 3)
                if sims[b]["server"] is None:
                    sims[b]["server"] = [torch.zeros(segment) for _ in range(world_size)]
                expected = workers.ref_two_phase(
                    grads[b], sims[b]["res"], sims[b]["server"], segment, compress, decompress
                )
                what = f"chunk=3 {wire} bucket {sizes[b]} step {step}"
                assert torch.equal(out, expected), f"{what}: max diff {(out - expected).abs().max()}"
