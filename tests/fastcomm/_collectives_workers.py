"""Rank processes for tests/fastcomm/test_collectives.py: every case against a plain simulation.

Each rank can make every rank's inputs (they are seeded by case, step and rank), so the simulation is local
arithmetic with the compressor's own ``compress_into`` / ``decompress_into`` on whole segments, in rank
order: no collective, no piece, no lane. Each case's outcome (``"ok"`` or the failure) is written to
``results_<rank>.json`` for the test to report one case at a time.
"""

from __future__ import annotations

import json
import math
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

import fastcomm
from fastcomm import collectives
from fastcomm.compress import PowerSGDCompressor, QuantCompressor, SignCompressor, TopKCompressor

STEPS = 3
COMPRESSORS: dict[str, Callable[[], object]] = {
    "sign": lambda: SignCompressor(chunk=64),
    "q8": lambda: QuantCompressor(bits=8, block=64, stochastic=False),
    "q4": lambda: QuantCompressor(bits=4, block=32, stochastic=False),
    "topk": lambda: TopKCompressor(k=37, exact=True),
}
BLOCKWISE = ("sign", "q8", "q4")


def make_input(case: str, step: int, rank: int, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case, step, rank)).encode()))
    return (torch.randn(numel, generator=gen) * (1 + rank)).to(dtype)


def _encode(compressor, x: Tensor, residual: Tensor | None) -> Tensor:
    payload = torch.empty(compressor.wire_bytes(x.numel(), x.dtype), dtype=torch.uint8)
    compressor.compress_into(payload, x, residual, residual, 0)
    return payload


def _sum_decoded(compressor, payloads: list[Tensor], out: Tensor, numel: int, mean: bool) -> None:
    """Rank order, the first overwriting, the mean's power-of-two division folded as the exchange does."""
    world = len(payloads)
    fold = mean and world & (world - 1) == 0
    for source, payload in enumerate(payloads):
        compressor.decompress_into(out, payload, numel, source > 0, world if fold else 1)
    if mean and not fold:
        out /= world


class Mismatches:
    """A case's failed checks, raised after its last collective: a rank that stopped early would leave the
    others waiting in a collective it never issues, and every later case would time out."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def equal(self, got: Tensor, expected: Tensor, where: object) -> None:
        if not torch.equal(got, expected):
            self.found.append(f"{where}: max |difference| {(got - expected).abs().max().item()}")

    def close(self, got: Tensor, expected: Tensor, where: object) -> None:
        try:
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        except AssertionError as error:
            self.found.append(f"{where}: {error}")

    def raise_any(self) -> None:
        if self.found:
            raise AssertionError("; ".join(self.found))


def _unit(compressor) -> int:
    return math.lcm(compressor.block, 8)


class SimulatedAllReduce:
    """Two-phase all-reduce of every rank, with worker and server residuals per rank."""

    def __init__(self, compressor, numel: int, world: int, error_feedback: bool) -> None:
        self.compressor, self.numel, self.world = compressor, numel, world
        unit = _unit(compressor)
        self.segment = math.ceil(max(1, math.ceil(numel / world)) / unit) * unit
        padded = self.segment * world
        self.worker = [torch.zeros(padded) for _ in range(world)] if error_feedback else None
        self.server = [torch.zeros(self.segment) for _ in range(world)] if error_feedback else None

    def step(self, inputs: list[Tensor]) -> Tensor:
        seg, world, c = self.segment, self.world, self.compressor
        sent = []  # sent[r][j]: rank r's payload of segment j
        for r, x in enumerate(inputs):
            padded = torch.zeros(seg * world, dtype=x.dtype)
            padded[: self.numel] = x
            residual = None if self.worker is None else self.worker[r].to(x.dtype)
            row = []
            for j in range(world):
                part = None if residual is None else residual[j * seg : (j + 1) * seg]
                row.append(_encode(c, padded[j * seg : (j + 1) * seg], part))
            if residual is not None:
                residual[self.numel :] = 0  # the padding's residual is dropped
                self.worker[r] = residual.float()
            sent.append(row)
        result = torch.empty(seg * world, dtype=inputs[0].dtype)
        for j in range(world):
            mean = torch.empty(seg)
            _sum_decoded(c, [sent[r][j] for r in range(world)], mean, seg, mean=True)
            payload = _encode(c, mean, None if self.server is None else self.server[j])
            c.decompress_into(result[j * seg : (j + 1) * seg], payload, seg)
        return result[: self.numel]


def _all_reduce_case(
    rank: int, world: int, name: str, numel: int, ef: bool, async_op: bool, chunk: int
) -> None:
    compressor = COMPRESSORS[name]()
    case = ("all_reduce", name, numel, ef)
    residual = collectives.Residual() if ef else None
    sim = SimulatedAllReduce(compressor, numel, world, ef) if name in BLOCKWISE else None
    owed = [torch.zeros(numel) for _ in range(world)]  # the gather path's per-rank residuals
    checks = Mismatches()
    for step in range(STEPS):
        inputs = [make_input(repr(case), step, r, numel) for r in range(world)]
        tensor = inputs[rank].clone()
        work = collectives.all_reduce(tensor, compressor, residual=residual, async_op=async_op,
                                      chunk_bytes=chunk, seed=step)  # fmt: skip
        if async_op:
            assert work is not None
            work.wait()
        if sim is not None:
            expected = sim.step(inputs)
        else:  # all-gather of every rank's payload, decoded in rank order
            payloads = [_encode(compressor, inputs[r], owed[r] if ef else None) for r in range(world)]
            expected = torch.empty(numel)
            for source, payload in enumerate(payloads):
                compressor.decompress_into(expected, payload, numel, source > 0, world)
        checks.equal(tensor, expected, f"step {step}")
    if ef and sim is not None:  # the residual the caller holds is the simulation's
        checks.equal(residual.worker[:numel], sim.worker[rank][:numel].to(residual.worker.dtype), "residual")
    checks.raise_any()


def _reduce_scatter_case(
    rank: int, world: int, name: str, shard: int, ef: bool, op: str, async_op: bool
) -> None:
    compressor = COMPRESSORS[name]()
    unit = _unit(compressor)
    padded_shard = math.ceil(shard / unit) * unit
    case = ("reduce_scatter", name, shard, ef, op)
    residual = collectives.Residual() if ef else None
    owed = [torch.zeros(world * shard) for _ in range(world)]
    reduce_op = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
    checks = Mismatches()
    for step in range(STEPS):
        inputs = [make_input(repr(case), step, r, world * shard) for r in range(world)]
        output = torch.empty(shard)
        work = collectives.reduce_scatter(output, inputs[rank].clone(), compressor, residual=residual,
                                          op=reduce_op, async_op=async_op, chunk_bytes=64)  # fmt: skip
        if async_op:
            work.wait()
        payloads = []
        for r in range(world):
            chunk = torch.zeros(padded_shard)
            chunk[:shard] = inputs[r][rank * shard : (rank + 1) * shard]
            mine = torch.zeros(padded_shard)
            mine[:shard] = owed[r][rank * shard : (rank + 1) * shard]
            payloads.append(_encode(compressor, chunk, mine if ef else None))
            if ef:
                owed[r][rank * shard : (rank + 1) * shard] = mine[:shard]
        expected = torch.empty(shard)
        _sum_decoded(compressor, payloads, expected, padded_shard, mean=op == "avg")
        checks.equal(output, expected, f"step {step}")
    checks.raise_any()


def _all_gather_case(rank: int, world: int, name: str, numel: int, async_op: bool) -> None:
    compressor = COMPRESSORS[name]()
    case = ("all_gather", name, numel)
    inputs = [make_input(repr(case), 0, r, numel) for r in range(world)]
    output = torch.empty(world * numel)
    work = collectives.all_gather(output, inputs[rank].clone(), compressor, async_op=async_op)
    if async_op:
        work.wait()
    checks = Mismatches()
    for r in range(world):
        expected = torch.empty(numel)
        compressor.decompress_into(expected, _encode(compressor, inputs[r], None), numel)
        checks.equal(output[r * numel : (r + 1) * numel], expected, f"row {r}")
    checks.raise_any()


def _powersgd_case(rank: int, world: int, ef: bool, async_op: bool) -> None:
    """PowerSGD's rounds against the compressor's own arithmetic on every rank's input, summed here."""
    compressor = PowerSGDCompressor(rank=2)
    shapes = [torch.Size([24, 16]), torch.Size([24])]
    numel = 24 * 16 + 24
    residual = collectives.Residual() if ef else None
    owed = [torch.zeros(numel) for _ in range(world)]
    state = torch.zeros(numel) if ef else None  # the warm-start Q's, the same on every rank
    checks = Mismatches()
    for step in range(STEPS):
        inputs = [make_input(repr(("powersgd", ef)), step, r, numel) for r in range(world)]
        tensor = inputs[rank].clone()
        work = collectives.all_reduce(tensor, compressor, residual=residual, shapes=shapes, async_op=async_op,
                                      seed=step)  # fmt: skip
        if async_op:
            work.wait()
        plan = compressor.plan(shapes, 0)
        xs = [inputs[r] + owed[r] for r in range(world)]
        seed = ((step * 4_099 + 0) * 4 + 1) % (2**62)
        firsts = []
        for x in xs:
            first = torch.empty(plan.first_numel)
            compressor.first_round(plan, first, x, state, seed)
            firsts.append(first)
        first_sum = torch.stack(firsts).sum(0)
        seconds = []
        for x in xs:  # each rank orthonormalizes the summed P's in place, to the same bits
            second = torch.empty(plan.second_numel)
            orthonormal = first_sum.clone()
            compressor.second_round(plan, second, orthonormal, x)
            seconds.append(second)
        second_sum = torch.stack(seconds).sum(0)
        expected = torch.empty(numel)
        next_state = torch.zeros(numel) if ef else None
        for r, x in enumerate(xs):
            new_residual = x.clone() if ef else None
            mean = torch.empty(numel)
            sums = (orthonormal.clone(), second_sum.clone())  # finish changes them in place
            compressor.finish(plan, mean, new_residual, next_state, *sums, world)
            if r == rank:
                expected = mean
            if ef:
                owed[r] = new_residual
        state = next_state
        # gloo's sum need not add in rank order: close, not equal
        checks.close(tensor, expected, f"step {step}")
    checks.raise_any()


def _hook_diagnosis_case(rank: int, world: int) -> None:
    """A DDP model under the sign hook: stats() report bytes, a link rate and the communication shown."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = DistributedDataParallel(model)
    state = fastcomm.register(ddp, "sign", min_compress_numel=0)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        ddp(torch.randn(32, 64, generator=gen)).square().mean().backward()
    stats = state.stats()
    checks = Mismatches()
    for key in ("step_seconds", "comm_window_seconds", "link_bytes_per_second", "sent_bytes"):
        if not stats[key] > 0:
            checks.found.append(f"{key} = {stats[key]}")
    if not 0.0 <= stats["comm_share"] <= 1.0:
        checks.found.append(f"comm_share = {stats['comm_share']}")
    checks.raise_any()


def _auto_switch_case(rank: int, world: int) -> None:
    """Auto on a slow link chooses a compressor, on a fast one dense: ranks agree, and the switch pays."""
    from fastcomm.advise.kernels import KernelRates
    from fastcomm.advise.model import Link
    from fastcomm.hooks import auto

    names = ("copy", "quantize8", "quantize4", "dequantize8", "dequantize4", "sign_compress",
             "sign_decompress", "topk_select", "powersgd_project", "powersgd_back_project", "powersgd_expand")
    fixed = KernelRates(dict.fromkeys(names, 4e9), 1e9, "cpu", 1, "given")  # fmt: skip
    measured, auto._local_rates = auto._local_rates, lambda *_: fixed
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        ddp = DistributedDataParallel(model)
        state = fastcomm.register(ddp, "auto", warmup_steps=1, recheck_every=3, min_compress_numel=0,
                                  link=Link(1e-4, 1e6), overlap_phase2=False)  # fmt: skip
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        checks = Mismatches()
        for step in range(7):
            if step == 4:
                state.link = Link(1e-6, 1e12)  # the next measurement finds a fast link
            optimizer.zero_grad()
            ddp(torch.randn(32, 64, generator=gen)).square().mean().backward()
            optimizer.step()
            choices = dict(state.choices)
            everyone = [None] * world
            dist.all_gather_object(everyone, choices)
            if any(other != choices for other in everyone):
                checks.found.append(f"step {step}: ranks chose differently: {everyone}")
            if step == 2 and set(choices.values()) == {"dense"}:
                checks.found.append(f"step 2: a 1 MB/s link kept dense: {choices}")
            if step == 2 and not any(bool(state.residual_of(p).abs().sum()) for p in model.parameters()):
                checks.found.append("step 2: compression left nothing owed")
        state.stats()  # closes the last iteration
        all_dense = state.stats()["auto_dense_buckets"] == len(state.choices)
        if set(state.choices.values()) != {"dense"} or not all_dense:
            checks.found.append(f"a fast link kept compression: {state.choices}")
        for p in model.parameters():  # the dense steps paid what compression owed
            owed = state.residual_of(p)
            if owed is not None and bool(owed.abs().sum()):
                checks.found.append(f"still owed after dense steps: {owed.abs().sum().item()}")
                break
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat)
        if any(not torch.equal(other, flat) for other in everyone):
            checks.found.append("the ranks' models differ")
        checks.raise_any()
    finally:
        auto._local_rates = measured


def _auto_trial_case(rank: int, world: int) -> None:
    """After its measurement, auto runs 3 steps under its choice, then 3 dense ones, then keeps the choice
    or reverts to dense by the slowest rank's medians of the two, alike on every rank."""
    from fastcomm.advise.model import Link

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = DistributedDataParallel(model)
    state = fastcomm.register(ddp, "auto", warmup_steps=1, min_compress_numel=0, link=Link(1e-4, 1e6))
    gen = torch.Generator().manual_seed(rank)
    checks, methods = Mismatches(), []
    for _ in range(9):
        before = state.stats()
        ddp(torch.randn(32, 64, generator=gen)).square().mean().backward()
        after = state.stats()
        methods.append("dense" if after["compressed_buckets"] == before["compressed_buckets"] else "chosen")
    # step 0 warm-up, 1-3 the trial, 4-6 dense, then the verdict
    expected = ["dense", "chosen", "chosen", "chosen", "dense", "dense", "dense"]
    expected += ["dense"] * 2 if state.reverted else ["chosen"] * 2
    if methods != expected:
        checks.found.append(f"steps ran {methods}, expected {expected}")
    chosen, dense = state.trial_medians or (0.0, 0.0)
    if not (chosen > 0 and dense > 0 and state.reverted == (chosen > dense)):
        checks.found.append(f"medians {state.trial_medians}, reverted {state.reverted}")
    everyone = [None] * world
    dist.all_gather_object(everyone, (state.trial_medians, state.reverted))
    if any(other != everyone[0] for other in everyone):
        checks.found.append(f"ranks judged differently: {everyone}")
    checks.raise_any()


def cases(world: int) -> dict[str, Callable[[int], None]]:
    """Case id -> the check each rank runs."""
    table: dict[str, Callable[[int], None]] = {}
    for name in (*BLOCKWISE, "topk"):
        for numel in (1000, 77):
            for ef in (False, True):
                for async_op in (False, True):
                    chunk = 64 if numel == 1000 else 1 << 19
                    mode = f"{'ef' if ef else 'noef'}-{'async' if async_op else 'sync'}"
                    key = f"all_reduce-{name}-{numel}-{mode}"
                    table[key] = lambda r, a=(name, numel, ef, async_op, chunk): _all_reduce_case(
                        r, world, *a
                    )
    for name in BLOCKWISE:
        for shard in (333, 64):
            for ef in (False, True):
                for op in ("avg", "sum"):
                    key = f"reduce_scatter-{name}-{shard}-{'ef' if ef else 'noef'}-{op}"
                    table[key] = lambda r, a=(name, shard, ef, op, shard == 64): _reduce_scatter_case(
                        r, world, *a
                    )
    for name in (*BLOCKWISE, "topk"):
        table[f"all_gather-{name}"] = lambda r, n=name: _all_gather_case(r, world, n, 101, n == "q8")
    for ef in (False, True):
        for async_op in (False, True):
            key = f"all_reduce-powersgd-{'ef' if ef else 'noef'}-{'async' if async_op else 'sync'}"
            table[key] = lambda r, a=(ef, async_op): _powersgd_case(r, world, *a)
    table["hook-diagnosis"] = lambda r: _hook_diagnosis_case(r, world)
    table["auto-switch"] = lambda r: _auto_switch_case(r, world)
    table["auto-trial"] = lambda r: _auto_trial_case(r, world)
    return table


def run_all(rank: int, world: int, workdir: str) -> None:
    """Every case in order on every rank; outcomes to ``results_<rank>.json`` (a failed case goes on)."""
    outcomes = {}
    for key, check in cases(world).items():
        try:
            check(rank)
            outcomes[key] = "ok"
        except Exception:  # noqa: BLE001 - recorded per case; the test reports it
            outcomes[key] = traceback.format_exc()
        dist.barrier()
    Path(workdir, f"results_{rank}.json").write_text(json.dumps(outcomes))
