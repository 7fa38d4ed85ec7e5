"""The rank side of :mod:`benchmarks.bench_hooks`: its configurations (which hook, which buckets, which
node size), the model, and what one rank process does (:func:`rank_main`: build the hook, warm up, time
the steps, write its numbers).

A configuration is a row name and what it needs; :func:`make_hook` turns its name into a registered hook.
This module does not postpone annotations: DDP compares a hook's annotations with the real classes.

Example::

    state, hook = make_hook("quant8", {})
    ddp.register_comm_hook(state, hook)
"""

import concurrent.futures
import dataclasses
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.harness import time_call

__all__ = [
    "AUTO_SETTLE_STEPS",
    "BATCH",
    "BY_NAME",
    "CONFIGS",
    "FASTCOMM_CONFIGS",
    "HIERARCHICAL",
    "LAYERS",
    "LINK_RATE",
    "NETWORKS",
    "NODES_NETWORK",
    "NODES_RESULTS",
    "NODE_CONFIGS",
    "NODE_RANKS",
    "POWERSGD_MIN_COMPRESSION_RATE",
    "POWERSGD_RANK",
    "Config",
    "make_hook",
    "rank_main",
    "stats_delta",
]

LAYERS = (1024, 4096, 4096, 1024)
BATCH = 64
POWERSGD_RANK = 4
# torch's PowerSGDState default: a matrix is sent uncompressed unless the factors are 2x smaller.
POWERSGD_MIN_COMPRESSION_RATE = 2.0
LINK_RATE = "1gbit"
NETWORKS = ("loopback", "netlab")


@dataclasses.dataclass(frozen=True)
class Config:
    """One hook configuration: its row name, what it is, and the fastcomm names it needs (if any)."""

    name: str
    description: str
    fastcomm_names: tuple[str, ...] = ()
    bucket_cap_mb: float | None = None  # None: DDP's default buckets
    # fastcomm's node_size option: ranks per node for hierarchical compression, 1 for flat; None: not passed
    # (then fastcomm reads LOCAL_WORLD_SIZE, which the nodes network sets as torchrun would)
    node_size: int | None = None


# auto runs as register(ddp, "auto") does: 4 dense warm-up steps, the measurement, then 3 trial steps of
# its choice and 3 dense steps to compare them with, after which it keeps the choice or reverts to dense.
# Its timed steps come after all of that, so it gets these steps on top of the common warm-up: the table
# shows the state a long job runs in, not the trial.
AUTO_SETTLE_STEPS = 4 + 3 + 3

CONFIGS = (
    Config("allreduce", "dense fp32 allreduce, no hook"),
    Config("noop", "no-op hook: no communication (compute floor)"),
    Config("torch_fp16", "torch fp16_compress_hook"),
    Config("torch_powersgd_r4", f"torch powerSGD_hook, rank {POWERSGD_RANK}"),
    # With several buckets, powerSGD's follow-up collectives are launched from future callbacks, whose order
    # can differ between ranks; gloo then fails on a size mismatch. One bucket keeps the order fixed.
    Config("torch_powersgd_r4_1bucket", f"torch powerSGD_hook, rank {POWERSGD_RANK}, one 200 MB DDP bucket",
           bucket_cap_mb=200.0),
    Config("bf16_cast", "fastcomm.cast_hook, CastState(dtype=bfloat16)", ("cast_hook", "CastState")),
    Config("topk_0.01", "fastcomm.topk_hook, TopKState(ratio=0.01)", ("topk_hook", "TopKState")),
    Config("quant8", "fastcomm.quantize_hook, QuantState(bits=8)", ("quantize_hook", "QuantState")),
    Config("quant4", "fastcomm.quantize_hook, QuantState(bits=4)", ("quantize_hook", "QuantState")),
    Config("sign", "fastcomm.sign_hook, SignState()", ("sign_hook", "SignState")),
    Config("powersgd_r4", f"fastcomm.powersgd_hook, PowerSGDState(rank={POWERSGD_RANK}), default buckets",
           ("powersgd_hook", "PowerSGDState")),
    Config("auto", "fastcomm.register(ddp, 'auto'): 4 dense steps, its measurement, 3 trial steps of "
           "its choice and 3 dense ones (kept or reverted), before the warm-up "
           f"({AUTO_SETTLE_STEPS} extra steps); q8, q4, cast, dense",
           ("auto_hook", "AutoState")),
)
FASTCOMM_CONFIGS = tuple(c.name for c in CONFIGS if c.fastcomm_names)

# The "nodes" network: 2 nodes x NODE_RANKS ranks (netlab.Nodes), flat hooks beside hierarchical ones. The
# flat ones say node_size=1: the ranks see LOCAL_WORLD_SIZE=2, which would make fastcomm's default
# hierarchical.
NODES_NETWORK = "nodes"
NODES_RESULTS = "bench_hooks_nodes"  # its own files: running it alone leaves bench_hooks.* as they are
NODE_RANKS = 2
BY_NAME = {c.name: c for c in CONFIGS}
NODE_CONFIGS = (
    BY_NAME["allreduce"],
    BY_NAME["noop"],
    Config("sign", "fastcomm.sign_hook, SignState(node_size=1): flat, the 4 ranks as equals",
           ("sign_hook", "SignState"), node_size=1),
    Config("sign_hier", f"fastcomm.sign_hook, SignState(node_size={NODE_RANKS}): dense reduce-scatter in the "
           "node, sign across nodes per local rank, all-gather in the node", ("sign_hook", "SignState"),
           node_size=NODE_RANKS),
    Config("quant8", "fastcomm.quantize_hook, QuantState(bits=8, node_size=1): flat, the 4 ranks as equals",
           ("quantize_hook", "QuantState"), node_size=1),
    Config("quant8_hier", f"fastcomm.quantize_hook, QuantState(bits=8, node_size={NODE_RANKS}): dense "
           "reduce-scatter in the node, 8-bit across nodes per local rank, all-gather in the node",
           ("quantize_hook", "QuantState"), node_size=NODE_RANKS),
    # what any two-level scheme that reduces densely inside the node pays before it sends a byte across
    Config("node_reduce", "each 1/L shard of a bucket reduced to its owner inside the node, as hierarchical "
           "does over gloo, and nothing more (not a training method: step 1 of hierarchical's work, which "
           "the issue's scheme must do densely; a lower bound on a hierarchical step)"),
    # a 1/L shard would cut PowerSGD's matrices: fastcomm has it flat only
    Config("powersgd_r4", f"fastcomm.powersgd_hook, PowerSGDState(rank={POWERSGD_RANK}, node_size=1), "
           "default buckets: flat", ("powersgd_hook", "PowerSGDState"), node_size=1),
)
HIERARCHICAL = frozenset(c.name for c in NODE_CONFIGS if c.node_size and c.node_size > 1)


def _node_group() -> dist.ProcessGroup:
    """This rank's node group (``LOCAL_WORLD_SIZE`` consecutive ranks); every rank makes every node's."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", NODE_RANKS))
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(start, start + local))) for start in range(0, world, local)]
    return groups[rank // local]


def _node_reduce_hook(
    group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Each rank's 1/L shard of the bucket summed onto it over the node's group (node_reduce: a bound).

    Each shard sent to its owner, which adds the node's copies and divides by L, as
    :mod:`fastcomm.hooks.hierarchical` does over gloo (its fastest in-node reduction there); the
    bucket's other shards are left as they are (no gather, nothing across nodes).
    """
    buffer, size = bucket.buffer(), dist.get_world_size(group)
    local = dist.get_rank() % size  # the node's ranks are consecutive (_node_group)
    first, shard = dist.get_rank() - local, -(-buffer.numel() // size)
    own = buffer[local * shard : (local + 1) * shard]
    received = _NODE_REDUCE_BUFFERS.get(bucket.index())
    if received is None or received.shape != (size, own.numel()):
        # kept from step to step, as hierarchical keeps its own (fresh memory costs page faults every step)
        received = _NODE_REDUCE_BUFFERS[bucket.index()] = torch.empty(size, own.numel())
    works = []
    for r in range(size):
        piece = buffer[r * shard : (r + 1) * shard]
        if r != local and own.numel():
            works.append(dist.irecv(received[r], src=first + r, group=group))
        if r != local and piece.numel():
            works.append(dist.isend(piece, dst=first + r, group=group))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def finish() -> None:  # off the hook's thread, as hierarchical's cross-node thread does
        try:
            for work in works:
                work.wait()
            for r in range(size):
                if r != local and own.numel():
                    own.add_(received[r])
            own.div_(size)
        except Exception as error:  # noqa: BLE001 - reaches DDP's wait
            future.set_exception(error)
        else:
            future.set_result(buffer)

    _NODE_REDUCE_WORKER.submit(finish)
    return future


_NODE_REDUCE_WORKER = concurrent.futures.ThreadPoolExecutor(max_workers=1)
_NODE_REDUCE_BUFFERS: dict[int, torch.Tensor] = {}  # bucket index -> the copies its shard receives


# DDP compares these annotations with the real classes, so this module must not postpone annotations.
def _noop_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Return the bucket's own gradients in a completed future, communicating nothing."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def make_hook(
    name: str, state_kwargs: dict[str, Any] | None = None
) -> tuple[Any, Callable[..., Any]] | None:
    """The ``(state, hook)`` pair of configuration ``name``, or ``None`` for plain allreduce.

    ``state_kwargs`` go to a fastcomm state's constructor (the hierarchical rows' ``node_size``); a
    configuration named ``<base>_hier`` is ``<base>``'s hook with them.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "allreduce":
        return None
    if name == "noop":
        return None, _noop_hook
    if name == "node_reduce":
        return _node_group(), _node_reduce_hook
    if name == "torch_fp16":
        return None, default_hooks.fp16_compress_hook
    if name.startswith("torch_powersgd_r4"):
        # start_powerSGD_iter=2 (the smallest allowed with error feedback) so warm-up covers the plain
        # allreduce iterations and every timed step is compressed.
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=2,
            min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE,
        )
        return state, powerSGD_hook.powerSGD_hook

    import fastcomm

    fastcomm_pairs: dict[str, Callable[..., tuple[Any, Callable[..., Any]]]] = {
        "bf16_cast": lambda **kw: (fastcomm.CastState(dtype=torch.bfloat16, **kw), fastcomm.cast_hook),
        "topk_0.01": lambda **kw: (fastcomm.TopKState(ratio=0.01, **kw), fastcomm.topk_hook),
        "quant8": lambda **kw: (fastcomm.QuantState(bits=8, **kw), fastcomm.quantize_hook),
        "quant4": lambda **kw: (fastcomm.QuantState(bits=4, **kw), fastcomm.quantize_hook),
        "sign": lambda **kw: (fastcomm.SignState(**kw), fastcomm.sign_hook),
        "powersgd_r4": lambda **kw: (
            fastcomm.PowerSGDState(rank=POWERSGD_RANK, **kw), fastcomm.powersgd_hook
        ),
        "auto": lambda **kw: (fastcomm.hooks.AutoState(**kw), fastcomm.hooks.auto_hook),
    }
    return fastcomm_pairs[name.removesuffix("_hier")](**(state_kwargs or {}))


def _mlp() -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(LAYERS[:-1], LAYERS[1:], strict=True)):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i < len(LAYERS) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _hook_stats(state: object) -> dict[str, float] | None:
    stats = getattr(state, "stats", None)
    return {k: float(v) for k, v in stats().items()} if callable(stats) else None


def stats_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """The hook's counters over the timed steps only (warm-up allocates residuals and rebuilds buckets);
    auto's state (``auto_*``: its choice, its trial's medians) as it stands after them."""
    if before is None or after is None:
        return None
    delta = {k: after[k] if k.startswith("auto_") else after[k] - before[k]
             for k in after if k != "compression_ratio"}  # fmt: skip
    if delta.get("sent_bytes"):
        delta["compression_ratio"] = delta.get("dense_bytes", 0.0) / delta["sent_bytes"]
    return delta


def _profile_step(step: Callable[[], None]) -> str:
    """Run ``step`` once under the CPU profiler; return the ops that took the most time of their own."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        step()
    return str(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _floor_step(
    cap: float | None, inputs: torch.Tensor, targets: torch.Tensor
) -> Callable[[], None]:
    """A step of a second DDP model, the same MLP with the no-op hook: the compute floor, for timing beside
    each step of the configuration (``paired_floor``)."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_mlp(), **({"bucket_cap_mb": cap} if cap is not None else {}))
    ddp.register_comm_hook(None, _noop_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()

    return step


def _paired_times(
    step: Callable[[], None], floor_step: Callable[[], None], steps: int
) -> tuple[float, float, float]:
    """Median seconds of ``step`` and of ``floor_step``, timed in turn so that a machine's changing load hits
    both alike, and CPU seconds per ``step`` (every thread of the rank)."""
    times, floors, cpu = [], [], 0.0
    for _ in range(steps):
        start = time.perf_counter()
        floor_step()
        floors.append(time.perf_counter() - start)
        cpu_before, start = time.process_time(), time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        cpu += time.process_time() - cpu_before
    return statistics.median(times), statistics.median(floors), cpu / steps


def rank_main(spec: dict[str, Any]) -> None:
    """Run one configuration on one rank and write its median step time and hook stats to ``spec['out']``."""
    torch.set_num_threads(1)
    rank = spec["rank"]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{spec['master_addr']}:{spec['port']}",
        rank=rank,
        world_size=spec["world_size"],
        timeout=timedelta(seconds=spec["timeout_s"]),
    )
    try:
        torch.manual_seed(0)
        cap = spec["bucket_cap_mb"]
        ddp = DistributedDataParallel(_mlp(), **({"bucket_cap_mb": cap} if cap is not None else {}))
        pair = make_hook(spec["config"], spec.get("state_kwargs"))
        state = None
        if pair is not None:
            state, hook = pair
            ddp.register_comm_hook(state, hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(1 + rank)
        inputs = torch.randn(BATCH, LAYERS[0], generator=generator)
        targets = torch.randn(BATCH, LAYERS[-1], generator=generator)

        def step() -> None:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp(inputs), targets).backward()
            optimizer.step()

        floor_step = _floor_step(cap, inputs, targets) if spec.get("paired_floor") else None
        for _ in range(spec["warmup"]):
            step()
            if floor_step is not None:
                floor_step()
        counted = spec.get("link_counted", False)  # every rank takes part in the barriers
        counter = spec.get("counter_path")  # the node link's tx counter, read by one rank per node
        if counted:
            dist.barrier()  # every rank past warm-up before the counter is read
        if counter:
            link_before = int(Path(counter).read_text())
        before = _hook_stats(state)
        floor_seconds = None
        if floor_step is None:
            cpu_before = time.process_time()  # every thread of this rank: DDP's, gloo's, the hook's workers
            seconds = time_call(step, repeat=spec["steps"], warmup=0)
            cpu_seconds = (time.process_time() - cpu_before) / spec["steps"]
        else:
            seconds, floor_seconds, cpu_seconds = _paired_times(step, floor_step, spec["steps"])
        stats = stats_delta(before, _hook_stats(state))
        link_sent = None
        if counted:
            dist.barrier()  # every rank's timed steps done, their bytes sent
        if counter:
            link_sent = int(Path(counter).read_text()) - link_before
        profile = _profile_step(step) if spec["profile"] else None
        dist.barrier()
    finally:
        gc.collect()  # free DDP's reference cycles before gloo is torn down, not during finalization
        dist.destroy_process_group()
    result = {"rank": rank, "step_seconds": seconds, "stats": stats, "profile": profile,
              "link_sent": link_sent, "cpu_seconds": cpu_seconds, "floor_seconds": floor_seconds}
    Path(spec["out"]).write_text(json.dumps(result, default=float))
