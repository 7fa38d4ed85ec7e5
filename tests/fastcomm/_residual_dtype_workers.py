"""Rank processes for tests/fastcomm/test_residual_dtype.py: the DDP hooks' ``residual_dtype=torch.bfloat16``.

One spawned group runs every check (each rank writes its outcome per check to ``results_<rank>.json``):

* ``<hook>-simulation``: sign, nearest-rounding quantize and top-k on fake buckets against the test's own
  simulation of every rank whose residuals (phase 1 and phase 2) are rounded to bf16 between steps, as
  the store keeps them: equal bit for bit; the residual bytes are half those of the same run in fp32.
* ``ddp-invariant``: ``register(ddp, "quantize", residual_dtype=torch.bfloat16)`` in a DDP model: the
  error-feedback invariant (what the hook returned plus the mean owed equals the mean raw gradient, summed
  over the steps) holds within the bound that bf16 storage derives: each step's rounding of a residual
  moves what is owed by at most ``2**-8`` of the residual's magnitude (``|worker| + W |segment|``).
* ``ddp-checkpoint``: the state_dict keeps the residuals in bf16 and the option, and a fresh DDP restored
  from it computes the next step's gradients bit for bit as the uninterrupted run.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import torch
import torch.distributed as dist
from _diloco_workers import run_table
from _hooks_workers import (
    FakeBucket,
    grad_for,
    loss_of,
    make_buckets,
    make_mlp,
    nearest_quant_codec,
    ref_topk,
    ref_two_phase,
    run_hook,
    sgd_steps,
    sign_codec,
    sum_sent_and_raw,
)
from torch import nn

import fastcomm

BF16 = torch.bfloat16
UNIT_ROUNDOFF = 2.0**-8  # bf16 keeps 8 significant bits: rounding to nearest errs by at most 2**-8 relative
BUCKET_SIZES = [(300,), (2000, 1000)]
STEPS = 3
DDP_STEPS = 5
DDP_OPTIONS = {"bits": 4, "block": 64, "min_compress_numel": 0, "residual_dtype": BF16}
DDP_KWARGS = {"bucket_cap_mb": 0.004, "find_unused_parameters": True}  # a stable bucket layout


def _narrow(tensors: list[torch.Tensor]) -> None:
    """Round each tensor to bf16 and back in place of itself (as the store keeps residuals)."""
    for index, tensor in enumerate(tensors):
        tensors[index] = tensor.to(BF16).to(tensor.dtype)


def _state(family: str, residual_dtype: torch.dtype | None) -> tuple[object, Callable]:
    options = {"min_compress_numel": 0, "residual_dtype": residual_dtype}
    if family == "topk":
        return fastcomm.TopKState(ratio=0.05, exact=True, **options), fastcomm.topk_hook
    if family == "sign":
        return fastcomm.SignState(chunk=512, **options), fastcomm.sign_hook
    return fastcomm.QuantState(bits=4, block=64, stochastic=False, **options), fastcomm.quantize_hook


def _simulation_check(family: str, rank: int, world: int) -> None:
    """Fake buckets through the hook in bf16 and in fp32: bf16 equals the bf16-rounding simulation, and
    keeps half the bytes."""
    kept = {}
    for residual_dtype in (BF16, None):
        state, hook = _state(family, residual_dtype)
        params = make_buckets(BUCKET_SIZES, torch.float32)
        sims = [{"res": [torch.zeros(sum(s)) for _ in range(world)], "server": None} for s in BUCKET_SIZES]
        for step in range(STEPS):
            grads = [[grad_for(r, b, step, sum(s), torch.float32) for r in range(world)]
                     for b, s in enumerate(BUCKET_SIZES)]  # fmt: skip
            buckets = [FakeBucket(b, params[b], grads[b][rank].clone()) for b in range(len(BUCKET_SIZES))]
            outputs = run_hook(hook, state, buckets)
            if residual_dtype is None:
                continue
            for b, (out, sim) in enumerate(zip(outputs, sims, strict=True)):
                numel = sum(BUCKET_SIZES[b])
                if family == "topk":
                    expected = ref_topk(grads[b], sim["res"], 0.05)
                else:
                    codec = sign_codec(numel, world, 512) if family == "sign" else nearest_quant_codec(
                        numel, world, 4, 64)  # fmt: skip
                    if sim["server"] is None:
                        sim["server"] = [torch.zeros(codec[0]) for _ in range(world)]
                    expected = ref_two_phase(grads[b], sim["res"], sim["server"], *codec)
                    _narrow(sim["server"])
                _narrow(sim["res"])
                assert torch.equal(out, expected), (
                    f"{family} bucket {b} step {step}: {(out - expected).abs().max()}"
                )
        kept[residual_dtype] = state.residual_bytes()
        held = [t.dtype for item in state.state_dict()["buckets"] for n, t in item["tensors"].items()
                if n in ("residual", "server_residual")]  # fmt: skip
        assert held and all(d == (residual_dtype or torch.float32) for d in held), (residual_dtype, held)
    assert kept[BF16] * 2 == kept[None] > 0, f"{family}: bf16 keeps {kept[BF16]} bytes, fp32 {kept[None]}"


def _rounding_bound(state: object, world: int) -> float:
    """What rounding the residuals held now to bf16 can have moved this rank's owed amount by, at most."""
    bound = 0.0
    for item in state.state_dict()["buckets"]:
        tensors = item["tensors"]
        for name, weight in (("residual", 1.0), ("server_residual", float(world))):
            if name in tensors and tensors[name].numel():
                bound += weight * float(tensors[name].float().abs().max())
    return UNIT_ROUNDOFF * (1 + UNIT_ROUNDOFF) * bound  # |x| <= |bf16(x)| (1 + u)


def _ddp_invariant_check(rank: int, world: int) -> None:
    model = make_mlp(20)
    local = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model, **DDP_KWARGS)
    state = fastcomm.register(ddp, "quantize", **DDP_OPTIONS)
    sent = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    raw = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    bound = 0.0
    for step in range(DDP_STEPS):  # one step at a time: the bound adds what each step's rounding can move
        sums = sum_sent_and_raw(ddp, local, rank, 1, loss=lambda m, r, _, t=step: loss_of(m, r, t))
        for total, add in zip((*sent, *raw), (*sums[0], *sums[1]), strict=True):
            total += add
        # step 0's residuals may be rounded once more, if DDP's bucket rebuild folds a segment into them
        bound += _rounding_bound(state, world) * (2 if step == 0 else 1)
    assert state.residual_bytes() > 0 and bound > 0, "nothing compressed"
    worst = torch.tensor([bound], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the mean over ranks errs by at most the largest
    for s, r, p in zip(sent, raw, model.parameters(), strict=True):
        owed = state.residual_of(p).double()
        dist.all_reduce(owed)
        dist.all_reduce(r)
        err = float((s + owed / world - r / world).abs().max())
        assert err <= float(worst) + 1e-5, f"invariant off by {err}, bf16 storage bounds it by {float(worst)}"


def _ddp_checkpoint_check(rank: int, world: int) -> None:
    model = make_mlp(30)
    ddp = nn.parallel.DistributedDataParallel(model, **DDP_KWARGS)
    state = fastcomm.register(ddp, "quantize", **DDP_OPTIONS)
    optimizer = sgd_steps(ddp, rank)
    saved_model = copy.deepcopy(model.state_dict())
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    optimizer.zero_grad()
    loss_of(ddp, rank, 3).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert saved["options"]["residual_dtype"] == BF16, saved["options"]
    assert all(t.dtype == BF16 for item in saved["buckets"] for n, t in item["tensors"].items()
               if n in ("residual", "server_residual")), "the checkpoint widened the residuals"  # fmt: skip
    fresh = make_mlp(31)
    fresh.load_state_dict(saved_model)
    fresh_ddp = nn.parallel.DistributedDataParallel(fresh, **DDP_KWARGS)
    restored = fastcomm.register(fresh_ddp, "quantize", **DDP_OPTIONS)
    restored.load_state_dict(saved)
    assert restored.residual_bytes() == sum(
        t.numel() * 2 for item in saved["buckets"] for n, t in item["tensors"].items()
        if n in ("residual", "server_residual"))  # fmt: skip
    loss_of(fresh_ddp, rank, 3).backward()
    for got, want in zip((p.grad for p in fresh.parameters()), expected, strict=True):
        assert torch.equal(got, want), f"the restored run differs by {(got - want).abs().max()}"


def checks(world: int) -> dict[str, Callable[[int], None]]:
    """Check id -> what each rank runs."""
    table: dict[str, Callable[[int], None]] = {
        f"{family}-simulation": (lambda r, f=family: _simulation_check(f, r, world))
        for family in ("sign", "quantize", "topk")
    }
    table["ddp-invariant"] = lambda r: _ddp_invariant_check(r, world)
    table["ddp-checkpoint"] = lambda r: _ddp_checkpoint_check(r, world)
    return table


def run_all(rank: int, world: int, workdir: str) -> None:
    """Every check in order on every rank; outcomes to ``results_<rank>.json`` (a failed check goes on)."""
    run_table(checks(world), rank, workdir)
