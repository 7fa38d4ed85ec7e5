"""The spawn harness of the fastcomm tests, and what their rank processes share.

:func:`spawn` runs a worker on gloo ranks, bounded (a failing rank's traceback raised, a hang stopped); every
``_*_workers.py`` module here spawns through it. Beside it: the fake DDP bucket and the hook driver
(:class:`FakeBucket`, :func:`run_hook`), reproducible gradients and models (:func:`grad_for`,
:func:`make_mlp`, :func:`loss_of`), and the test-side simulations of the algorithms from the reference ops
(:func:`ref_topk`, :func:`ref_two_phase` with :func:`sign_codec` / :func:`nearest_quant_codec`).

The hook tests' workers live by concern in ``_hooks_correctness_workers.py`` (hook level against the
simulations), ``_hooks_ddp_workers.py`` (DDP integration, AMP, no_sync) and ``_hooks_training_workers.py``
(stress and convergence). Workers live in importable modules, not in the test files, because spawned
children import them by name (pytest imports test files under generated names). Every worker asserts; a
failure on any rank fails the test with that rank's traceback.

Example::

    import _hooks_correctness_workers as workers
    import _hooks_workers as harness

    harness.spawn(tmp_path, 2, workers.correctness_worker)
"""

from __future__ import annotations

import gc
import math
import os
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fastcomm import reference

COLLECTIVE_TIMEOUT_S = 60
# Ranks are forked by a forkserver that imported torch, fastcomm, its hooks (loaded on first use of a
# name they give: 0.09 s of CPU in every rank otherwise) and what DDP's constructor imports (torch._dynamo)
# once for the whole test session: a rank starts in milliseconds, where a spawned one imports for seconds.
# The server is a fresh single-threaded process, so no thread of the test process is forked.
PRELOAD = ["_hooks_workers", "fastcomm.hooks", "torch._dynamo"]


# ------------------------------------------------------------------------------------------------ harness
def _entry(rank: int, world_size: int, workdir: str, worker: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    error_file = Path(workdir) / f"error_{rank}.txt"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        worker(rank, world_size, *args)
        # free the workers' DDP models (reference cycles) while the interpreter is alive: left to
        # finalization, gloo tears down with live work objects and aborts the process now and then
        gc.collect()
        dist.barrier()
    except BaseException:
        error_file.write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(workdir: Path, world_size: int, worker: Callable, *args: object, timeout_s: float = 150) -> None:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise with the first failure.

    Bounded: if any rank fails the others are stopped after a short grace period, and all are stopped at
    ``timeout_s``, so a collective-order bug gives a failure, never a hang.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    procs = [
        ctx.Process(target=_entry, args=(rank, world_size, str(workdir), worker, args), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while any(proc.is_alive() for proc in procs):
        now = time.monotonic()
        if failed_at is None and any(proc.exitcode not in (None, 0) for proc in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + 10):
            break
        time.sleep(0.05)
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    crashed = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    errors = [
        f"--- rank {rank} ---\n{(workdir / f'error_{rank}.txt').read_text()}"
        for rank in range(world_size)
        if (workdir / f"error_{rank}.txt").exists()
    ]
    if errors:
        raise AssertionError("rank failures:\n" + "\n".join(errors))
    if hung and crashed:
        raise AssertionError(f"(rank, exit code) {crashed} died without a traceback; ranks {hung} stopped")
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout_s} s (hang)")
    bad = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited abnormally (rank, exit code): {bad}")


# ------------------------------------------------------------------------------------------------ helpers
class FakeBucket:
    """What a hook uses of ``dist.GradBucket``: index, flat buffer, parameters laid out back to back.

    Like DDP's bucket it owns its buffer (hooks may write the result into it), and :func:`run_hook` marks
    the last bucket of an iteration.
    """

    def __init__(self, index: int, params: list[torch.Tensor], buffer: torch.Tensor) -> None:
        self._index, self._params, self._buffer = index, params, buffer.clone()
        self.last = False

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self.last


def signal_self(signum: int) -> None:
    """Send ``signum`` (SIGKILL, SIGSTOP) to this process, and never return: a signal a process sends itself
    can land late under load (a SIGSTOP let a peer's collectives of that step go out), so the calling thread
    waits forever instead of going on; the test's parent SIGKILLs the process at the end."""
    os.kill(os.getpid(), signum)
    threading.Event().wait()
    raise AssertionError("unreachable")


def grad_for(rank: int, bucket: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reproducible non-zero gradient that every rank can compute for every other rank."""
    gen = torch.Generator().manual_seed(1_000_003 * rank + 1009 * bucket + step + 17)
    scale = 1.0 + bucket % 3
    return (torch.randn(numel, generator=gen) * scale).to(dtype)


def assert_same_on_all_ranks(tensor: torch.Tensor, what: str) -> None:
    world_size = dist.get_world_size()
    flat = tensor.detach().reshape(-1).float().contiguous()
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    for rank, other in enumerate(gathered):
        assert torch.equal(other, gathered[0]), f"{what}: rank {rank} differs from rank 0"


def run_hook(hook: Callable, state: object, buckets: list[FakeBucket]) -> list[torch.Tensor]:
    """Call the hook on every bucket in order (as DDP does), then wait for all results."""
    for position, bucket in enumerate(buckets):
        bucket.last = position == len(buckets) - 1
    futures = [hook(state, bucket) for bucket in buckets]
    return [future.wait() for future in futures]


def make_buckets(sizes: list[tuple[int, ...]], dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Parameters (identity only) for buckets made of parameters of the given sizes."""
    return [[torch.zeros(n, dtype=dtype) for n in param_sizes] for param_sizes in sizes]


# ------------------------------------------------------------ test-side reimplementation of the algorithms
def ref_topk(grads: list[torch.Tensor], residuals: list[torch.Tensor], ratio: float) -> torch.Tensor:
    """Mean over ranks of each rank's exact top-k of grad + residual (residuals updated)."""
    world_size, numel, dtype = len(grads), grads[0].numel(), grads[0].dtype
    k = min(numel, max(1, math.ceil(ratio * numel)))
    out = torch.zeros(numel, dtype=torch.float32)
    for rank in range(world_size):
        acc = grads[rank] + residuals[rank]
        values, indices = reference.topk_select(acc, k, exact=True)
        acc[indices.long()] = 0
        residuals[rank] = acc
        reference.sparse_accumulate(out, indices, values)
    return (out / world_size).to(dtype)


def _segment(numel: int, world_size: int, unit: int) -> int:
    return math.ceil(max(1, math.ceil(numel / world_size)) / unit) * unit


def ref_two_phase(
    grads: list[torch.Tensor],
    residuals: list[torch.Tensor],
    servers: list[torch.Tensor],
    segment: int,
    compress: Callable,
    decompress: Callable,
) -> torch.Tensor:
    """The two-phase compressed mean over ranks, simulated for all ranks (residuals updated)."""
    world_size, numel, dtype = len(grads), grads[0].numel(), grads[0].dtype
    total = segment * world_size
    decoded = []
    for rank in range(world_size):
        x = torch.cat([grads[rank], grads[rank].new_zeros(total - numel)])
        residual = torch.cat([residuals[rank], residuals[rank].new_zeros(total - numel)])
        packed, scales = compress(x, residual)
        residuals[rank] = residual[:numel]
        decoded.append((packed, scales))
    out = torch.empty(total, dtype=dtype)
    per_seg_bytes = decoded[0][0].numel() // world_size
    per_seg_scales = decoded[0][1].numel() // world_size
    for owner in range(world_size):
        mean = torch.zeros(segment, dtype=torch.float32)
        for rank in range(world_size):
            packed, scales = decoded[rank]
            part = packed[owner * per_seg_bytes : (owner + 1) * per_seg_bytes]
            part_scales = scales[owner * per_seg_scales : (owner + 1) * per_seg_scales]
            mean += decompress(part, part_scales, segment, torch.float32)
        mean /= world_size
        packed2, scales2 = compress(mean, servers[owner])
        out[owner * segment : (owner + 1) * segment] = decompress(packed2, scales2, segment, dtype)
    return out[:numel]


def sign_codec(numel: int, world_size: int, chunk: int) -> tuple[int, Callable, Callable]:
    small = _segment(numel, world_size, 8)
    if small <= chunk:
        segment, chunk = small, small
    else:
        segment = _segment(numel, world_size, math.lcm(chunk, 8))

    def compress(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.sign_compress(x, residual, chunk)

    def decompress(packed, scales, n, dtype):
        return reference.sign_decompress(packed, scales, n, chunk, dtype)

    return segment, compress, decompress


def nearest_quant_codec(numel: int, world_size: int, bits: int, block: int) -> tuple[int, Callable, Callable]:
    segment = _segment(numel, world_size, math.lcm(block, 8))

    def compress(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.quantize_blockwise(x, bits, block, stochastic=False, residual=residual)

    def decompress(codes, scales, n, dtype):
        return reference.dequantize_blockwise(codes, scales, n, bits, block, dtype)

    return segment, compress, decompress


# ------------------------------------------------------------------------------------ DDP level helpers
def make_mlp(seed: int, dims: tuple[int, ...] = (16, 48, 48, 4)) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def batch_for(rank: int, step: int, n: int = 8, dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(n, dim, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch_for(rank, step)
    return nn.functional.cross_entropy(model(x), y)


def sgd_steps(ddp: nn.Module, rank: int, steps: int = 3) -> torch.optim.SGD:
    """``steps`` SGD steps (lr 0.05) of ``ddp`` on this rank's batches; the optimizer, to go on with."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(steps):
        optimizer.zero_grad()
        loss_of(ddp, rank, step).backward()
        optimizer.step()
    return optimizer


def recording(hook: Callable, layouts: list) -> Callable:
    """``hook``, recording each iteration's bucket sizes in ``layouts`` (a list per iteration)."""

    def recording_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
        if bucket.index() == 0:
            layouts.append([])
        layouts[-1].append(bucket.buffer().numel())
        return hook(state, bucket)

    return recording_hook


def sum_sent_and_raw(
    ddp: nn.parallel.DistributedDataParallel,
    local: nn.Module,
    rank: int,
    steps: int,
    loss: Callable[[nn.Module, int, int], torch.Tensor] | None = None,
    check: Callable[[torch.Tensor], None] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Train ``ddp`` and its undistributed copy ``local`` for ``steps`` steps of ``loss`` (default
    :func:`loss_of`); return, per parameter, the sum (fp64) of the gradients the hook returned and of this
    rank's raw gradients. ``check`` sees every gradient the hook returned, each step."""
    loss = loss_of if loss is None else loss
    model = ddp.module
    sent = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    raw = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for step in range(steps):
        ddp.zero_grad()
        local.zero_grad()
        loss(ddp, rank, step).backward()
        loss(local, rank, step).backward()
        for s, r, p, q in zip(sent, raw, model.parameters(), local.parameters(), strict=True):
            s += p.grad.double()
            r += q.grad.double()
            if check is not None:
                check(p.grad)
    return sent, raw


def _blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 20, generator=torch.Generator().manual_seed(123)) * 0.6
    labels = torch.randint(0, 4, (n,), generator=gen)
    return centers[labels] + torch.randn(n, 20, generator=gen), labels
