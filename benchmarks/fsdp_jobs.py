"""The rank side of bench_fsdp: one function per job, each run by every rank of a launch, method by method.

* :func:`loss_run`: a student MLP fits a fixed teacher with Adam (validation MSE, first gradient's error).
* :func:`speed_run`: the median step time of a wide MLP, and the bytes its rank sent over the link.
* :func:`memory_run`: peak and between-step resident bytes of a rank over a few Adam steps.
* :func:`hsdp_run`: 2 replicas x ``W/2`` shards, dense native HSDP or the replicate-only compression; step
  time and the bytes that crossed the node link.
* :func:`lm_run`: ``examples/train_lm.py`` under FSDP2 (``TrainConfig(fsdp=True)``).

Each returns a plain dict (JSON) that the parent side (:mod:`benchmarks.bench_fsdp`) turns into rows.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import lm_methods

__all__ = [
    "LAYOUTS",
    "METHODS",
    "hsdp_run",
    "lm_run",
    "loss_run",
    "memory_run",
    "speed_run",
    "status_bytes",
]

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
IN_DIM, OUT_DIM, HIDDEN, BATCH, VAL = 32, 8, 129, 64, 2048
# speed layout -> (the parameters' compute dtype, reshard_after_forward); gradients are reduced in fp32
LAYOUTS: dict[str, tuple[str | None, bool]] = {
    "fp32": (None, True),  # FSDP2's defaults: fp32 all-gathered for forward and again for backward
    "fp32-keep": (None, False),  # one fp32 all-gather per step, unsharded from forward to backward
    "bf16": ("bfloat16", True),  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    "bf16-keep": ("bfloat16", False),
}


def _compress(model: Any, method: str, **extra: Any) -> Any:
    import torch

    import fastcomm.fsdp

    options = METHODS[method]
    if options is None:
        return None
    options = dict(options)
    if "residual_dtype" in options:
        options["residual_dtype"] = getattr(torch, options["residual_dtype"])
    return fastcomm.fsdp.compress(model, options.pop("compressor"), **options, **extra)


def _mlp(widths: Sequence[int]) -> Any:
    from torch import nn

    layers: list[nn.Module] = []
    for index, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if index < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _shard(model: Any, mesh: Any, layout: str = "fp32") -> None:
    """``fully_shard`` every ``Linear`` and the root, parameters held as :data:`LAYOUTS` says."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype, reshard = LAYOUTS[layout]
    policy = MixedPrecisionPolicy(
        param_dtype=None if param_dtype is None else getattr(torch, param_dtype), reduce_dtype=torch.float32
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)


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


def loss_run(method: str, spec: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    """Student MLP vs a fixed teacher, Adam, ``spec["steps"]`` steps, sharded as ``spec["layout"]`` says
    (:data:`LAYOUTS`); validation MSE and bytes."""
    import torch

    steps = spec["steps"]
    torch.manual_seed(0)
    teacher = _mlp([IN_DIM, 64, 64, OUT_DIM])
    torch.manual_seed(1)
    model = _mlp([IN_DIM, HIDDEN, HIDDEN, HIDDEN, OUT_DIM])
    _shard(model, mesh, spec.get("layout", "fp32"))
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
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        if step == 0:
            grad_error = _first_grad_error(model, method)
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 and rank == 0:
            print(f"{method} step {step}/{steps}", flush=True)
    with torch.no_grad():
        val = torch.nn.functional.mse_loss(model(val_x).float(), val_y).item()
    params = sum(p.numel() for p in _mlp([IN_DIM, HIDDEN, HIDDEN, HIDDEN, OUT_DIM]).parameters())
    stats = compression.stats() if compression is not None else {}
    return {
        "val_loss": val,
        "grad_rel_error": grad_error,
        "residual_bytes_per_param": stats.get("residual_bytes", 0) / params,
        "compression_ratio": stats.get("compression_ratio", 1.0),
        "params": params,
    }


def _read_counter(path: str | None) -> int:
    return 0 if path is None else int(Path(path).read_text().strip())


def _timed_steps(model: Any, optimizer: Any, x: Any, spec: dict[str, Any], label: str, rank: int) -> dict:
    """``warmup + timed`` steps, a barrier before each; the slower rank's median step time and the link
    bytes (``spec["counter"]``: this rank's veth tx counter, or None) over the timed steps, all ranks
    summed."""
    import torch
    import torch.distributed as dist

    times, sent = [], 0
    for step in range(spec["warmup"] + spec["timed"]):
        dist.barrier()
        if step == spec["warmup"]:
            sent = -_read_counter(spec.get("counter"))
        start = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= spec["warmup"]:
            times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"{label} step {step + 1}/{spec['warmup'] + spec['timed']}", flush=True)
    dist.barrier()
    sent += _read_counter(spec.get("counter"))
    slowest = torch.tensor([statistics.median(times)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    link = torch.tensor([sent], dtype=torch.float64)
    dist.all_reduce(link)
    counted = spec.get("counter") is not None
    link_bytes = link.item() / spec["timed"]
    return {"step_s": slowest.item(), "link_bytes_per_step": link_bytes if counted else None}


def speed_run(method: str, spec: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    """A ``width x depth`` MLP, every layer and the root sharded as ``spec["layout"]`` says (:data:`LAYOUTS`),
    SGD: step time and link bytes."""
    import torch

    torch.manual_seed(1)
    model = _mlp([spec["width"]] * (spec["depth"] + 1))
    _shard(model, mesh, spec.get("layout", "fp32"))
    compression = _compress(model, method)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(16, spec["width"], generator=torch.Generator().manual_seed(rank))
    result = _timed_steps(model, optimizer, x, spec, method, rank)
    result["params"] = sum(p.numel() for p in model.parameters())
    if compression is not None:
        stats = compression.stats()
        result["traffic"] = {
            k: stats[k] / stats["steps"]
            for k in ("sent_bytes", "dense_bytes", "gather_sent_bytes", "gather_dense_bytes")
        }
    return result


def status_bytes(field: str, status: str | None = None) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``: the peak since the last reset) in
    bytes; ``status`` is that file's text (read now when None)."""
    text = Path("/proc/self/status").read_text() if status is None else status
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    raise KeyError(f"/proc/self/status has no {field!r} line")


def _reset_peak_rss() -> None:
    """Make ``VmHWM`` start again from the current resident size (Linux: 5 to ``clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def memory_run(method: str, spec: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    """Adam on a ``width x depth`` MLP for ``spec["steps"]`` steps; this rank's resident bytes.

    1. Build the model on the meta device, shard it, then materialise only the shards (no full copy ever
       sits in memory), compress it, build the optimizer.
    2. Note the resident size and reset the kernel's peak (``VmHWM``); the parent starts the ranks with a
       fixed ``MALLOC_MMAP_THRESHOLD_``, so every tensor over 64 KiB is its own mapping, resident while
       live and returned when freed.
    3. Train; peak = the sharded parameters + (``VmHWM`` - the noted size), persistent = the sharded
       parameters + what stays resident after the last ``zero_grad`` (moments, residuals).
    """
    import torch
    import torch.distributed as dist

    with torch.device("meta"):
        model = _mlp([spec["width"]] * (spec["depth"] + 1))
    _shard(model, mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.02)
    compression = _compress(model, method)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(16, spec["width"], generator=torch.Generator().manual_seed(rank))
    held = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    gc.collect()
    dist.barrier()
    before = status_bytes("VmRSS")
    _reset_peak_rss()
    for _ in range(spec["steps"]):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    gc.collect()
    status = Path("/proc/self/status").read_text()
    peak, after = status_bytes("VmHWM", status) - before, status_bytes("VmRSS", status) - before
    both = torch.tensor([held + peak, held + after], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{method} step {spec['steps']}/{spec['steps']}", flush=True)
    params = sum(p.numel() for p in model.parameters())
    residual = compression.stats()["residual_bytes"] if compression is not None else 0
    return {
        "peak_bytes": both[0].item(),
        "persistent_bytes": both[1].item(),
        "residual_bytes": residual,
        "params": params,
    }


def hsdp_run(method: str, spec: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    """HSDP on a (2 replicas, ``W/2`` shards) mesh: ``dense`` is FSDP2's native HSDP (the model on the 2-D
    mesh, its dense cross-replica all-reduce); any other method shards on ``mesh["shard"]`` and compresses
    the cross-replica all-reduce only (``replicate_group=``). Step time, the bytes the node link carried
    (veth counters, both directions) and the cross-replica payload each rank counted, all ranks summed."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(1)
    model = _mlp([spec["width"]] * (spec["depth"] + 1))
    if METHODS[method] is None:
        _shard(model, mesh2d)
        compression = None
    else:
        _shard(model, mesh2d["shard"])
        compression = _compress(model, method, replicate_group=mesh2d.get_group("replicate"))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(16, spec["width"], generator=torch.Generator().manual_seed(rank))
    result = _timed_steps(model, optimizer, x, spec, f"hsdp {method}", rank)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    if compression is None:  # a ring all-reduce over 2 replicas sends 2 (R - 1) / R of the shard
        payload = 2 * (2 - 1) * shard_bytes / 2
    else:
        stats = compression.stats()
        payload = stats["sent_bytes"] / stats["steps"]
    total = torch.tensor([payload], dtype=torch.float64)
    dist.all_reduce(total)
    result["payload_bytes_per_step"] = total.item()
    result["params"] = sum(p.numel() for p in model.parameters())
    return result


def lm_run(method: str, spec: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    """``examples/train_lm.py`` with method ``method`` of :mod:`benchmarks.lm_methods` under FSDP2 for
    ``spec["steps"]`` steps; a run whose training loss turns non-finite ends there, with ``val_loss`` NaN
    and ``diverged`` saying where."""
    train_lm = lm_methods.load_example()
    paths = train_lm.prepare_data(train_lm.default_data_dir())
    fields = lm_methods.config_fields(method)
    config = train_lm.TrainConfig(steps=spec["steps"], fsdp=True, eval_every=50, log_every=25, **fields)
    try:
        result = train_lm.train(config, paths, log=lambda line: print(line, flush=True))
    except FloatingPointError as error:  # every rank holds the same weights: all of them stop at this step
        chosen = lm_methods.METHODS[method]
        params = sum(p.numel() for p in train_lm.GPT(config.model).parameters())
        return {"val_loss": float("nan"), "diverged": str(error), "val_steps": [], "val_losses": [],
                "step_s": float("nan"), "params": params, "optimizer": chosen.optimizer,
                "description": chosen.description, "stats": None}  # fmt: skip
    return {
        "val_loss": result.val_losses[-1],
        "val_steps": result.val_steps,
        "val_losses": result.val_losses,
        "step_s": statistics.median(result.step_seconds),
        "params": result.parameters,
        "optimizer": lm_methods.METHODS[method].optimizer,
        "description": lm_methods.METHODS[method].description,
        "stats": result.hook_stats,
    }
