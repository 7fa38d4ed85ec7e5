"""Rank processes for the hook-level tests (test_hooks_correctness.py, test_topk_dense_momentum.py).

Each hook called on fake buckets (:class:`_hooks_workers.FakeBucket`) against the test's own simulation of
every rank from the reference ops; the error-feedback invariant over many steps; bad options; DGC's momentum
on dense steps. Spawned through :func:`_hooks_workers.spawn`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from _hooks_workers import (
    FakeBucket,
    assert_same_on_all_ranks,
    grad_for,
    make_buckets,
    nearest_quant_codec,
    ref_topk,
    ref_two_phase,
    run_hook,
    sign_codec,
)

import fastcomm
from fastcomm import reference

HOOK_FUNCTIONS = {"topk": fastcomm.topk_hook, "quantize": fastcomm.quantize_hook, "sign": fastcomm.sign_hook}
BUCKET_SIZES = [(1,), (7,), (300,), (2000, 1000), (5000,)]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def correctness_worker(rank: int, world_size: int) -> None:
    """Each hook's result, the same on every rank, against the test's own simulation of all ranks from the
    reference ops (on rank 0)."""
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
            # rank 0's simulation of every rank: residuals, and servers (sized at step 0 by the codec)
            sims = [
                {"res": [torch.zeros(sum(s), dtype=dtype) for _ in range(world_size)], "server": []}
                for s in (BUCKET_SIZES if rank == 0 else ())
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
                    if rank != 0:
                        # equal on every rank (just checked), so one rank holds the result to the simulation,
                        # which replays every rank's compression: W times the hook's own work on each rank
                        # (at W=4 on 2 cores, a third of the test's CPU)
                        continue
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
            for name in ("sent_bytes", "dense_bytes", "compression_ratio", "compress_seconds"):
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
    assert state.stats()["sent_bytes"] == steps * (world_size - 1) * k * 8


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


def error_feedback_and_validation_worker(rank: int, world_size: int) -> None:
    error_feedback_worker(rank, world_size)
    validation_worker(rank, world_size)


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
