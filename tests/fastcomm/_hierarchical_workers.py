"""Rank processes for the hierarchical-compression tests: 4 gloo ranks as 2 nodes x 2 ranks (node_size=2).

Uses the spawn harness and the flat reference simulations of :mod:`_hooks_workers`; the two-level scheme
is simulated here on top of them: the dense mean inside each node, then each shard through the flat
simulation over the nodes (error feedback per shard), then the shards side by side.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from _hooks_workers import (  # the test directory is on sys.path
    FakeBucket,
    _segment,
    assert_same_on_all_ranks,
    grad_for,
    loss_of,
    make_buckets,
    make_mlp,
    nearest_quant_codec,
    ref_topk,
    ref_two_phase,
    run_hook,
    sign_codec,
    sum_sent_and_raw,
)
from torch import nn

import fastcomm
from fastcomm.compress import QuantCompressor
from fastcomm.compress.cast import CastCompressor
from fastcomm.hooks.engine.accounting import COUNTERS
from fastcomm.hooks.hierarchical import groups as _groups
from fastcomm.hooks.hierarchical.hierarchy import shard_numel

NODE_SIZE = 2
BUCKET_SIZES = [(1,), (7,), (300,), (2000, 1001), (5003,)]
STEPS = 3

# variant -> (state factory, hook, flat simulation codec: (kind, *args))
VARIANTS = {
    "topk": (lambda: fastcomm.TopKState(ratio=0.05, exact=True, min_compress_numel=0, node_size=2),
             fastcomm.topk_hook, ("topk", 0.05)),
    "sign": (lambda: fastcomm.SignState(chunk=128, min_compress_numel=0, node_size=2),
             fastcomm.sign_hook, ("sign", 128)),
    "q8": (lambda: fastcomm.QuantState(bits=8, block=64, stochastic=False, min_compress_numel=0, node_size=2),
           fastcomm.quantize_hook, ("quant", 8, 64)),
    # phase 2 from the next bucket's cross-node job instead of the phase-2 thread
    "sign+deferred": (
        lambda: fastcomm.SignState(chunk=128, min_compress_numel=0, node_size=2, overlap_phase2=False),
        fastcomm.sign_hook,
        ("sign", 128),
    ),
    "compressor_q2": (
        lambda: fastcomm.hooks.CompressorState(
            QuantCompressor(bits=2, block=32, stochastic=False), min_compress_numel=0, node_size=2
        ),
        fastcomm.hooks.compressor_hook,
        ("quant", 2, 32),
    ),
    "cast_bf16": (
        lambda: fastcomm.hooks.CompressorState(
            CastCompressor(torch.bfloat16), min_compress_numel=0, node_size=2
        ),
        fastcomm.hooks.compressor_hook,
        ("cast",),
    ),
}  # fmt: skip


def _cast_codec(numel: int, world_size: int) -> tuple[int, object, object]:
    """bf16 rounding of ``x + residual`` (nearest), the rounding error fed back; segments of 8 elements."""

    def compress(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc = x.float() + residual.float()
        narrow = acc.to(torch.bfloat16)
        residual.copy_(acc - narrow.float())
        return narrow, narrow.new_empty(0)

    def decompress(packed, scales, n, dtype):
        return packed[:n].to(dtype)

    return _segment(numel, world_size, 8), compress, decompress


def _simulate_bucket(grads: list[torch.Tensor], sim: dict, codec: tuple, step: int) -> torch.Tensor:
    """The two-level mean of every rank's ``grads`` (fp32), simulated; ``sim`` keeps the shard residuals."""
    world_size, numel = len(grads), grads[0].numel()
    nodes = world_size // NODE_SIZE
    shard = shard_numel(numel, NODE_SIZE)
    total = shard * NODE_SIZE
    node_means = []
    for node in range(nodes):
        summed = grads[node * NODE_SIZE].clone()
        for local in range(1, NODE_SIZE):
            summed += grads[node * NODE_SIZE + local]
        node_means.append(torch.cat([summed, summed.new_zeros(total - numel)]) / NODE_SIZE)
    shards = []
    for local in range(NODE_SIZE):
        inputs = [mean[local * shard : (local + 1) * shard].clone() for mean in node_means]
        res = sim.setdefault(("res", local), [torch.zeros(shard) for _ in range(nodes)])
        if codec[0] == "topk":
            shards.append(ref_topk(inputs, res, codec[1]))
            continue
        if codec[0] == "sign":
            segment, comp, decomp = sign_codec(shard, nodes, codec[1])
        elif codec[0] == "cast":
            segment, comp, decomp = _cast_codec(shard, nodes)
        else:
            segment, comp, decomp = nearest_quant_codec(shard, nodes, codec[1], codec[2])
        server = sim.setdefault(("server", local), [torch.zeros(segment) for _ in range(nodes)])
        shards.append(ref_two_phase(inputs, res, server, segment, comp, decomp))
    return torch.cat(shards)[:numel]


def simulation_worker(rank: int, world_size: int) -> None:
    """Each hook with node_size=2 against the two-level simulation, over several steps; traffic per link."""
    for variant in VARIANTS:
        _check_against_simulation(rank, world_size, variant)
    # the reduce-scatter / all-gather path that backends other than gloo take (NCCL), here over gloo
    gloo_path = _groups.node_groups(NODE_SIZE)
    _groups._GROUPS[NODE_SIZE] = dataclasses.replace(gloo_path, gloo=False)
    try:
        for variant in ("sign", "topk"):
            _check_against_simulation(rank, world_size, variant)
    finally:
        _groups._GROUPS[NODE_SIZE] = gloo_path
    _check_cross_node_bytes(rank, world_size)
    _check_fp16_sum_does_not_overflow(rank)


def _check_fp16_sum_does_not_overflow(rank: int) -> None:
    """fp16 buckets whose node sums overflow (2 x 40000 > 65504) but whose means do not: finite means."""
    for variant in ("sign", "q8"):
        make_state, hook, _ = VARIANTS[variant]
        params = [torch.zeros(999, dtype=torch.float16)]
        grad = torch.full((999,), 40000.0, dtype=torch.float16)
        grad[rank::4] = -30000.0
        (out,) = run_hook(hook, make_state(), [FakeBucket(0, params, grad)])
        assert bool(torch.isfinite(out).all()), f"{variant}: the fp16 node sum overflowed"
        assert_same_on_all_ranks(out, "fp16")


def _check_against_simulation(rank: int, world_size: int, variant: str) -> None:
    """One variant's outputs over STEPS steps of BUCKET_SIZES: equal on every rank and (on rank 0) to the
    simulation."""
    make_state, hook, codec = VARIANTS[variant]
    state = make_state()
    params = make_buckets(BUCKET_SIZES, torch.float32)
    sims: list[dict] = [{} for _ in BUCKET_SIZES]
    for step in range(STEPS):
        all_grads = [
            [grad_for(r, b, step, sum(s), torch.float32) for r in range(world_size)]
            for b, s in enumerate(BUCKET_SIZES)
        ]
        buckets = [FakeBucket(b, params[b], all_grads[b][rank].clone()) for b in range(len(BUCKET_SIZES))]
        outputs = run_hook(hook, state, buckets)
        for b, out in enumerate(outputs):
            what = f"{variant} bucket {BUCKET_SIZES[b]} step {step}"
            assert_same_on_all_ranks(out, what)
            if rank == 0:  # equal on every rank (just checked): one rank replays every rank's compression
                expected = _simulate_bucket(all_grads[b], sims[b], codec, step)
                assert torch.equal(out, expected), f"{what}: max diff {(out - expected).abs().max()}"
    stats = state.stats()
    assert stats["steps"] == STEPS and stats["compressed_buckets"] == STEPS * len(BUCKET_SIZES), stats
    assert stats["cross_node_bytes"] > 0 and stats["intra_node_bytes"] > 0, stats


def _check_cross_node_bytes(rank: int, world_size: int) -> None:
    """Bytes crossing nodes are about 1/L of the flat hook's (top-k: 1/L**2), on one large bucket."""
    numel = 60_000
    # name -> (class, hook, options, cross-node share of flat, in-node gather bytes / the dense shard's):
    # the two-phase exchanges' payloads are gathered as they are (sign: 1 bit of 32, 8-bit: 8 of 32, plus
    # scales); top-k's decoded shard is
    cases = {
        "sign": (fastcomm.SignState, fastcomm.sign_hook, {"chunk": 2048}, 1 / NODE_SIZE, (1 / 32, 1 / 28)),
        "q8": (fastcomm.QuantState, fastcomm.quantize_hook, {"bits": 8}, 1 / NODE_SIZE, (1 / 4, 1 / 3.6)),
        "topk": (fastcomm.TopKState, fastcomm.topk_hook, {"ratio": 0.01}, 1 / NODE_SIZE**2, (1, 1)),
    }
    for name, (cls, hook, options, expected, (low, high)) in cases.items():
        sent = {}
        for node_size in (1, NODE_SIZE):
            state = cls(min_compress_numel=0, node_size=node_size, **options)
            params = [torch.zeros(numel)]
            run_hook(hook, state, [FakeBucket(0, params, grad_for(rank, 0, 0, numel, torch.float32))])
            stats = state.stats()
            # flat: every rank spreads its traffic evenly over its W - 1 peers, W - L of them on other nodes
            share = (world_size - NODE_SIZE) / (world_size - 1)
            sent[node_size] = stats["cross_node_bytes"] if node_size > 1 else stats["sent_bytes"] * share
            if node_size > 1:
                dense_shard = (NODE_SIZE - 1) * shard_numel(numel, NODE_SIZE) * 4
                gathered = (stats["intra_node_bytes"] - dense_shard) / dense_shard  # the reduce sends it
                assert low <= gathered <= high, f"{name}: in-node gather {gathered:.4f} of the dense shard"
        ratio = sent[NODE_SIZE] / sent[1]
        assert 0.8 * expected < ratio < 1.2 * expected, f"{name}: cross-node bytes {sent}, ratio {ratio}"


# --------------------------------------------------------------------------------------- DDP level
DDP_CASES = {
    "sign": ("sign", {"chunk": 64, "min_compress_numel": 0}),
    "q8": ("quantize", {"bits": 8, "block": 64, "min_compress_numel": 0}),
    "topk": ("topk", {"ratio": 0.1, "min_compress_numel": 0}),
    "registered": ("hier_test_q4", {"min_compress_numel": 0}),
    "cast_bf16_two_phase": (fastcomm.compressor("cast", dtype=torch.bfloat16), {"min_compress_numel": 0}),
}
BUCKET_CAPS = {"default": {}, "one bucket": {"bucket_cap_mb": 1000}, "many buckets": {"bucket_cap_mb": 0.002}}
DIMS = (16, 37, 29, 4)


def ddp_worker(rank: int, world_size: int) -> None:
    """DDP with node_size=2: every hook, default / one / many buckets, no hang, one result on all ranks;
    resume from state_dict() bit-identical; bad options named."""
    if "hier_test_q4" not in fastcomm.hooks.HOOKS:
        q4 = QuantCompressor(bits=4, block=32, stochastic=False)
        fastcomm.hooks.add_compressor("hier_test_q4", lambda: q4)
    for name, (hook_name, options) in DDP_CASES.items():
        for caps in BUCKET_CAPS.values():
            model = make_mlp(5, DIMS)
            ddp = nn.parallel.DistributedDataParallel(model, **caps)
            state = fastcomm.register(ddp, hook_name, node_size=NODE_SIZE, **options)
            for step in range(3):
                ddp.zero_grad()
                loss_of(ddp, rank, step).backward()
                for p in model.parameters():
                    assert bool(torch.isfinite(p.grad).all()), name
                    assert_same_on_all_ranks(p.grad, f"{name} {caps} step {step}")
            assert state.stats()["steps"] == 3 and state.stats()["cross_node_bytes"] > 0
        _check_resume(rank, hook_name, options)
        _check_rebuild_keeps_what_is_owed(rank, world_size, hook_name, options)
    _check_bad_options()
    _check_local_world_size_default(rank)


def _check_resume(rank: int, hook_name: str, options: dict) -> None:
    """Save at step 3 under DDP's default buckets, restore into a fresh DDP: steps 4-5 bit-identical."""
    model = make_mlp(6, DIMS)
    ddp = nn.parallel.DistributedDataParallel(model)
    state = fastcomm.register(ddp, hook_name, node_size=NODE_SIZE, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)

    def train(ddp: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            optimizer.zero_grad()
            loss_of(ddp, rank, step).backward()
            optimizer.step()

    train(ddp, optimizer, range(3))
    saved = pickle.dumps(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "comm": state.state_dict()}
    )
    train(ddp, optimizer, range(3, 5))
    restored = pickle.loads(saved)
    fresh = make_mlp(7, DIMS)
    fresh.load_state_dict(restored["model"])
    fresh_ddp = nn.parallel.DistributedDataParallel(fresh)
    fresh_state = fastcomm.register(fresh_ddp, hook_name, node_size=NODE_SIZE, **options)
    fresh_state.load_state_dict(restored["comm"])
    fresh_optimizer = torch.optim.SGD(fresh_ddp.parameters(), lr=0.05)
    fresh_optimizer.load_state_dict(restored["optimizer"])
    train(fresh_ddp, fresh_optimizer, range(3, 5))
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), f"{hook_name}: resumed weights differ by {(p - q).abs().max()}"
    # the checkpointed counters resume; compression seconds and the step's timings are this process's own
    kept = set(COUNTERS) - {"compress_seconds"}
    resumed, uninterrupted = fresh_state.stats(), state.stats()
    same = {k: resumed[k] for k in kept} == {k: uninterrupted[k] for k in kept}
    assert same, "counters differ after the resume"


def _check_rebuild_keeps_what_is_owed(rank: int, world_size: int, hook_name: str, options: dict) -> None:
    """Across DDP's bucket rebuild the shards' owed amounts move to the new buckets: the mean over ranks
    of every gradient returned plus what is still owed equals the mean of the raw gradients."""
    model = make_mlp(10, DIMS)
    local = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    state = fastcomm.register(ddp, hook_name, node_size=NODE_SIZE, **options)
    sent, raw = sum_sent_and_raw(ddp, local, rank, 4)
    for s, r, p in zip(sent, raw, model.parameters(), strict=True):
        owed = state.residual_of(p).double()
        dist.all_reduce(owed)
        assert bool(owed.any()), f"{hook_name}: nothing owed for a parameter of shape {tuple(p.shape)}"
        dist.all_reduce(r)
        err = float((s + owed / world_size - r / world_size).abs().max())
        assert err < 1e-5, f"{hook_name}: error-feedback invariant broken across the rebuild by {err}"
    _check_merge_keeps_what_is_owed(rank, world_size, state, model)


def _check_merge_keeps_what_is_owed(rank: int, world_size: int, state: object, model: nn.Module) -> None:
    """merge_state_dicts to 2 and 3 ranks: the new ranks' mean owed is the 4 old ranks' (shards folded in)."""
    states = [None] * world_size
    dist.all_gather_object(states, state.state_dict())
    old = [state.residual_of(p).double() for p in model.parameters()]
    for owed in old:
        dist.all_reduce(owed)
    for new_world in (2, 3):
        new = [torch.zeros_like(owed) for owed in old]
        for new_rank in range(new_world):
            merged, why = type(state).merge_state_dicts(states, new_world, new_rank)
            assert "hierarchical shard residuals folded" in why, why
            twin = copy.deepcopy(model)
            fresh = type(state)(**{**state.options(), "node_size": 1})
            fresh.bind(twin)  # the same parameter keys (module order)
            fresh.load_state_dict(merged)
            for total, p in zip(new, twin.parameters(), strict=True):
                total += fresh.residual_of(p).double()
        for a, b in zip(new, old, strict=True):
            err = float((a / new_world - b / world_size).abs().max())
            assert err < 1e-6, f"merge to {new_world} ranks changed the mean owed by {err}"


def _check_bad_options() -> None:
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="node_size"):
            fastcomm.SignState(node_size=bad)
    ddp = nn.parallel.DistributedDataParallel(make_mlp(8, DIMS))
    with pytest.raises(ValueError, match="node_size=3 does not divide the world size 4"):
        fastcomm.register(ddp, "sign", node_size=3)
    with pytest.raises(ValueError, match="PowerSGD"):
        fastcomm.register(ddp, "powersgd", node_size=NODE_SIZE)
    with pytest.raises(ValueError, match="momentum"):
        fastcomm.TopKState(momentum=0.9, node_size=NODE_SIZE)
    with pytest.raises(ValueError, match="clip_norm"):
        fastcomm.TopKState(clip_norm=1.0, node_size=NODE_SIZE)
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][dist.get_rank() // 2]
    with pytest.raises(ValueError, match="default process group"):
        fastcomm.register(ddp, fastcomm.SignState(node_size=NODE_SIZE, process_group=pair))


def _check_local_world_size_default(rank: int) -> None:
    """node_size=None takes LOCAL_WORLD_SIZE (2 here: two nodes); a value that does not divide: flat."""
    for local, hierarchical in (("2", True), ("3", False), ("4", False)):
        os.environ["LOCAL_WORLD_SIZE"] = local
        try:
            model = make_mlp(9, DIMS)
            ddp = nn.parallel.DistributedDataParallel(model)
            state = fastcomm.register(ddp, "sign", min_compress_numel=0)
            twin = copy.deepcopy(model)
            twin_ddp = nn.parallel.DistributedDataParallel(twin)
            fastcomm.register(twin_ddp, "sign", min_compress_numel=0, node_size=2 if hierarchical else 1)
        finally:
            del os.environ["LOCAL_WORLD_SIZE"]
        loss_of(ddp, rank, 0).backward()
        loss_of(twin_ddp, rank, 0).backward()
        assert ("cross_node_bytes" in state.stats()) is hierarchical, local
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"LOCAL_WORLD_SIZE={local}: not the node_size it implies"
