"""Rank processes for the hook tests: a bounded spawn harness and the per-rank checks it runs.

The test files are thin: each spawns one process group and calls one worker here, which runs many checks
in a row (process start-up and ``import torch`` cost seconds). Workers live in this importable module, not
in the test files, because spawned children must import them by name (pytest imports test files under
generated names). Every worker asserts; a failure on any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import copy
import gc
import io
import json
import math
import os
import pickle
import random
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

import fastcomm
from fastcomm import reference

COLLECTIVE_TIMEOUT_S = 60
# Ranks are forked by a forkserver that imported torch, fastcomm and what DDP's constructor imports
# (torch._dynamo) once for the whole test session: a rank starts in milliseconds, where a spawned one imports
# for seconds. The server is a fresh single-threaded process, so no thread of the test process is forked.
PRELOAD = ["_hooks_workers", "torch._dynamo"]


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


# ------------------------------------------------------------------------- hook level, W = 2 and W = 4
HOOK_FUNCTIONS = {"topk": fastcomm.topk_hook, "quantize": fastcomm.quantize_hook, "sign": fastcomm.sign_hook}
BUCKET_SIZES = [(1,), (7,), (300,), (2000, 1000), (5000,)]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def correctness_worker(rank: int, world_size: int) -> None:
    """Each hook's result against the test's own simulation of all ranks from the reference ops."""
    if world_size == 4:
        _check_subgroups(rank)
    else:
        _check_lane_fallback(rank)
    steps = 3
    for dtype in DTYPES:
        # "+pieces": collectives cut into many small pieces (the layout large buckets get by default)
        variants = ("topk", "sign", "quant_nearest", "quant_stochastic")
        # "+deferred": phase 2 from the next hook call instead of the background thread
        variants += ("sign+pieces", "quant_nearest+pieces", "sign+deferred", "quant_nearest+deferred")
        for variant in variants:
            family, _, suffix = variant.partition("+")
            wire = {"wire_chunk_bytes": 200} if suffix == "pieces" else {}
            if suffix == "deferred":
                wire = {"overlap_phase2": False}
            params = make_buckets(BUCKET_SIZES, dtype)
            if family == "topk":
                state = fastcomm.TopKState(ratio=0.05, exact=True, min_compress_numel=0)
                hook = fastcomm.topk_hook
            elif family == "sign":
                state, hook = fastcomm.SignState(chunk=512, min_compress_numel=0, **wire), fastcomm.sign_hook
            else:
                stochastic = family == "quant_stochastic"
                state = fastcomm.QuantState(
                    bits=4, block=64, stochastic=stochastic, min_compress_numel=0, **wire
                )
                hook = fastcomm.quantize_hook
            sims = [
                {
                    "res": [torch.zeros(sum(s), dtype=dtype) for _ in range(world_size)],
                    "server": [torch.zeros(10**6, dtype=torch.float32) for _ in range(world_size)],
                }
                for s in BUCKET_SIZES
            ]
            for step in range(steps):
                all_grads = [
                    [grad_for(r, b, step, sum(s), dtype) for r in range(world_size)]
                    for b, s in enumerate(BUCKET_SIZES)
                ]
                buckets = [
                    FakeBucket(b, params[b], all_grads[b][rank].clone()) for b in range(len(BUCKET_SIZES))
                ]
                outputs = run_hook(hook, state, buckets)
                for b, (out, grads) in enumerate(zip(outputs, all_grads, strict=True)):
                    what = f"{variant} {dtype} bucket {BUCKET_SIZES[b]} W={world_size} step {step}"
                    assert out.dtype == dtype and out.shape == (grads[0].numel(),), what
                    assert_same_on_all_ranks(out, what)
                    sim = sims[b]
                    numel = grads[0].numel()
                    if family == "topk":
                        expected = ref_topk(grads, sim["res"], 0.05)
                    elif family == "quant_stochastic":
                        if step == 0:
                            _check_quant_bound(out, grads, bits=4, block=64, what=what)
                        continue
                    else:
                        if family == "sign":
                            segment, comp, decomp = sign_codec(numel, world_size, 512)
                        else:
                            segment, comp, decomp = nearest_quant_codec(numel, world_size, 4, 64)
                        if step == 0:
                            sim["server"] = [torch.zeros(segment) for _ in range(world_size)]
                        expected = ref_two_phase(grads, sim["res"], sim["server"], segment, comp, decomp)
                    assert torch.equal(out, expected), f"{what}: max diff {(out - expected).abs().max()}"
            stats = state.stats()
            assert stats["steps"] == steps and stats["compressed_buckets"] == steps * len(BUCKET_SIZES), stats
            for name in ("bytes_sent", "dense_bytes", "compression_ratio", "compress_seconds"):
                assert name in stats


def _check_subgroups(rank: int) -> None:
    """Two-phase hooks on a process group of 2 of the 4 ranks, each pair on its own: the pair's mean, with
    phase 2 on the second group the hook makes over that pair (both pairs make theirs concurrently)."""
    pairs = [[0, 1], [2, 3]]
    groups = [dist.new_group(pair) for pair in pairs]  # every rank creates every group, in the same order
    pair = pairs[rank // 2]
    group = groups[rank // 2]
    numel = 5000
    for family in ("sign", "quant_nearest"):
        if family == "sign":
            state = fastcomm.SignState(chunk=512, min_compress_numel=0, process_group=group)
            hook = fastcomm.sign_hook
            segment, comp, decomp = sign_codec(numel, 2, 512)
        else:
            state = fastcomm.QuantState(
                bits=8, block=64, stochastic=False, min_compress_numel=0, process_group=group
            )
            hook = fastcomm.quantize_hook
            segment, comp, decomp = nearest_quant_codec(numel, 2, 8, 64)
        params = make_buckets([(numel,)], torch.float32)[0]
        residuals = [torch.zeros(numel) for _ in pair]
        servers = [torch.zeros(segment) for _ in pair]
        for step in range(2):
            grads = [grad_for(r, 0, step, numel, torch.float32) for r in pair]
            (out,) = run_hook(hook, state, [FakeBucket(0, params, grads[pair.index(rank)].clone())])
            expected = ref_two_phase(grads, residuals, servers, segment, comp, decomp)
            assert torch.equal(out, expected), f"{family} on ranks {pair}, step {step}"


def _check_lane_fallback(rank: int) -> None:
    """No second process group to be had: a warning, and phase 2 from the next hook call, same results."""
    import pytest

    from fastcomm.collectives import _lane

    def refuse(parent: dist.ProcessGroup) -> None:
        raise RuntimeError("no group today")

    params = make_buckets([(3000,), (900,)], torch.float32)
    grads = [grad_for(rank, b, 0, 3000 if b == 0 else 900, torch.float32) for b in range(2)]
    results = []
    for overlap in (True, False):
        options = {"bits": 4, "block": 64, "stochastic": False, "min_compress_numel": 0}
        state = fastcomm.QuantState(**options, overlap_phase2=overlap, process_group=dist.new_group([0, 1]))
        buckets = [FakeBucket(b, params[b], grads[b]) for b in range(2)]
        if overlap:
            original, _lane.Lane = _lane.Lane, refuse
            try:
                with pytest.warns(RuntimeWarning, match="no group today") as caught:
                    results.append(run_hook(fastcomm.quantize_hook, state, buckets))
                assert len(caught) == 1, "the failure must be remembered, not retried per bucket"
            finally:
                _lane.Lane = original
        else:
            results.append(run_hook(fastcomm.quantize_hook, state, buckets))
    for fallback, deferred in zip(*results, strict=True):
        assert torch.equal(fallback, deferred)


def _check_quant_bound(
    out: torch.Tensor, grads: list[torch.Tensor], bits: int, block: int, what: str
) -> None:
    """Stochastic rounding errs by less than one step per phase: bound derived from each block's absmax."""
    numel = grads[0].numel()
    qmax = 2 ** (bits - 1) - 1
    blocks = math.ceil(numel / block)

    def absmax(x: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(x.float(), (0, blocks * block - numel))
        return padded.view(blocks, block).abs().amax(dim=1)

    mean = torch.stack([g.float() for g in grads]).mean(dim=0)
    step1 = torch.stack([absmax(g) for g in grads]).mean(dim=0) / qmax
    step2 = (absmax(mean) + step1) / qmax
    bound = (step1 + step2).repeat_interleave(block)[:numel] * 1.001
    eps = torch.finfo(out.dtype).eps
    bound = bound + mean.abs() * eps * 2 + 1e-6
    err = (out.float() - mean).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), f"{what}: error {float(err[worst])} > bound {float(bound[worst])}"


def error_feedback_worker(rank: int, world_size: int) -> None:
    """Sum of what was sent plus what is still owed equals the sum of the raw gradients, for every hook."""
    steps = 25
    sizes = [(3000, 1000), (300,), (1,)]
    for name, state in [
        ("topk", fastcomm.TopKState(ratio=0.02, exact=True, min_compress_numel=0)),
        ("quantize", fastcomm.QuantState(bits=2, block=128, min_compress_numel=0)),
        ("sign", fastcomm.SignState(chunk=256, min_compress_numel=0)),
    ]:
        hook = HOOK_FUNCTIONS[name]
        params = make_buckets(sizes, torch.float32)
        sent = [torch.zeros(sum(s), dtype=torch.float64) for s in sizes]
        raw = [torch.zeros(sum(s), dtype=torch.float64) for s in sizes]
        for step in range(steps):
            grads = [grad_for(rank, b, step, sum(s), torch.float32) for b, s in enumerate(sizes)]
            outputs = run_hook(hook, state, [FakeBucket(b, params[b], g) for b, g in enumerate(grads)])
            for b in range(len(sizes)):
                sent[b] += outputs[b].double()
                raw[b] += grads[b].double()
        for b in range(len(sizes)):
            owed = torch.cat([state.residual_of(p).reshape(-1) for p in params[b]]).double()
            dist.all_reduce(owed)
            dist.all_reduce(raw[b])
            lhs, rhs = sent[b] + owed / world_size, raw[b] / world_size
            err = float((lhs - rhs).abs().max())
            assert err < 1e-4 * float(rhs.abs().max()) + 1e-5, f"{name} bucket {b}: invariant off by {err}"
        lossy = float((sent[0] - raw[0] / world_size).abs().max())
        assert lossy > 1e-3, f"{name}: the large bucket was sent losslessly, so the check proves nothing"
        assert state.stats()["steps"] == steps
    _check_approximate_topk(rank, world_size)
    _check_start_iter(rank, world_size)
    _check_owed_gradient_follows_rebuild_into_dense_bucket(rank, world_size)


def _check_approximate_topk(rank: int, world_size: int) -> None:
    """Sampled threshold (count varies per rank): fixed-size payload, cut entries stay owed."""
    numel, steps = 140_000, 4  # large enough that topk_select really samples its threshold
    k = math.ceil(0.02 * numel)
    assert reference.approx_sample_size(numel, k) * 2 <= numel
    state = fastcomm.TopKState(ratio=0.02, exact=False, min_compress_numel=0)
    params = [torch.zeros(numel)]
    sent = torch.zeros(numel, dtype=torch.float64)
    raw = torch.zeros(numel, dtype=torch.float64)
    counts = []
    for step in range(steps):
        grad = grad_for(rank, 0, step, numel, torch.float32)
        owed = state.residual_of(params[0])
        acc = grad if owed is None else grad + owed
        counts.append(reference.topk_select(acc, k, exact=False)[0].numel())
        (out,) = run_hook(fastcomm.topk_hook, state, [FakeBucket(0, params, grad)])
        assert_same_on_all_ranks(out, "approximate top-k")
        assert int((out != 0).sum()) <= world_size * k
        sent += out.double()
        raw += grad.double()
    assert any(c != k for c in counts), f"the sampled threshold gave exactly k every time: {counts}"
    owed = state.residual_of(params[0]).double()
    dist.all_reduce(owed)
    dist.all_reduce(raw)
    err = float((sent + owed / world_size - raw / world_size).abs().max())
    assert err < 1e-4, f"approximate top-k lost gradient mass: {err}"
    assert state.stats()["bytes_sent"] == steps * (world_size - 1) * k * 8


def _check_owed_gradient_follows_rebuild_into_dense_bucket(rank: int, world_size: int) -> None:
    """A rebuild that splits a compressed bucket into small (dense) ones sends what was owed, once."""
    for state, hook in [
        (fastcomm.TopKState(ratio=0.05, min_compress_numel=100), fastcomm.topk_hook),
        (fastcomm.SignState(min_compress_numel=100), fastcomm.sign_hook),
    ]:
        params = [torch.zeros(60), torch.zeros(70)]
        sent = torch.zeros(130, dtype=torch.float64)
        raw = torch.zeros(130, dtype=torch.float64)
        for step in range(6):
            grads = [grad_for(rank, p, step, n, torch.float32) for p, n in enumerate((60, 70))]
            if step < 3:  # one bucket of 130 elements: compressed
                buckets = [FakeBucket(0, params, torch.cat(grads))]
            else:  # rebuilt: one bucket per parameter, each below min_compress_numel
                buckets = [FakeBucket(b, [params[b]], grads[b]) for b in range(2)]
            outputs = run_hook(hook, state, buckets)
            sent += torch.cat(outputs).double()
            raw += torch.cat(grads).double()
        dist.all_reduce(raw)
        err = float((sent - raw / world_size).abs().max())
        assert err < 1e-4, (
            f"{type(state).__name__}: owed gradient lost or sent twice after the rebuild ({err})"
        )


def _check_start_iter(rank: int, world_size: int) -> None:
    """Dense (exact mean) for the first start_iter steps, compressed after; small buckets stay dense."""
    state = fastcomm.SignState(start_iter=2, min_compress_numel=100)
    params = make_buckets([(500,), (50,)], torch.float32)
    for step in range(4):
        grads = [grad_for(rank, b, step, n, torch.float32) for b, n in enumerate((500, 50))]
        outputs = run_hook(
            fastcomm.sign_hook, state, [FakeBucket(b, params[b], g) for b, g in enumerate(grads)]
        )
        for b, (out, grad) in enumerate(zip(outputs, grads, strict=True)):
            mean = grad.clone()
            dist.all_reduce(mean)
            mean /= world_size
            lossless = step < 2 or b == 1
            assert torch.allclose(out, mean, atol=1e-6) == lossless, f"step {step} bucket {b}"
    stats = state.stats()
    assert stats["dense_buckets"] == 6 and stats["compressed_buckets"] == 2, stats


def validation_worker(rank: int, world_size: int) -> None:
    """Bad options raise ValueError naming the value; world size 1 is a local no-op that still counts."""
    import pytest

    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="ratio"):
            fastcomm.TopKState(ratio=bad)
    for bits in (3, 1, 16, True):
        with pytest.raises(ValueError, match="bits"):
            fastcomm.QuantState(bits=bits)
    for kwargs in ({"start_iter": -1}, {"min_compress_numel": -5}):
        with pytest.raises(ValueError):
            fastcomm.SignState(**kwargs)
    with pytest.raises(ValueError, match="chunk"):
        fastcomm.SignState(chunk=0)
    for bad in ({"wire_chunk_bytes": 0}, {"overlap_phase2": "yes"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            fastcomm.QuantState(**bad)
    with pytest.raises(ValueError, match="momentum"):
        fastcomm.TopKState(momentum=1.0)
    with pytest.raises(ValueError, match="dtype"):
        fastcomm.CastState(dtype=torch.int8)
    with pytest.raises(TypeError, match="TopKState"):
        fastcomm.topk_hook(fastcomm.QuantState(), FakeBucket(0, [torch.zeros(3)], torch.ones(3)))
    solo = dist.new_group([rank])
    for state, hook in [
        (fastcomm.TopKState(min_compress_numel=0, process_group=solo), fastcomm.topk_hook),
        (fastcomm.QuantState(min_compress_numel=0, process_group=solo), fastcomm.quantize_hook),
        (fastcomm.SignState(min_compress_numel=0, process_group=solo), fastcomm.sign_hook),
        (fastcomm.CastState(process_group=solo), fastcomm.cast_hook),
    ]:
        params = [torch.zeros(10)]
        grad = grad_for(rank, 0, 0, 10, torch.float32)
        (out,) = run_hook(hook, state, [FakeBucket(0, params, grad.clone())])
        assert torch.equal(out, grad), type(state).__name__
        (out,) = run_hook(hook, state, [FakeBucket(0, params, grad.clone())])
        assert state.stats()["steps"] == 2


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


HOOK_CASES = {
    "topk": ("topk", {"ratio": 0.1, "min_compress_numel": 0}),
    "quantize": ("quantize", {"bits": 4, "block": 64, "min_compress_numel": 0}),
    "sign": ("sign", {"chunk": 256, "min_compress_numel": 0}),
}


def ddp_worker(rank: int, world_size: int) -> None:
    """DDP integration: register(), per-model defaults, bucket rebuilds, checkpoints, misuse."""
    _check_register_and_misuse()
    _check_default_state_per_model(rank)
    for name in HOOK_CASES:
        _check_rebuild_keeps_residuals(rank, world_size, name)
        _check_checkpoint_resume(rank, name)


def _check_register_and_misuse() -> None:
    import pytest

    ddp = nn.parallel.DistributedDataParallel(make_mlp(0))
    with pytest.raises(ValueError, match="unknown hook"):
        fastcomm.register(ddp, "no_such_hook")
    with pytest.raises(ValueError, match="ratio"):
        fastcomm.register(ddp, "topk", ratio=2.0)
    with pytest.raises(ValueError, match="bits"):
        fastcomm.register(ddp, fastcomm.HookName.QUANTIZE, bits=3)
    state = fastcomm.register(ddp, fastcomm.HookName.TOPK, ratio=0.5)
    assert isinstance(state, fastcomm.TopKState) and state.ratio == 0.5
    other = nn.parallel.DistributedDataParallel(make_mlp(1))
    with pytest.raises(ValueError, match="another model"):
        fastcomm.register(other, state)
    # a state handed straight to a second model is caught at its first bucket
    loose = fastcomm.TopKState(min_compress_numel=0)
    first = nn.parallel.DistributedDataParallel(make_mlp(2))
    second = nn.parallel.DistributedDataParallel(make_mlp(3))
    first.register_comm_hook(loose, fastcomm.topk_hook)
    second.register_comm_hook(loose, fastcomm.topk_hook)
    loss_of(first, 0, 0).backward()
    with pytest.raises(Exception, match="two models"):
        loss_of(second, 0, 0).backward()
    for name in ("topk", "quantize", "sign", "cast"):
        state = fastcomm.register(nn.parallel.DistributedDataParallel(make_mlp(4)), name)
        restored = pickle.loads(pickle.dumps(state))
        assert restored.process_group is None and type(restored).__name__.lower().startswith(name[:4])


def _check_default_state_per_model(rank: int) -> None:
    """state=None: two models in one process keep separate states; each matches an explicit-state twin."""
    twin = nn.parallel.DistributedDataParallel(make_mlp(10, (16, 64, 64, 4)))
    fastcomm.register(twin, "topk")
    models = [nn.parallel.DistributedDataParallel(make_mlp(10, (16, 64, 64, 4))) for _ in range(2)]
    for model in models:
        model.register_comm_hook(None, fastcomm.topk_hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (twin, *models)]
    for step in range(5):
        for i, model in enumerate((twin, *models)):
            optimizers[i].zero_grad()
            loss_of(model, rank + 10 * (i == 2), step).backward()
            optimizers[i].step()
        for p_twin, p_model in zip(twin.parameters(), models[0].parameters(), strict=True):
            assert torch.equal(p_twin, p_model), f"default-state model diverged from its twin at step {step}"
    states = [fastcomm.hooks.default_state(m, fastcomm.TopKState) for m in models]
    assert states[0] is not None and states[1] is not None and states[0] is not states[1]
    assert states[0].stats()["steps"] == 5 and states[1].stats()["steps"] == 5


def _recording(hook: Callable, layouts: list) -> Callable:
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


def _check_rebuild_keeps_residuals(rank: int, world_size: int, name: str) -> None:
    """Compression from step 0 across DDP's bucket rebuild: the error-feedback invariant still holds."""
    hook_name, options = HOOK_CASES[name]
    model = make_mlp(20)
    local = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    row = fastcomm.hooks.HOOKS[fastcomm.HookName(hook_name)]
    state, hook = row.state(**options), row.hook
    state.bind(ddp.module)
    layouts: list[list[int]] = []
    ddp.register_comm_hook(state, _recording(hook, layouts))
    sent, raw = sum_sent_and_raw(ddp, local, rank, 6)
    assert layouts[0] != layouts[1], f"DDP did not rebuild its buckets: {layouts[:2]}"
    for s, r, p in zip(sent, raw, model.parameters(), strict=True):
        owed = state.residual_of(p).double()
        dist.all_reduce(owed)
        dist.all_reduce(r)
        err = float((s + owed / world_size - r / world_size).abs().max())
        assert err < 1e-5, f"{name}: error-feedback invariant broken across the rebuild by {err}"


def _check_checkpoint_resume(rank: int, name: str) -> None:
    """A state saved at step N and restored into a fresh DDP gives bit-identical gradients at step N+1."""
    hook_name, options = HOOK_CASES[name]
    kwargs = {"bucket_cap_mb": 0.004, "find_unused_parameters": True}  # stable bucket layout
    model = make_mlp(30)
    ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
    state = fastcomm.register(ddp, hook_name, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(3):
        optimizer.zero_grad()
        loss_of(ddp, rank, step).backward()
        optimizer.step()
    saved_model = copy.deepcopy(model.state_dict())
    saved_state = state.state_dict()
    pickled = pickle.dumps(state)
    buffer = io.BytesIO()
    torch.save(saved_state, buffer)
    optimizer.zero_grad()
    loss_of(ddp, rank, 3).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    for restore in ("pickle", "state_dict"):
        fresh = make_mlp(31)
        fresh.load_state_dict(saved_model)
        fresh_ddp = nn.parallel.DistributedDataParallel(fresh, **kwargs)
        if restore == "pickle":
            restored = fastcomm.register(fresh_ddp, pickle.loads(pickled))
        else:
            restored = fastcomm.register(fresh_ddp, hook_name, **options)
            buffer.seek(0)
            restored.load_state_dict(torch.load(buffer))
        assert restored.stats()["steps"] == 3
        loss_of(fresh_ddp, rank, 3).backward()
        for p, e in zip(fresh.parameters(), expected, strict=True):
            assert torch.equal(p.grad, e), f"{name} via {restore}: step N+1 gradient differs after resume"


# ------------------------------------------------------------------------ AMP, half precision, no_sync
def training_modes_worker(rank: int, world_size: int) -> None:
    for name in HOOK_CASES:
        _check_grad_scaler_skip(rank, name)
    _check_dense_steps_count_a_skip(rank, world_size)
    _check_cast_steps_are_the_bf16_mean(rank, world_size)
    _check_half_precision_models(rank, world_size)
    _check_no_sync(rank, world_size)


def _check_grad_scaler_skip(rank: int, name: str) -> None:
    """inf on one rank reaches GradScaler on all ranks; the skipped step leaves residuals and steps alone."""
    hook_name, options = HOOK_CASES[name]
    model = make_mlp(40)
    ddp = nn.parallel.DistributedDataParallel(model)
    state = fastcomm.register(ddp, hook_name, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    owed_before = None
    for step in range(5):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(ddp, rank, step)
        if step == 2 and rank == 1:
            loss = loss * float("inf")
        if step == 2:
            owed_before = [state.residual_of(p).clone() for p in model.parameters()]
        scale_before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step == 2:
            assert scaler.get_scale() < scale_before, f"{name}: GradScaler did not see the inf"
            for before, p in zip(owed_before, model.parameters(), strict=True):
                after = state.residual_of(p)
                assert torch.equal(before, after), f"{name}: the skipped step changed a residual"
            state.scale_residuals(scaler.get_scale() / scale_before)  # owed gradients follow the loss scale
            for before, p in zip(owed_before, model.parameters(), strict=True):
                assert torch.equal(before * 0.5, state.residual_of(p)), f"{name}: scale_residuals"
        else:
            assert all(torch.isfinite(p.grad).all() for p in model.parameters()), f"{name} step {step}"
    stats = state.stats()
    assert stats["steps"] == 4 and stats["skipped_steps"] == 1, stats
    assert all(torch.isfinite(state.residual_of(p)).all() for p in model.parameters())


def _check_dense_steps_count_a_skip(rank: int, world_size: int) -> None:
    """Dense buckets (before ``start_iter``): the mean is the sum divided after it arrives, checked in the
    same pass; an inf on one rank is a skipped step on every rank, finite steps are the plain mean."""
    model = make_mlp(41)
    local = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    state = fastcomm.register(ddp, "quantize", bits=8, start_iter=100)
    for step in range(4):
        ddp.zero_grad()
        local.zero_grad()
        loss = loss_of(ddp, rank, step)
        (loss * float("inf") if step == 2 and rank == 1 else loss).backward()
        if step == 2:
            assert all(not torch.isfinite(p.grad).all() for p in model.parameters()), "the inf did not spread"
            continue
        loss_of(local, rank, step).backward()
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            grads = [torch.empty_like(q.grad) for _ in range(world_size)]
            dist.all_gather(grads, q.grad)
            torch.testing.assert_close(p.grad, torch.stack(grads).sum(0) / world_size)
    stats = state.stats()
    assert stats["steps"] == 3 and stats["skipped_steps"] == 1 and stats["compressed_buckets"] == 0, stats


def _check_cast_steps_are_the_bf16_mean(rank: int, world_size: int) -> None:
    """cast (bf16) over several steps, across DDP's bucket rebuild (its wire tensors are kept per bucket):
    each gradient is exactly the bf16 allreduce of bf16(g_r / W) (2 ranks: one rounded sum, any order)."""
    assert world_size == 2
    model = make_mlp(42)
    local = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
    fastcomm.register(ddp, "cast")
    for step in range(4):
        ddp.zero_grad()
        local.zero_grad()
        loss_of(ddp, rank, step).backward()
        loss_of(local, rank, step).backward()
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            grads = [torch.empty_like(q.grad) for _ in range(world_size)]
            dist.all_gather(grads, q.grad)
            wire = [(g / world_size).to(torch.bfloat16) for g in grads]
            expected = (wire[0] + wire[1]).float()
            assert torch.equal(p.grad, expected), f"cast step {step}: not the bf16 mean"


def _check_half_precision_models(rank: int, world_size: int) -> None:
    """DDP over fp16 and bf16 models: every hook returns finite buckets of that dtype near the dense mean."""
    for dtype in (torch.float16, torch.bfloat16):
        for name, (hook_name, options) in {**HOOK_CASES, "cast": ("cast", {})}.items():
            model = make_mlp(50).to(dtype)
            local = copy.deepcopy(model)
            ddp = nn.parallel.DistributedDataParallel(model)
            fastcomm.register(ddp, hook_name, **options)
            x, y = batch_for(rank, 0)
            nn.functional.cross_entropy(ddp(x.to(dtype)).float(), y).backward()
            nn.functional.cross_entropy(local(x.to(dtype)).float(), y).backward()
            for p, q in zip(model.parameters(), local.parameters(), strict=True):
                assert p.grad.dtype == dtype and torch.isfinite(p.grad).all(), f"{name} {dtype}"
                mean = q.grad.float()
                dist.all_reduce(mean)
                mean /= world_size
                if name == "cast":
                    tol = 0.02 * float(mean.abs().max()) + 1e-3
                    assert float((p.grad.float() - mean).abs().max()) <= tol, f"{name} {dtype}"
                assert_same_on_all_ranks(p.grad, f"{name} {dtype}")


class WithUnused(nn.Module):
    """A model with a parameter that never receives a gradient (for find_unused_parameters=True)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net, self.unused = net, nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _check_no_sync(rank: int, world_size: int) -> None:
    """Accumulation under no_sync reduces once, on the sync step, also with static_graph (lossless top-k)."""
    configs = [
        {},
        {"static_graph": True},
        {"gradient_as_bucket_view": True},
        {"static_graph": True, "gradient_as_bucket_view": True},
        {"find_unused_parameters": True},
    ]
    for config in configs:
        model = WithUnused(make_mlp(60)) if config.get("find_unused_parameters") else make_mlp(60)
        local = copy.deepcopy(model)
        ddp = nn.parallel.DistributedDataParallel(model, **config)
        state = fastcomm.register(ddp, "topk", ratio=1.0, min_compress_numel=0)
        # DDP itself (no hook involved) asserts if a static_graph model's first iteration is a no_sync one,
        # so every config starts with one synchronised iteration.
        loss_of(ddp, rank, 99).backward()
        for step in range(3):
            ddp.zero_grad()
            local.zero_grad()
            for micro in range(3):
                loss_of(local, rank, 10 * step + micro).backward()
                if micro < 2:
                    with ddp.no_sync():
                        loss_of(ddp, rank, 10 * step + micro).backward()
                else:
                    loss_of(ddp, rank, 10 * step + micro).backward()
            for p, q in zip(model.parameters(), local.parameters(), strict=True):
                if q.grad is None:  # the unused layer
                    continue
                mean = q.grad.clone()
                dist.all_reduce(mean)
                mean /= world_size
                err = float((p.grad - mean).abs().max())
                assert err < 1e-5, f"{config} step {step}: sync step did not reduce the accumulation ({err})"
        stats = state.stats()
        assert stats["steps"] == 4 and stats["compressed_buckets"] == 4, (config, stats)


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
        ("quantize", {"bits": 2, "block": 32, "min_compress_numel": 16}),
        ("sign", {"chunk": 64, "min_compress_numel": 16}),
        ("quantize", {"bits": 8, "block": 32, "min_compress_numel": 16, "overlap_phase2": False}),
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
        ddp.register_comm_hook(state, _recording(hook, layouts))
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


# ------------------------------------------------------------------------- top-k momentum on dense steps
DENSE_MOMENTUM = 0.9


def dense_momentum_worker(rank: int, world_size: int, nesterov: bool) -> None:
    """TopKState(momentum=m): dense steps return DGC's velocity of the mean gradient (plain or Nesterov)."""
    state = fastcomm.TopKState(
        ratio=0.5, momentum=DENSE_MOMENTUM, nesterov=nesterov, start_iter=2, min_compress_numel=1000
    )
    sizes = [(2000, 1000), (500,)]  # bucket 0: dense for 2 steps, then compressed; bucket 1: always dense
    params = make_buckets(sizes, torch.float32)
    velocity = [torch.zeros(sum(s)) for s in sizes]
    for step in range(4):
        grads = [
            [grad_for(r, b, step, sum(s), torch.float32) for r in range(world_size)]
            for b, s in enumerate(sizes)
        ]
        buckets = [FakeBucket(b, params[b], grads[b][rank].clone()) for b in range(len(sizes))]
        outputs = run_hook(fastcomm.topk_hook, state, buckets)
        for b, out in enumerate(outputs):
            if b == 0 and step >= 2:
                continue  # compressed: test_dgc checks that path
            mean = sum(g / world_size for g in grads[b])
            if nesterov:
                velocity[b] = (velocity[b] + mean) * DENSE_MOMENTUM
                expected = velocity[b] + mean
            else:
                velocity[b] = velocity[b] * DENSE_MOMENTUM + mean
                expected = velocity[b]
            assert torch.equal(out, expected), f"bucket {b} step {step}: {(out - expected).abs().max()}"
            assert_same_on_all_ranks(out, f"bucket {b} step {step}")
    assert state.stats()["steps"] == 4 and state.stats()["dense_buckets"] == 6
    dist.barrier()


# ---------------------------------------------------------------------------------------------- training
def _blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 20, generator=torch.Generator().manual_seed(123)) * 0.6
    labels = torch.randint(0, 4, (n,), generator=gen)
    return centers[labels] + torch.randn(n, 20, generator=gen), labels


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


def error_feedback_and_validation_worker(rank: int, world_size: int) -> None:
    error_feedback_worker(rank, world_size)
    validation_worker(rank, world_size)
