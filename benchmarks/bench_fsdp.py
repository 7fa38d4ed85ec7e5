"""bench_fsdp: fastcomm.fsdp against dense FSDP2 on 2 gloo ranks: loss, step time, bytes, memory.

1. Loss: a student MLP (nested ``fully_shard`` on every layer and the root) fits a fixed random teacher
   MLP with Adam for ``--loss-steps`` steps, each method from the same weights and batches; the row is the
   validation MSE on 2,048 held-out samples, beside dense FSDP2's. Targets: 8-bit within 0.5% of dense,
   sign with error feedback within 2%.
2. Speed: a ``--width`` x ``--depth`` MLP (2048 x 6: 25M parameters), every layer and the root sharded
   (FSDP2's defaults: weights all-gathered for forward and again for backward), SGD; the slower rank's
   median step time over ``--timed`` steps after ``--warmup``, on loopback and, where
   :mod:`benchmarks.netlab` works (root, ``ip``, ``tc``), over a 1 Gbit/s tbf link between two namespaces.
   Target: 8-bit no slower than 1.1x dense on loopback, at least 2x faster on the 1 Gbit/s link.
3. Correctness, memory and bytes, from the loss runs: the relative error of each method's first reduced
   gradient against dense FSDP2's (same weights, same batches), its error-feedback bytes per parameter on
   one rank and its compression ratio of the reduce-scatter (``stats()``).

Every method of a part runs in one pair of rank processes (``--rank-spec``), one after the other.

Example::

    python -m benchmarks.bench_fsdp --loss-steps 120 --width 1024   # a short run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks import harness, netlab

__all__ = ["METHODS", "main"]

_REPO_ROOT = Path(__file__).resolve().parent.parent
# method -> fastcomm.fsdp.compress arguments (None: dense FSDP2)
METHODS: dict[str, dict[str, Any] | None] = {
    "dense": None,
    "q8": {"compressor": "quantize", "bits": 8, "stochastic": False},
    "q8-bf16-residual": {
        "compressor": "quantize",
        "bits": 8,
        "stochastic": False,
        "residual_dtype": "bfloat16",
    },
    "q8-stochastic-no-ef": {"compressor": "quantize", "bits": 8, "stochastic": True, "error_feedback": False},
    "q4": {"compressor": "quantize", "bits": 4, "block": 64, "stochastic": False},
    "sign-ef": {"compressor": "sign"},
    "q8-qwz": {"compressor": "quantize", "bits": 8, "stochastic": False, "quantized_all_gather": True},
}
LOSS_METHODS = ("dense", "q8", "q8-bf16-residual", "q8-stochastic-no-ef", "q4", "sign-ef", "q8-qwz")
SPEED_METHODS = ("dense", "q8", "q8-qwz")
LINK_RATE = "1gbit"
IN_DIM, OUT_DIM, HIDDEN, BATCH, VAL = 32, 8, 129, 64, 2048


# ------------------------------------------------------------------------------------------ rank side
def _compress(model: Any, method: str) -> Any:
    import torch

    import fastcomm.fsdp

    options = METHODS[method]
    if options is None:
        return None
    options = dict(options)
    if "residual_dtype" in options:
        options["residual_dtype"] = getattr(torch, options["residual_dtype"])
    return fastcomm.fsdp.compress(model, options.pop("compressor"), **options)


def _mlp(widths: Sequence[int]) -> Any:
    from torch import nn

    layers: list[nn.Module] = []
    for index, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if index < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _shard(model: Any, mesh: Any) -> None:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


_DENSE_FIRST_GRAD: dict[str, Any] = {}


def _first_grad_error(model: Any, method: str) -> float:
    """``||g - g_dense|| / ||g_dense||`` of the first step's reduced gradient (same weights and batches);
    the dense run (first in the process) keeps its own."""
    import torch
    import torch.distributed as dist

    grad = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
    if method == "dense":
        _DENSE_FIRST_GRAD["grad"] = grad.clone()
    dense = _DENSE_FIRST_GRAD.get("grad")
    if dense is None:
        return float("nan")
    sums = torch.stack([(grad - dense).square().sum(), dense.square().sum()])
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).sqrt().item()


def _loss_run(method: str, steps: int, rank: int, mesh: Any) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    teacher = _mlp([IN_DIM, 64, 64, OUT_DIM])
    torch.manual_seed(1)
    model = _mlp([IN_DIM, HIDDEN, HIDDEN, HIDDEN, OUT_DIM])
    _shard(model, mesh)
    compression = _compress(model, method)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    val_x = torch.randn(VAL, IN_DIM, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        val_y = teacher(val_x)
    grad_error = float("nan")
    for step in range(steps):
        x = torch.randn(BATCH, IN_DIM, generator=torch.Generator().manual_seed(step * 7 + rank))
        with torch.no_grad():
            y = teacher(x) + 0.05 * torch.randn(BATCH, OUT_DIM, generator=torch.Generator().manual_seed(step))
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 0:
            grad_error = _first_grad_error(model, method)
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 and rank == 0:
            print(f"{method} step {step}/{steps}", flush=True)
    with torch.no_grad():
        val = torch.nn.functional.mse_loss(model(val_x), val_y).item()
    params = sum(p.numel() for p in _mlp([IN_DIM, HIDDEN, HIDDEN, HIDDEN, OUT_DIM]).parameters())
    stats = compression.stats() if compression is not None else {}
    return {
        "val_loss": val,
        "grad_rel_error": grad_error,
        "residual_bytes_per_param": stats.get("residual_bytes", 0) / params,
        "compression_ratio": stats.get("compression_ratio", 1.0),
        "params": params,
    }


def _speed_run(method: str, width: int, depth: int, warmup: int, timed: int, rank: int, mesh: Any) -> dict:
    import torch
    import torch.distributed as dist

    torch.manual_seed(1)
    model = _mlp([width] * (depth + 1))
    _shard(model, mesh)
    _compress(model, method)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(rank))
    times = []
    for step in range(warmup + timed):
        dist.barrier()
        start = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"{method} step {step + 1}/{warmup + timed}", flush=True)
    slowest = torch.tensor([statistics.median(times)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"step_s": slowest.item(), "params": sum(p.numel() for p in model.parameters())}


def _rank_main(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout_s"]))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for method in spec["methods"]:
        if spec["job"] == "loss":
            results[method] = _loss_run(method, spec["steps"], rank, mesh)
        else:
            results[method] = _speed_run(
                method, spec["width"], spec["depth"], spec["warmup"], spec["timed"], rank, mesh
            )
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ parent side
def _launch(spec: dict[str, Any], link: netlab.Link | None, label: str, timeout_s: float) -> dict[str, Any]:
    """Run the job on 2 rank processes (on ``link``'s two sides, or loopback); rank 0's results."""
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_") as tmp:
        out = Path(tmp) / "results.json"
        procs, logs = [], []
        pythonpath = os.pathsep.join(filter(None, (str(_REPO_ROOT), os.environ.get("PYTHONPATH"))))
        try:
            for rank in range(2):
                env = dict(
                    os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, RANK=str(rank), WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1" if link is None else link.addresses[0], MASTER_PORT="29417",
                    GLOO_SOCKET_IFNAME="lo" if link is None else link.interfaces[rank],
                )  # fmt: skip
                prefix = [] if link is None else link.exec_prefix(rank)
                rank_spec = json.dumps({**spec, "out": str(out), "timeout_s": timeout_s})
                command = [*prefix, sys.executable, "-m", "benchmarks.bench_fsdp", "--rank-spec", rank_spec]
                logs.append(Path(tmp) / f"rank{rank}.log")
                with logs[-1].open("wb") as log:
                    procs.append(
                        subprocess.Popen(
                            command, cwd=_REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )  # fmt: skip
            deadline, seen = time.monotonic() + timeout_s, 0
            with harness.heartbeat(f"bench_fsdp {label}"):
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    lines = logs[0].read_text(errors="replace").splitlines()
                    for line in lines[seen:]:
                        if " step " in line:
                            harness.progress(f"{label}: {line}")
                    seen = len(lines)
                    if any(p.returncode not in (None, 0) for p in procs):
                        break
                    time.sleep(0.5)
        finally:
            harness.kill_process_groups(procs)
        if not out.exists():
            tail = "\n".join(logs[0].read_text(errors="replace").splitlines()[-5:])
            raise RuntimeError(
                f"bench_fsdp {label} failed (exit codes {[p.returncode for p in procs]}):\n{tail}"
            )
        return json.loads(out.read_text())


def _speed_rows(results: dict[str, Any], case: str) -> list[harness.Row]:
    dense = results["dense"]["step_s"]
    return [
        harness.Row(
            case, method, "step_time", r["step_s"], "s", r["step_s"] / dense, "dense", {"params": r["params"]}
        )  # fmt: skip
        for method, r in results.items()
    ]


def _notes(loss: dict[str, Any], speeds: dict[str, dict[str, Any]]) -> list[str]:
    dense = loss["dense"]["val_loss"]
    notes = []
    for method, target in (("q8", 0.005), ("sign-ef", 0.02)):
        if method in loss:
            gap = loss[method]["val_loss"] / dense - 1
            verdict = "meets" if gap <= target else "misses"
            notes.append(
                f"{method} validation loss {gap:+.2%} vs dense (lower is better): {verdict} the target of at "
                f"most {target:.1%} above"
            )
    for case, results in speeds.items():
        for method in ("q8", "q8-qwz"):
            if method in results:
                ratio = results["dense"]["step_s"] / results[method]["step_s"]
                target = "1/1.1x (loopback)" if case == "loopback" else "2x (1 Gbit/s)"
                notes.append(f"{case}: {method} is {ratio:.2f}x dense's speed (target {target})")
    return notes


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss-steps", type=int, default=400)
    parser.add_argument("--loss-methods", default=",".join(LOSS_METHODS))
    parser.add_argument("--speed-methods", default=",".join(SPEED_METHODS))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timed", type=int, default=5)
    parser.add_argument("--network", choices=("loopback", "1gbit", "both"), default="both")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch of 2 ranks")
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_spec:
        _rank_main(json.loads(args.rank_spec))
        return ""
    loss_spec = {"job": "loss", "methods": args.loss_methods.split(","), "steps": args.loss_steps}
    harness.progress(f"bench_fsdp: loss, {args.loss_steps} steps x {len(loss_spec['methods'])} methods")
    loss = _launch(loss_spec, None, "loss", args.timeout)
    rows = [
        harness.Row(
            "loss",
            method,
            "val_loss",
            r["val_loss"],
            "mse",
            r["val_loss"] / loss["dense"]["val_loss"],
            "dense",
            {"params": r["params"]},
        )  # fmt: skip
        for method, r in loss.items()
    ]
    rows += [harness.Row("correctness", m, "first_grad_rel_error", r["grad_rel_error"], "relative L2")
             for m, r in loss.items()]  # fmt: skip
    rows += [harness.Row("memory", m, "residual_bytes_per_param", r["residual_bytes_per_param"], "B/param")
             for m, r in loss.items()]  # fmt: skip
    rows += [harness.Row("traffic", m, "reduce_scatter_compression", r["compression_ratio"], "x")
             for m, r in loss.items()]  # fmt: skip
    speed_spec = {"job": "speed", "methods": args.speed_methods.split(","), "width": args.width,
                  "depth": args.depth, "warmup": args.warmup, "timed": args.timed}  # fmt: skip
    speeds: dict[str, dict[str, Any]] = {}
    notes = [f"2 gloo ranks; speed model {args.width} x {args.depth} MLP, every layer and the root sharded"]
    if args.network in ("loopback", "both"):
        harness.progress("bench_fsdp: speed on loopback")
        speeds["loopback"] = _launch(speed_spec, None, "loopback", args.timeout)
        rows += _speed_rows(speeds["loopback"], "speed-loopback")
    if args.network in ("1gbit", "both"):
        reason = netlab.unavailable_reason()
        if reason is not None:
            print(f"skip bench_fsdp 1gbit link: {reason}", flush=True)
        else:
            harness.progress(f"bench_fsdp: speed over a {LINK_RATE} link")
            with netlab.Link(rate=LINK_RATE) as link:
                speeds["1gbit"] = _launch(speed_spec, link, LINK_RATE, args.timeout)
            rows += _speed_rows(speeds["1gbit"], "speed-1gbit")
    notes += _notes(loss, speeds)
    table = harness.write_results("bench_fsdp", rows, notes=notes, plot_metric="step_time")
    print(table)
    return table


if __name__ == "__main__":
    main()
