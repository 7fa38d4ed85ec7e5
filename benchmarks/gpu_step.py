"""One DDP step with a compressed hook and one FSDP2 step with a compressed reduce-scatter, on CUDA tensors,
held bit for bit to a CPU reference simulation of the same inputs.

For each configuration (CUDA: NCCL at world size 1, and 2 ranks on the one GPU over gloo with CUDA tensors,
since NCCL refuses two ranks on one GPU; ``--device cpu``: the same script over gloo with CPU tensors, a
check of its logic):

1. The ranks probe which collectives the backend refuses on the device's tensors (gloo on CUDA tensors
   refuses some), then train a small MLP a few steps under DDP with :func:`fastcomm.quantize_hook`, and the
   same MLP under FSDP2 (``fully_shard``) with :func:`fastcomm.fsdp.compress`. A recorder around the hook
   and around each FSDP module's reduce-scatter keeps every call's input and output (on CPU), and times it
   (synchronised): the hook's share of the step is that time over the step's.
2. The simulation: as many CPU processes over gloo, with ``FASTCOMM_NO_NATIVE=1`` (every op is its
   plain-PyTorch twin from :mod:`fastcomm.reference`), build fresh states (the same options and seed) and
   feed the recorded inputs to the same hook and reductions in the recorded order; every output must equal
   the recorded one bit for bit. Both launches go through :func:`benchmarks.common.launch`, time-boxed.

Results: ``gpu_step_<gpu>.md``/``.json`` (``gpu_step_cpu_check`` for ``--device cpu``) in the harness's
output folder (``FASTLIB_BENCH_OUTPUT``), naming the backend and the device of each row.

Run: ``python -m benchmarks.gpu_step`` (needs CUDA), or ``python -m benchmarks.gpu_step --device cpu``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import fastcomm
import fastcomm.fsdp
from benchmarks.common import free_port, launch, rank_env
from benchmarks.gpu_ops_timing import gpu_slug
from benchmarks.harness import Row, markdown_table, write_results
from fastcomm.compress import QuantCompressor

__all__ = ["main"]

_QUANT = {"bits": 8, "block": 256, "stochastic": True, "seed": 11}


@dataclass(frozen=True)
class Options:
    """What one configuration runs: ``world`` ranks over ``backend`` on ``device`` tensors."""

    backend: str
    world: int
    device: str
    width: int
    depth: int
    steps: int
    batch: int


@dataclass
class Call:
    """One recorded hook or reduce-scatter call: what went in and came out (CPU copies), and its time."""

    name: str  # the DDP bucket index, or the FSDP module's name
    step: int
    extra: dict[str, Any]
    x: Tensor
    out: Tensor
    seconds: float


@dataclass
class Record:
    """What a rank of the device run hands to the simulation and the report."""

    rank: int
    step: int = 0  # the step being run, stamped on each call
    refused: dict[str, str] = field(default_factory=dict)
    ddp: list[Call] = field(default_factory=list)
    fsdp: list[Call] = field(default_factory=list)
    direct: list[Call] = field(default_factory=list)
    ddp_step_s: list[float] = field(default_factory=list)
    fsdp_step_s: list[float] = field(default_factory=list)
    direct_step_s: list[float] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


class MLP(nn.Module):
    """``depth`` square layers of ``width`` (plus an odd-sized head, so FSDP pads its shards)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, 7)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _batch(opts: Options, rank: int, step: int, device: torch.device) -> Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(repr((rank, step)).encode()))
    return torch.randn(opts.batch, opts.width, generator=generator).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------- the device run
def _probe(device: torch.device, world: int) -> dict[str, str]:
    """The collectives this backend refuses on ``device`` tensors, each with the first line of its error."""
    rank = dist.get_rank()
    t = torch.ones(world * 4, device=device)
    parts = [torch.ones(4, device=device) for _ in range(world)]
    calls: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: dist.all_reduce(t.clone()),
        "broadcast": lambda: dist.broadcast(t.clone(), 0),
        "all_gather": lambda: dist.all_gather([p.clone() for p in parts], parts[0].clone()),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(t.clone(), parts[0].clone()),
        "reduce_scatter": lambda: dist.reduce_scatter(parts[0].clone(), [p.clone() for p in parts]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(parts[0].clone(), t.clone()),
        "all_to_all": lambda: dist.all_to_all([p.clone() for p in parts], [p.clone() for p in parts]),
        "all_to_all_single": lambda: dist.all_to_all_single(t.clone(), t.clone()),
        "reduce": lambda: dist.reduce(t.clone(), 0),
        "gather": lambda: dist.gather(parts[0].clone(), [p.clone() for p in parts] if rank == 0 else None, 0),
        "scatter": lambda: dist.scatter(
            parts[0].clone(), [p.clone() for p in parts] if rank == 0 else None, 0
        ),
    }
    refused = {}
    for name, call in calls.items():
        try:
            call()
            _sync(device)
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            refused[name] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    return refused


def _ddp_run(opts: Options, rank: int, device: torch.device, record: Record) -> None:
    """DDP steps with the quantize hook, every call recorded (and timed, synchronised)."""
    torch.manual_seed(0)
    model = MLP(opts.width, opts.depth).to(device)
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    ids = [0] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=4)
    state = fastcomm.QuantState(**_QUANT, min_compress_numel=0)

    def hook(state, bucket):  # no annotations: DDP checks them against the real types
        x = bucket.buffer().detach().clone()
        _sync(device)
        start = time.perf_counter()
        out = fastcomm.quantize_hook(state, bucket).wait()
        _sync(device)
        seconds = time.perf_counter() - start
        params = [index_of[id(p)] for p in bucket.parameters()]
        extra = {"params": params, "last": bucket.is_last()}
        out_cpu = out.detach().to("cpu", copy=True)  # a copy on CPU too: DDP reuses the bucket's buffer
        record.ddp.append(Call(str(bucket.index()), record.step, extra, x.cpu(), out_cpu, seconds))
        done: torch.futures.Future[Tensor] = torch.futures.Future()
        done.set_result(out)
        return done

    ddp.register_comm_hook(state, hook)
    _train(ddp, opts, rank, device, record, record.ddp_step_s)


def _train(
    model: nn.Module, opts: Options, rank: int, device: torch.device, record: Record, seconds: list[float]
) -> None:
    """``opts.steps`` SGD steps, each timed (synchronised) into ``seconds`` and stamped on ``record``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(opts.steps):
        record.step = step
        _sync(device)
        start = time.perf_counter()
        model(_batch(opts, rank, step, device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        _sync(device)
        seconds.append(time.perf_counter() - start)


class _Recorder:
    """Delegates to a compressed reduce-scatter and records every call (FSDP calls it as its comm)."""

    def __init__(
        self, name: str, inner: Any, device: torch.device, record: Record, calls: list[Call]
    ) -> None:
        self.name, self.inner, self.device, self.record, self.calls = name, inner, device, record, calls

    def allocate(self, size, *, dtype, device) -> Tensor:  # noqa: ANN001 - FSDP's signature
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False) -> None:  # noqa: ANN001
        x = input_tensor.detach().clone()
        _sync(self.device)
        start = time.perf_counter()
        self.inner(output_tensor, input_tensor, group, op, async_op)
        _sync(self.device)
        seconds = time.perf_counter() - start
        extra = {"op": str(op), "out_numel": output_tensor.numel()}
        out = output_tensor.detach().to("cpu", copy=True)
        self.calls.append(Call(self.name, self.record.step, extra, x.cpu(), out, seconds))


def _fsdp_model(opts: Options, device_type: str) -> tuple[nn.Module, fastcomm.fsdp.FSDPCompression]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (opts.world,))
    torch.manual_seed(0)
    model = MLP(opts.width, opts.depth)
    if device_type == "cuda":
        model = model.cuda()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    quant = {key: value for key, value in _QUANT.items() if key != "seed"}
    return model, fastcomm.fsdp.compress(model, "quantize", seed=_QUANT["seed"], **quant)


def _fsdp_run(opts: Options, rank: int, device: torch.device, record: Record) -> None:
    """FSDP2 steps with the compressed reduce-scatter, every call recorded (and timed, synchronised)."""
    model, compression = _fsdp_model(opts, device.type)
    modules = dict(model.named_modules())
    for name, reduction in compression.reductions.items():
        modules[name].set_custom_reduce_scatter(_Recorder(name, reduction, device, record, record.fsdp))
    _train(model, opts, rank, device, record, record.fsdp_step_s)


def _direct_reduction() -> fastcomm.fsdp.CompressedReduceScatter:
    quant = {key: value for key, value in _QUANT.items() if key != "seed"}
    return fastcomm.fsdp.CompressedReduceScatter(QuantCompressor(**quant), seed=_QUANT["seed"])


def _direct_input(opts: Options, rank: int, step: int) -> Tensor:
    """A flat gradient of ``world`` equal shards (odd-sized), as FSDP hands its reduce-scatter."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr(("direct", rank, step)).encode()))
    return torch.randn(opts.world * (opts.width * opts.width + 1), generator=generator)


def _direct_run(opts: Options, rank: int, device: torch.device, record: Record) -> None:
    """The compressed reduce-scatter called as FSDP calls it, outside FSDP: FSDP2 skips its reduce-scatter
    at world size 1, so this is what runs the compressed exchange over NCCL there."""
    recorder = _Recorder("direct", _direct_reduction(), device, record, record.direct)
    for step in range(opts.steps):
        record.step = step
        x = _direct_input(opts, rank, step).to(device)
        out = torch.empty(x.numel() // opts.world, device=device)
        _sync(device)
        start = time.perf_counter()
        recorder(out, x, dist.group.WORLD, dist.ReduceOp.AVG)
        record.direct_step_s.append(time.perf_counter() - start)


def _device_rank(rank: int, opts: Options, folder: Path) -> None:
    """One rank of the device run (``RANK``, ``MASTER_PORT``... from :func:`benchmarks.common.rank_env`)."""
    device = torch.device("cuda", 0) if opts.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(opts.backend)
    record = Record(rank)
    record.refused = _probe(device, opts.world)
    for part, run in (("ddp", _ddp_run), ("fsdp", _fsdp_run), ("direct", _direct_run)):
        try:
            run(opts, rank, device, record)
        except Exception:  # noqa: BLE001 - reported per part (a refused collective, say); the other goes on
            record.errors[part] = traceback.format_exc(limit=4)
        dist.barrier()
    torch.save(record, folder / f"record_{rank}.pt")
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- simulation
class _Bucket:
    """What the hook uses of ``dist.GradBucket``: index, buffer, parameters, whether it is the last."""

    def __init__(self, index: int, params: list[Tensor], buffer: Tensor, last: bool) -> None:
        self._index, self._params, self._buffer, self._last = index, params, buffer, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> Tensor:
        return self._buffer

    def parameters(self) -> list[Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last


def _same_bits(a: Tensor, b: Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return torch.equal(a.contiguous().view(ints[a.dtype]), b.contiguous().view(ints[b.dtype]))


def _simulate_rank(rank: int, opts: Options, folder: Path) -> None:
    """Feed one device rank's recorded inputs to fresh CPU states; count the outputs that differ."""
    assert os.environ.get("FASTCOMM_NO_NATIVE") == "1" and not fastcomm.backend().native
    dist.init_process_group("gloo")
    record: Record = torch.load(folder / f"record_{rank}.pt", weights_only=False)
    verdict: dict[str, Any] = {}
    if "ddp" not in record.errors:
        params = [torch.zeros_like(p) for p in MLP(opts.width, opts.depth).parameters()]
        state = fastcomm.QuantState(**_QUANT, min_compress_numel=0)
        differ = 0
        for call in record.ddp:
            chosen = [params[i] for i in call.extra["params"]]
            bucket = _Bucket(int(call.name), chosen, call.x.clone(), call.extra["last"])
            differ += not _same_bits(fastcomm.quantize_hook(state, bucket).wait(), call.out)
        verdict["ddp"] = {"calls": len(record.ddp), "differ": differ}
    ops = {str(op): op for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM)}
    for part in ("fsdp", "direct"):
        if part in record.errors:
            continue
        if part == "fsdp":
            cpu = Options("gloo", opts.world, "cpu", opts.width, opts.depth, opts.steps, opts.batch)
            reductions = dict(_fsdp_model(cpu, "cpu")[1].reductions)
        else:
            reductions = {"direct": _direct_reduction()}
        differ = 0
        for call in getattr(record, part):
            out = torch.empty(call.extra["out_numel"], dtype=call.x.dtype)
            reductions[call.name](out, call.x.clone(), dist.group.WORLD, ops[call.extra["op"]])
            differ += not _same_bits(out, call.out.reshape(-1))
        verdict[part] = {"calls": len(getattr(record, part)), "differ": differ}
    torch.save(verdict, folder / f"verdict_{rank}.pt")
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ driver
_ROLES = {"device": _device_rank, "simulate": _simulate_rank}


def _launch(role: str, opts: Options, folder: Path, timeout_s: float, **env: str) -> str:
    """Run ``opts.world`` ranks of ``role`` (this script with ``--role``); '' or why they failed."""
    command = [sys.executable, "-m", "benchmarks.gpu_step", "--role", role, "--folder", str(folder)]
    command += ["--options", json.dumps(dataclasses.asdict(opts))]
    port = free_port()
    ranks = launch(
        [command] * opts.world,
        [rank_env(rank, opts.world, port, **env) for rank in range(opts.world)],
        [folder / f"{role}_{rank}.log" for rank in range(opts.world)],
        timeout_s,
    )
    return "" if ranks.ok else ranks.describe()


def _configure(opts: Options, timeout_s: float) -> tuple[list[Row], list[str]]:
    """Run one configuration and its simulation; its rows and notes."""
    where = f"{opts.backend}, world {opts.world}, {opts.device} tensors"
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu_step_") as temporary:
        folder = Path(temporary)
        failure = _launch("device", opts, folder, timeout_s)
        if failure:
            return [
                Row(f"run ({where})", opts.backend, "failed", float("nan"), "", extra={"why": failure})
            ], notes
        records = [torch.load(folder / f"record_{r}.pt", weights_only=False) for r in range(opts.world)]
        failure = _launch("simulate", opts, folder, timeout_s, FASTCOMM_NO_NATIVE="1")
        verdicts = [
            torch.load(folder / f"verdict_{r}.pt", weights_only=False) if not failure else {}
            for r in range(opts.world)
        ]
    lead = records[0]
    if lead.refused:
        notes.append(f"{where}: refused " + "; ".join(f"{k}: {v}" for k, v in lead.refused.items()))
    else:
        notes.append(f"{where}: every probed collective ran")
    rows = []
    labels = {
        "ddp": ("DDP step, quantize_hook", lead.ddp, lead.ddp_step_s),
        "fsdp": ("FSDP2 step, compressed reduce-scatter", lead.fsdp, lead.fsdp_step_s),
        "direct": ("compressed reduce-scatter called directly", lead.direct, lead.direct_step_s),
    }
    for part, (label, calls, steps) in labels.items():
        errors = [r.errors[part] for r in records if part in r.errors]
        if errors:
            why = errors[0].strip().splitlines()[-1][:200]
            rows.append(
                Row(f"{label} ({where})", opts.backend, "failed", float("nan"), "", extra={"why": why})
            )
            continue
        first = 1 if len(steps) > 1 else 0  # the first step compiles and allocates: untimed
        step_s = sum(steps[first:]) / (len(steps) - first)
        hook_s = sum(c.seconds for c in calls if c.step >= first) / (len(steps) - first)
        sims = [v.get(part) for v in verdicts]
        identical = "" if failure or None in sims else str(all(s["differ"] == 0 for s in sims))
        checked = sum(s["calls"] for s in sims if s) if not failure else 0
        if identical and checked == 0:
            identical = "no calls to check"  # FSDP2 skips its reduce-scatter at world size 1
        rows.append(
            Row(
                f"{label} ({where})", opts.backend, "step time", step_s * 1e3, "ms",
                hook_s / step_s, "hook's share",
                {"bit-identical to CPU reference": identical or f"simulation failed: {failure}",
                 "calls checked": checked, "hook ms": round(hook_s * 1e3, 3)},
            )
        )  # fmt: skip
    return rows, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--width", type=int, default=None, help="MLP width (default 768 on CUDA, 96 on CPU)")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=150, help="seconds per launch of ranks")
    parser.add_argument("--role", choices=sorted(_ROLES), help=argparse.SUPPRESS)  # a rank of a launch
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--options", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        _ROLES[args.role](int(os.environ["RANK"]), Options(**json.loads(args.options)), args.folder)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_step needs a CUDA device (or --device cpu for a check of the script's logic)")
    width = args.width or (768 if args.device == "cuda" else 96)
    batch = 64

    def options(backend: str, world: int) -> Options:
        return Options(backend, world, args.device, width, args.depth, args.steps, batch)

    # NCCL refuses two ranks on one GPU: world size 1 over NCCL, and two ranks over gloo with CUDA tensors.
    configs = (
        [options("nccl", 1), options("gloo", 2)]
        if args.device == "cuda"
        else [options("gloo", 1), options("gloo", 2)]
    )
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    notes = [
        f"device: {gpu}; MLP {args.depth} x {width}^2 (+ a 7-wide head), batch {batch}, {args.steps} steps "
        f"(the first untimed); quantize {_QUANT}. Each hook or reduce-scatter call is timed synchronised "
        f"(so the share is of a step without overlap); the simulation replays every call of every step on "
        f"CPU with FASTCOMM_NO_NATIVE=1 (the reference twins) and compares the outputs bit for bit."
    ]
    name = f"gpu_step_{gpu_slug(gpu)}" if args.device == "cuda" else "gpu_step_cpu_check"
    rows: list[Row] = []
    for opts in configs:
        config_rows, config_notes = _configure(opts, args.timeout)
        rows += config_rows
        notes += config_notes
        print(markdown_table(config_rows), flush=True)
        write_results(name, rows, notes=notes)  # after each configuration: a time box keeps what ran
    print("\n".join(notes))
    verdicts = ("True", "no calls to check")
    bad = [
        r
        for r in rows
        if r.metric == "failed" or r.extra.get("bit-identical to CPU reference") not in verdicts
    ]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
