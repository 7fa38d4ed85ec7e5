"""Step time of DDP with each communication hook: 2 gloo ranks on loopback and on a shaped 1 Gbit/s link, and
4 ranks on two "nodes" joined by a 1 Gbit/s link (flat against hierarchical compression).

The question: how much of a training step does each hook save, on a slow link and on a fast one?

1. The model is an MLP 1024-4096-4096-1024 with biases (25.2M fp32 parameters, 100.7 MB of gradients),
   trained with SGD on one fixed random batch of 64 per rank; each rank uses one thread (2 ranks share
   the machine's cores).
2. Each configuration runs in its own pair of rank processes with its own process group, killed at a
   timeout or once neither rank has used CPU for 20 s (blocked in a mismatched collective), so a crash or a
   hang is reported as such and the next configuration still runs.
3. A step is ``zero_grad``, forward, backward (which runs the hook on every bucket) and ``optimizer.step``;
   the reported time is the slower rank's median over the timed steps, after warm-up steps.
4. Configurations: dense allreduce (no hook), a no-op hook (returns the bucket untouched without
   communicating: the compute floor), torch's ``fp16_compress_hook`` and ``powerSGD_hook`` (rank 4, with
   DDP's default buckets and with one bucket), and fastcomm's bf16 cast, top-k (ratio 0.01), 8- and 4-bit
   quantization, sign and PowerSGD (rank 4, DDP's default buckets) hooks.
5. Networks: loopback (127.0.0.1 only) and a veth pair between two network namespaces shaped to 1 Gbit/s
   in both directions (:mod:`benchmarks.netlab`; needs root and ``ip``, skipped with a message otherwise).
6. The ``nodes`` network (:class:`benchmarks.netlab.Nodes`): 2 nodes x 2 ranks, the ranks of a node in one
   namespace (their pairs go over its loopback), the nodes joined by the 1 Gbit/s veth. It runs dense
   allreduce, the no-op floor, flat (``node_size=1``) and hierarchical (``node_size=2``: dense inside the
   node, compressed between nodes) sign and 8-bit quantization, and flat PowerSGD, and counts the bytes
   that cross the veth during the timed steps (its tx counters, read by one rank per node between
   barriers) beside the hooks' own counters. Its rows go to ``bench_hooks_nodes.*``, so running it alone
   leaves the two-rank results in ``bench_hooks.*`` of the same output folder as they are, and vice versa.

Wire bytes are the payload each rank hands to the network per step: computed for torch's hooks (4, 2 bytes
per parameter; P and Q factors plus uncompressed 1-D tensors for powerSGD) and read from ``stats()`` for
fastcomm's. Ratios: ``ratio`` is dense allreduce time / this time (above 1 is faster than allreduce),
``x_noop_floor`` is this time / the no-op hook's time, ``speedup_vs_fp16`` is the fp16 hook's time / this.

Run::

    python -m benchmarks.bench_hooks                 # all networks, 2 warm-up + 5 timed steps each
    python -m benchmarks.bench_hooks --quick --network loopback
    python -m benchmarks.bench_hooks --network nodes   # only the two-node network (about 3 minutes)
    python -m benchmarks.bench_hooks --network both    # loopback and netlab, not nodes
    python -m benchmarks.bench_hooks --replot          # redraw the PNGs from results/bench_hooks*.json
"""

import argparse
import concurrent.futures
import dataclasses
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks import netlab
from benchmarks.common import free_port
from benchmarks.harness import RESULTS_DIR, Row, kill_process_groups, output_dir, time_call, write_results

__all__ = ["CONFIGS", "Config", "main", "plot_results"]

LAYERS = (1024, 4096, 4096, 1024)
BATCH = 64
POWERSGD_RANK = 4
# torch's PowerSGDState default: a matrix is sent uncompressed unless the factors are 2x smaller.
POWERSGD_MIN_COMPRESSION_RATE = 2.0
LINK_RATE = "1gbit"
NETWORKS = ("loopback", "netlab")
_REPO_ROOT = Path(__file__).resolve().parent.parent
# Ranks blocked in a mismatched collective use almost no CPU (background threads wake now and then); a
# healthy pair uses about one core each and never waits this long (a dense 1 Gbit/s step waits about 1 s).
_IDLE_HANG_S = 20
_BUSY_CPU_S = 0.5


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
_FASTCOMM_CONFIGS = tuple(c.name for c in CONFIGS if c.fastcomm_names)

# The "nodes" network: 2 nodes x NODE_RANKS ranks (netlab.Nodes), flat hooks beside hierarchical ones. The
# flat ones say node_size=1: the ranks see LOCAL_WORLD_SIZE=2, which would make fastcomm's default
# hierarchical.
NODES_NETWORK = "nodes"
_NODES_RESULTS = "bench_hooks_nodes"  # its own files: running it alone leaves bench_hooks.* as they are
NODE_RANKS = 2
_BY_NAME = {c.name: c for c in CONFIGS}
NODE_CONFIGS = (
    _BY_NAME["allreduce"],
    _BY_NAME["noop"],
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
_HIERARCHICAL = frozenset(c.name for c in NODE_CONFIGS if c.node_size and c.node_size > 1)


# ---------------------------------------------------------------------------------------------------------
# Rank process


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


def _make_hook(
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


def _stats_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """The hook's counters over the timed steps only (warm-up allocates residuals and rebuilds buckets);
    auto's state (``auto_*``: its choice, its trial's medians) as it stands after them."""
    if before is None or after is None:
        return None
    delta = {k: after[k] if k.startswith("auto_") else after[k] - before[k]
             for k in after if k != "compression_ratio"}  # fmt: skip
    if delta.get("bytes_sent"):
        delta["compression_ratio"] = delta.get("dense_bytes", 0.0) / delta["bytes_sent"]
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


def _rank_main(spec: dict[str, Any]) -> None:
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
        pair = _make_hook(spec["config"], spec.get("state_kwargs"))
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
        stats = _stats_delta(before, _hook_stats(state))
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


# ---------------------------------------------------------------------------------------------------------
# Driver


def _num_params() -> int:
    return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(LAYERS[:-1], LAYERS[1:], strict=True))


def _powersgd_wire_bytes() -> int:
    """Bytes powerSGD sends per step: P and Q factors of each compressed matrix, the rest uncompressed."""
    total = 0
    for fan_in, fan_out in zip(LAYERS[:-1], LAYERS[1:], strict=True):
        rows, cols = fan_out, fan_in  # weight is (out, in); the hook views it as (shape[0], -1)
        compressed = (rows + cols) * POWERSGD_RANK
        total += 4 * (compressed if compressed * POWERSGD_MIN_COMPRESSION_RATE < rows * cols else rows * cols)
        total += 4 * fan_out  # the bias is 1-D: always allreduced uncompressed
    return total


def _fastcomm_missing(config: Config) -> list[str]:
    if not config.fastcomm_names:
        return []
    try:
        import fastcomm
    except ImportError as exc:
        return [f"fastcomm ({exc})"]
    missing = [name for name in config.fastcomm_names if not hasattr(fastcomm, name)]
    if not missing and config.node_size:
        # A state is built without a process group (no collectives), so asking it is cheap.
        try:
            _make_hook(config.name, {"node_size": config.node_size})
        except (TypeError, ValueError) as exc:
            missing.append(f"{config.fastcomm_names[-1]}(node_size={config.node_size}): {exc}")
    return missing


@dataclasses.dataclass(frozen=True)
class _Settings:
    """How each configuration is run."""

    warmup: int
    steps: int
    timeout_s: float
    profile: bool = False
    paired_floor: bool = False  # time the no-op hook's step beside each step (_paired_times)


@dataclasses.dataclass
class _Outcome:
    status: str
    step_seconds: float = math.nan
    stats: dict[str, float] | None = None
    link_bytes: float | None = None  # bytes over the node link during the timed steps, both directions
    cpu_seconds: float | None = None  # CPU time per timed step, summed over the ranks (all their threads)
    floor_seconds: float | None = None  # the no-op step timed beside each step (paired_floor), slower rank's


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where one rank runs: the command prefix, its own environment, the rendezvous address, and the node
    link's counter it reads around the timed steps (one rank per node of a :class:`netlab.Nodes`)."""

    prefix: tuple[str, ...]
    env: dict[str, str]
    master_addr: str
    counter_path: str | None = None


def _places(link: netlab.Link | None) -> list[_Place]:
    """The ranks of a network: two on loopback or on the two sides of a :class:`netlab.Link`, or
    ``world_size`` placed node by node on a :class:`netlab.Nodes`."""
    if isinstance(link, netlab.Nodes):
        return [
            _Place(tuple(link.rank_prefix(rank)), link.rank_env(rank), link.master_addr,
                   link.counter_path(link.node_of(rank)) if rank % link.ranks_per_node == 0 else None)
            for rank in range(link.world_size)
        ]
    if link is None:
        return [_Place((), {"GLOO_SOCKET_IFNAME": "lo"}, "127.0.0.1") for _ in range(2)]
    return [_Place(tuple(link.exec_prefix(rank)), {"GLOO_SOCKET_IFNAME": link.interfaces[rank]},
                   link.addresses[0]) for rank in range(2)]


def _cpu_seconds(procs: Sequence[subprocess.Popen[bytes]]) -> float | None:
    """CPU time the rank processes have used so far (Linux ``/proc``), or ``None`` where unknown."""
    total = 0.0
    for proc in procs:
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


def _last_error_line(path: Path) -> str:
    """The last line of a rank's log that names an error (else its last line), shortened."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"Error|Exception|enforce fail|what\(\)", line)]
    chosen = errors or lines
    return chosen[-1][:300] if chosen else "(no output)"


def _run_config(config: Config, link: netlab.Link | None, port: int, settings: _Settings) -> _Outcome:
    """Run ``config`` on fresh rank processes (:func:`_places`) and collect the slower rank's median step
    time."""
    missing = _fastcomm_missing(config)
    if missing:
        return _Outcome(f"skipped: not available in fastcomm ({', '.join(missing)})")
    places = _places(link)
    with tempfile.TemporaryDirectory(prefix="bench_hooks_") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        try:
            for rank, place in enumerate(places):
                spec = {
                    "config": config.name, "bucket_cap_mb": config.bucket_cap_mb, "rank": rank,
                    "world_size": len(places), "port": port,
                    "warmup": settings.warmup + (AUTO_SETTLE_STEPS if config.name == "auto" else 0),
                    "steps": settings.steps, "timeout_s": settings.timeout_s, "profile": settings.profile,
                    "out": str(Path(tmp) / f"rank{rank}.json"), "master_addr": place.master_addr,
                    "counter_path": place.counter_path,
                    "link_counted": any(other.counter_path for other in places),
                    "state_kwargs": {"node_size": config.node_size} if config.node_size else None,
                    "paired_floor": settings.paired_floor,
                }
                pythonpath = os.pathsep.join(filter(None, (str(_REPO_ROOT), os.environ.get("PYTHONPATH"))))
                env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, **place.env)
                command = [*place.prefix, sys.executable, "-m", "benchmarks.bench_hooks",
                           "--rank-spec", json.dumps(spec)]
                logs.append(Path(tmp) / f"rank{rank}.log")
                with logs[-1].open("wb") as log:
                    procs.append(subprocess.Popen(command, cwd=_REPO_ROOT, env=env, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
            start = time.monotonic()
            deadline = start + settings.timeout_s
            cpu_seconds, busy_at = _cpu_seconds(procs), start
            failed_at: float | None = None
            idle = False
            first_failed: int | None = None  # its error is the cause; its peer reports "connection reset"
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed_at is None and failed:
                    failed_at, first_failed = now, failed[0]
                used = _cpu_seconds(procs)
                if used is None or cpu_seconds is None or used > cpu_seconds + _BUSY_CPU_S:
                    cpu_seconds, busy_at = used, now
                # A rank that died leaves its peer blocked in a collective: give it a moment to report.
                idle = now - busy_at > _IDLE_HANG_S
                if now > deadline or idle or (failed_at is not None and now > failed_at + 10):
                    break
                time.sleep(0.2)
            hung = [r for r, p in enumerate(procs) if p.poll() is None]
            waited = time.monotonic() - start
        finally:
            kill_process_groups(procs)
        crashed = [r for r, p in enumerate(procs) if p.returncode not in (0, None) and r not in hung]
        if crashed:
            # The rank that failed first holds the cause; its peer only sees the connection drop.
            crashed.sort(key=lambda r: ("Connection reset" in _last_error_line(logs[r]), r != first_failed))
            rank = crashed[0]
            code = procs[rank].returncode
            return _Outcome(f"crashed (rank {rank} exit {code}): {_last_error_line(logs[rank])}")
        if hung:
            why = f"under {_BUSY_CPU_S} s of CPU in {_IDLE_HANG_S} s" if idle else "timeout"
            return _Outcome(f"hung: rank(s) {hung} still running after {waited:.0f} s ({why}), killed")
        results = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(len(places))]
        if results[0].get("profile"):
            print(f"[bench_hooks] {config.name}: rank 0 profile of one step\n{results[0]['profile']}",
                  file=sys.stderr, flush=True)
    counted = [r["link_sent"] for r in results if r.get("link_sent") is not None]
    floors = [r["floor_seconds"] for r in results if r.get("floor_seconds") is not None]
    return _Outcome("ok", max(r["step_seconds"] for r in results), results[0]["stats"],
                    float(sum(counted)) if counted else None, sum(r["cpu_seconds"] for r in results),
                    max(floors) if floors else None)


def _wire_bytes(config: Config, outcome: _Outcome, timed_steps: int) -> float | None:
    params = _num_params()
    computed = {"allreduce": 4 * params, "noop": 0, "torch_fp16": 2 * params,
                "torch_powersgd_r4": _powersgd_wire_bytes(),
                "torch_powersgd_r4_1bucket": _powersgd_wire_bytes()}
    if config.name in computed:
        return float(computed[config.name])
    if outcome.stats and "bytes_sent" in outcome.stats:
        return outcome.stats["bytes_sent"] / timed_steps
    return None


def _rows_for(
    network: str, outcomes: dict[str, _Outcome], timed_steps: int, link_mb_per_s: float | None
) -> list[Row]:
    """One ``step_time`` row per configuration, with its wire bytes, hook stats and ratios."""

    def ok_time(name: str) -> float | None:
        outcome = outcomes.get(name)
        return outcome.step_seconds if outcome is not None and outcome.status == "ok" else None

    dense, floor, fp16 = ok_time("allreduce"), ok_time("noop"), ok_time("torch_fp16")
    rows = []
    for config in CONFIGS:
        if config.name not in outcomes:
            continue
        outcome = outcomes[config.name]
        seconds = ok_time(config.name)
        extra: dict[str, Any] = {"status": outcome.status}
        wire = _wire_bytes(config, outcome, timed_steps)
        if wire is not None:
            extra["wire_MB/step"] = round(wire / 1e6, 3)
            extra["wire_vs_dense"] = round(wire / (4 * _num_params()), 4)
            if link_mb_per_s:
                extra["wire_s/step_at_link"] = round(wire / 1e6 / link_mb_per_s, 3)
        if outcome.stats:
            if "compress_seconds" in outcome.stats:
                extra["compress_s/step"] = round(outcome.stats["compress_seconds"] / timed_steps, 4)
            if "compression_ratio" in outcome.stats:
                extra["compression_ratio"] = round(outcome.stats["compression_ratio"], 2)
            if "compressed_buckets" in outcome.stats and "dense_buckets" in outcome.stats:
                extra["buckets_compressed/dense"] = (
                    f"{outcome.stats['compressed_buckets']:.0f}/{outcome.stats['dense_buckets']:.0f}"
                )
        if seconds is not None and floor:
            extra["x_noop_floor"] = round(seconds / floor, 2)
        if config.name == "quant8" and seconds and fp16:
            extra["speedup_vs_fp16"] = round(fp16 / seconds, 2)
        rows.append(Row(
            case=network,
            backend=config.name,
            metric="step_time",
            value=seconds if seconds is not None else math.nan,
            unit="s",
            ratio=dense / seconds if seconds and dense else None,
            ratio_to="allreduce speedup" if seconds and dense else None,
            extra=extra,
        ))
    return rows


def _verdicts(
    network: str, times: dict[str, float]
) -> tuple[Callable[[str, Sequence[str], Callable[[], tuple[bool, str]]], str],
           Callable[[str, str, float], tuple[bool, str]]]:
    """Over ``times``: ``verdict(label, needed, test)``, a target MET, MISSED or not evaluated, with the
    numbers, and ``speedup(name, base, at_least)``, whether ``base``'s step time over ``name``'s is that."""

    def verdict(label: str, needed: Sequence[str], test: Callable[[], tuple[bool, str]]) -> str:
        absent = [n for n in needed if n not in times]
        if absent:
            return f"{network}: {label}: not evaluated (no step time for {', '.join(absent)})"
        passed, detail = test()
        return f"{network}: {label}: {'MET' if passed else 'MISSED'} ({detail})"

    def speedup(name: str, base: str, at_least: float) -> tuple[bool, str]:
        value = times[base] / times[name]
        return value >= at_least, f"{base} {times[base]:.3f} s / {name} {times[name]:.3f} s = {value:.2f}x"

    return verdict, speedup


def _check_targets(network: str, rows: list[Row]) -> list[str]:
    """The issue's targets for ``network``, each marked MET, MISSED or not evaluated, with the numbers."""
    times = {r.backend: r.value for r in rows if r.extra.get("status") == "ok"}
    verdict, speedup = _verdicts(network, times)

    if network == "loopback":
        notes = []
        for name in _FASTCOMM_CONFIGS:
            def slower(name: str = name) -> tuple[bool, str]:
                value = times[name] / times["allreduce"]
                dense = times["allreduce"]
                return value <= 1.5, f"{name} {times[name]:.3f} s / allreduce {dense:.3f} s = {value:.2f}x"

            notes.append(verdict(f"{name} at most 1.5x slower than allreduce", (name, "allreduce"), slower))

        def auto_dense() -> tuple[bool, str]:
            value = times["auto"] / times["allreduce"]
            dense = times["allreduce"]
            return value <= 1.03, f"auto {times['auto']:.3f} s / allreduce {dense:.3f} s = {value:.2f}x"

        notes.append(verdict("auto <= 1.03x allreduce", ("auto", "allreduce"), auto_dense))
        return notes

    def auto_best() -> tuple[bool, str]:
        best = min(("bf16_cast", "quant8", "quant4"), key=lambda name: times[name])
        value = times["auto"] / times[best]
        detail = f"auto {times['auto']:.3f} s / best at parity {best} {times[best]:.3f} s = {value:.2f}x"
        return value <= 1.05, detail

    def topk_floor() -> tuple[bool, str]:
        value = times["topk_0.01"] / times["noop"]
        return value <= 1.4, f"topk {times['topk_0.01']:.3f} s / no-op {times['noop']:.3f} s = {value:.2f}x"

    return [
        verdict("topk_0.01 >= 3x faster than allreduce", ("topk_0.01", "allreduce"),
                lambda: speedup("topk_0.01", "allreduce", 3.0)),
        verdict("topk_0.01 <= 1.4x the no-op floor", ("topk_0.01", "noop"), topk_floor),
        verdict("quant8 >= 1.6x faster than torch_fp16", ("quant8", "torch_fp16"),
                lambda: speedup("quant8", "torch_fp16", 1.6)),
        verdict("quant4 >= 2.5x faster than allreduce", ("quant4", "allreduce"),
                lambda: speedup("quant4", "allreduce", 2.5)),
        verdict("sign >= 3x faster than allreduce", ("sign", "allreduce"),
                lambda: speedup("sign", "allreduce", 3.0)),
        verdict("powersgd_r4 >= 3x faster than allreduce", ("powersgd_r4", "allreduce"),
                lambda: speedup("powersgd_r4", "allreduce", 3.0)),
        verdict("auto within 5% of the best hook at loss parity", ("auto", "bf16_cast", "quant8", "quant4"),
                auto_best),
    ]


def _run_network(
    network: str,
    configs: Sequence[Config],
    link: netlab.Link | None,
    settings: _Settings,
    link_mb_per_s: float | None,
) -> list[Row]:
    """Run every configuration on ``network`` (through ``link`` when given) and return its rows."""
    outcomes: dict[str, _Outcome] = {}
    for index, config in enumerate(configs):
        # Fresh namespaces have no other listeners; on loopback ask the kernel for a free port.
        port = 29500 + index if link else free_port()
        start = time.perf_counter()
        outcome = _run_config(config, link, port, settings)
        outcomes[config.name] = outcome
        shown = f"{outcome.step_seconds:.3f} s/step" if outcome.status == "ok" else outcome.status
        print(f"[bench_hooks] {network:8s} {config.name:26s} {shown}  ({time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
    return _rows_for(network, outcomes, settings.steps, link_mb_per_s)


# ---------------------------------------------------------------------------------------------------------
# Two nodes


def _node_rows(outcomes: dict[str, _Outcome], loads: dict[str, float], timed_steps: int, world_size: int,
               link_mb_per_s: float | None) -> list[Row]:
    """One ``step_time`` row per configuration of the nodes network, with the bytes over the node link and
    the machine's 1-minute load average when the configuration started (``loads``)."""

    def ok(name: str) -> _Outcome | None:
        outcome = outcomes.get(name)
        return outcome if outcome is not None and outcome.status == "ok" else None

    dense, floor = ok("allreduce"), ok("noop")
    rows = []
    for config in NODE_CONFIGS:
        if config.name not in outcomes:
            continue
        outcome = outcomes[config.name]
        seconds = outcome.step_seconds if ok(config.name) else None
        extra: dict[str, Any] = {"status": outcome.status, "ranks": world_size,
                                 "node_size": config.node_size or "-"}
        if config.name in loads:
            extra["load_1m"] = round(loads[config.name], 2)
        if outcome.link_bytes is not None:
            per_step = outcome.link_bytes / timed_steps
            extra["link_MB/step"] = round(per_step / 1e6, 3)
            if link_mb_per_s:
                # both directions carry about half each, and each direction has the link's rate
                extra["link_s/step_at_rate"] = round(per_step / 2 / 1e6 / link_mb_per_s, 3)
            flat = ok(config.name.removesuffix("_hier")) if config.name in _HIERARCHICAL else None
            if flat is not None and flat.link_bytes:
                extra["link_vs_flat"] = round(outcome.link_bytes / flat.link_bytes, 3)
        if outcome.stats:
            # rank 0's counters times the ranks (every rank sends as much), comparable to link_MB/step
            all_ranks = world_size / timed_steps / 1e6
            sent = outcome.stats.get("bytes_sent")
            if sent is not None:
                extra["hook_sent_MB/step"] = round(sent * all_ranks, 3)
            cross = outcome.stats.get("cross_node_bytes")
            if not cross and sent and config.name not in _HIERARCHICAL:
                # flat: a rank's all-to-all and all-gather spread evenly over its W-1 peers, W-L elsewhere
                cross = sent * (world_size - NODE_RANKS) / (world_size - 1)
            if cross:
                extra["hook_cross_node_MB/step"] = round(cross * all_ranks, 3)
            if outcome.stats.get("intra_node_bytes"):
                extra["hook_intra_node_MB/step"] = round(outcome.stats["intra_node_bytes"] * all_ranks, 3)
            if "compress_seconds" in outcome.stats:
                extra["compress_s/step"] = round(outcome.stats["compress_seconds"] / timed_steps, 4)
        if seconds is not None and floor is not None:
            extra["x_noop_floor"] = round(seconds / floor.step_seconds, 2)
        if outcome.cpu_seconds is not None and seconds is not None:
            extra["cpu_s/step"] = round(outcome.cpu_seconds, 3)
            # the ranks share the machine's cores: a step can take no less than their CPU time over them
            extra["cpu_floor_s"] = round(outcome.cpu_seconds / (os.cpu_count() or 1), 3)
        if seconds is not None and config.name in _HIERARCHICAL:
            flat = ok(config.name.removesuffix("_hier"))
            if flat is not None:
                extra["speedup_vs_flat"] = round(flat.step_seconds / seconds, 2)
        rows.append(Row(
            case=NODES_NETWORK,
            backend=config.name,
            metric="step_time",
            value=seconds if seconds is not None else math.nan,
            unit="s",
            ratio=dense.step_seconds / seconds if seconds and dense else None,
            ratio_to="allreduce speedup" if seconds and dense else None,
            extra=extra,
        ))
    return rows


def _check_node_targets(rows: list[Row]) -> list[str]:
    """The issue's targets on two nodes, each marked MET, MISSED or not evaluated, with the numbers."""
    ok = {r.backend: r for r in rows if r.extra.get("status") == "ok"}
    verdict, speedup = _verdicts(NODES_NETWORK, {name: row.value for name, row in ok.items()})

    def link_share(name: str, flat: str) -> tuple[bool, str]:
        mine, theirs = ok[name].extra.get("link_MB/step"), ok[flat].extra.get("link_MB/step")
        if mine is None or not theirs:
            return False, "no link byte count"
        share = mine / theirs
        detail = f"{name} {mine:.2f} MB/step / {flat} {theirs:.2f} MB/step = {share:.3f}"
        return share <= 1.25 / NODE_RANKS, f"{detail}, 1/L = {1 / NODE_RANKS:.3f}"

    notes = [
        verdict("sign_hier >= 1.5x faster than flat sign", ("sign_hier", "sign"),
                lambda: speedup("sign_hier", "sign", 1.5)),
        verdict("quant8_hier >= 1.5x faster than flat quant8", ("quant8_hier", "quant8"),
                lambda: speedup("quant8_hier", "quant8", 1.5)),
        verdict("quant8_hier >= 2x faster than allreduce", ("quant8_hier", "allreduce"),
                lambda: speedup("quant8_hier", "allreduce", 2.0)),
    ]
    for name in ("sign_hier", "quant8_hier"):
        flat = name.removesuffix("_hier")
        notes.append(verdict(f"{name} node-link bytes about 1/L of flat {flat} or less (at most 1.25/L)",
                             (name, flat), lambda name=name, flat=flat: link_share(name, flat)))
    if "node_reduce" in ok:
        # a hierarchical step does at least node_reduce's work: the dense reduction inside the node that
        # the scheme starts with; its compression, exchange and gather come on top
        bound = ok["node_reduce"]
        cpu_floor = bound.extra.get("cpu_floor_s")
        cpu = f"; the ranks' CPU time over the cores alone is {cpu_floor:.3f} s" if cpu_floor else ""
        for flat in ("sign", "quant8"):
            if flat not in ok:
                continue
            need = ok[flat].value / 1.5
            least = bound.value
            reach = "reachable" if least <= need else f"out of reach here ({least / need:.2f}x it)"
            notes.append(
                f"{NODES_NETWORK}: bound: a {flat}_hier step costs at least node_reduce's {least:.3f} s (the "
                f"in-node dense reduction alone{cpu}); 1.5x flat {flat} needs <= {need:.3f} s: {reach}"
            )
    return notes


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _run_nodes(configs: Sequence[Config], settings: _Settings) -> tuple[list[Row], list[str]]:
    """Build :class:`netlab.Nodes`, check where its traffic goes, run every configuration on it."""
    notes = [f"{NODES_NETWORK}: 2 nodes x {NODE_RANKS} gloo ranks (netlab.Nodes: the ranks of a node share a "
             f"network namespace, the two namespaces joined by one veth pair, tbf {LINK_RATE} each way); "
             "gloo bound to each node's veth address, so pairs inside a node connect to their own address "
             "(the namespace's loopback) and only node-to-node traffic crosses the veth",
             f"{NODES_NETWORK}: link_MB/step = the veth's tx byte counters of both ends (both directions, "
             "Ethernet/IP/TCP headers included) over the timed steps, read by local rank 0 of each node "
             "between barriers; link_vs_flat = this hierarchical row's link bytes / its flat version's",
             f"{NODES_NETWORK}: hook_*_MB/step = rank 0's stats() counters per timed step times the "
             f"{2 * NODE_RANKS} ranks (each sends as much; payload only, no headers): bytes_sent (all of "
             "the compressed exchange), cross_node_bytes and intra_node_bytes (the hierarchical hooks' "
             "own counts; for a flat hook cross-node is bytes_sent * (W - L) / (W - 1), its peers being "
             "spread evenly over the nodes)"]
    reason = netlab.unavailable_reason()
    if reason:
        notes.append(f"{NODES_NETWORK}: skipped, {reason}")
        print(f"[bench_hooks] {notes[-1]}", file=sys.stderr, flush=True)
        return [], notes
    outcomes: dict[str, _Outcome] = {}
    loads: dict[str, float] = {}
    with netlab.Nodes(ranks_per_node=NODE_RANKS, rate=LINK_RATE) as nodes:
        traffic = netlab.measure_node_traffic(nodes)
        notes.append(
            f"{NODES_NETWORK}: traffic check, {traffic.nbytes / 1e6:.0f} MB over TCP: inside node 0 "
            f"{traffic.intra_mb_per_s:.0f} MB/s with {traffic.intra_link_bytes} bytes on the veth; node 0 -> "
            f"node 1 {traffic.cross_mb_per_s:.1f} MB/s with {traffic.cross_link_bytes / 1e6:.1f} MB on the "
            "veth")
        print(f"[bench_hooks] {notes[-1]}", file=sys.stderr, flush=True)
        notes.append(f"{NODES_NETWORK}: load average (1/5/15 min) at the start {_load()}")
        for index, config in enumerate(configs):
            start, load = time.perf_counter(), os.getloadavg()[0]
            outcome = _run_config(config, nodes, 29500 + index, settings)
            outcomes[config.name], loads[config.name] = outcome, load
            shown = f"{outcome.step_seconds:.3f} s/step" if outcome.status == "ok" else outcome.status
            if outcome.link_bytes is not None:
                shown += f", {outcome.link_bytes / settings.steps / 1e6:.1f} MB/step on the node link"
            print(f"[bench_hooks] {NODES_NETWORK:8s} {config.name:26s} {shown}  "
                  f"({time.perf_counter() - start:.0f} s, load {load:.2f})", file=sys.stderr, flush=True)
        notes.append(f"{NODES_NETWORK}: load average (1/5/15 min) at the end {_load()}")
    rows = _node_rows(outcomes, loads, settings.steps, nodes.world_size, traffic.cross_mb_per_s)
    return rows, notes + _check_node_targets(rows)


# ---------------------------------------------------------------------------------------------------------
# Plot

_REFERENCES = ("allreduce", "noop")  # drawn as lines, not bars
_NETWORK_TITLES = {"loopback": "loopback (127.0.0.1, no rate limit)",
                   "netlab": f"netlab: veth pair shaped to {LINK_RATE.replace('gbit', ' Gbit/s')}"}
_FAMILY_COLOURS = {"torch": "#dd8452", "fastcomm": "#4c72b0"}
_NO_RESULT_COLOUR = "#b0303a"
_NO_RESULT_BOX = {"facecolor": "#fbe3e4", "edgecolor": _NO_RESULT_COLOUR, "linewidth": 1.0}


def _short_status(status: str) -> str:
    """``'crashed (rank 0 exit -6): <log line>'`` -> ``'crashed (rank 0 exit -6)'``: the kind, not the log."""
    return status.split(":", 1)[0]


def plot_results(payload: dict[str, Any], path: Path) -> None:
    """Draw ``bench_hooks.json``'s rows as one panel per network and write the PNG to ``path``.

    Each panel has a horizontal bar per hook (its step time, labelled with the time and the ratio to dense
    allreduce), the dense allreduce and no-op (no communication) times as vertical reference lines, and a
    crashed, hung or skipped configuration as a red note where its bar would be.

    Example::

        plot_results(json.loads(Path("benchmarks/results/bench_hooks.json").read_text()),
                     Path("bench_hooks.png"))
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = [r for r in payload["rows"] if r["metric"] == "step_time"]
    networks = list(dict.fromkeys(r["case"] for r in rows))
    if not networks:
        return
    order = [c.name for c in CONFIGS if c.name not in _REFERENCES]
    families = {c.name: "fastcomm" if c.fastcomm_names else "torch" for c in CONFIGS}
    fig, axes = plt.subplots(1, len(networks), figsize=(7.2 * len(networks), 0.5 * len(order) + 2.4),
                             sharey=True, squeeze=False)
    for ax, network in zip(axes[0], networks, strict=True):
        by_name = {r["backend"]: r for r in rows if r["case"] == network}
        names = [n for n in order if n in by_name]
        ok = {n: r["value"] for n, r in by_name.items() if r["extra"].get("status") == "ok" and r["value"]}
        bars = [ok[n] for n in names if n in ok]
        # room for the labels right of the longest bar, and the reference lines inside the panel
        x_max = max(max(bars, default=0.0) * 1.4, max(ok.values(), default=0.0) * 1.08) or 1.0
        for y, name in enumerate(names):
            row = by_name[name]
            if name in ok:
                ax.barh(y, ok[name], color=_FAMILY_COLOURS[families[name]], height=0.68, zorder=2)
                ratio = row.get("ratio")
                label = f"{ok[name]:.3f} s" + (f"   {ratio:.2f}x" if ratio else "")
                ax.text(ok[name] + 0.01 * x_max, y, label, va="center", fontsize=9, zorder=4,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.85})
            else:
                status = _short_status(row["extra"].get("status", "missing"))
                ax.text(0.01 * x_max, y, f"no result: {status}", va="center", fontsize=9, zorder=4,
                        color=_NO_RESULT_COLOUR, fontweight="bold", bbox=_NO_RESULT_BOX)
        lines = []
        for ref, colour, style, text in (("allreduce", "#c44e52", "--", "dense allreduce"),
                                         ("noop", "#55a868", ":", "no-communication floor")):
            if ref in ok:
                lines.append(ax.axvline(ok[ref], color=colour, linestyle=style, linewidth=1.8, zorder=1.5,
                                        label=f"{text}: {ok[ref]:.3f} s"))
        if lines:
            ax.legend(handles=lines, loc="lower right", fontsize=9, framealpha=0.95)
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(len(names) - 0.5, -0.6)  # first configuration on top
        ax.set_xlim(0, x_max)
        ax.set_xlabel("step time (s), shorter is better")
        ax.set_title(_NETWORK_TITLES.get(network, network), fontsize=11)
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
    legend = [Patch(color=_FAMILY_COLOURS["torch"], label="torch's hooks"),
              Patch(color=_FAMILY_COLOURS["fastcomm"], label="fastcomm's hooks"),
              Patch(**_NO_RESULT_BOX, label="no result (crashed, hung or skipped; see bench_hooks.md)")]
    fig.legend(handles=legend, loc="lower center", ncol=3, frameon=False, fontsize=9)
    fig.suptitle(f"DDP step time by communication hook, 2 gloo ranks, MLP with {_num_params() / 1e6:.1f}M "
                 "parameters\n"
                 "bar label: step time, and dense allreduce time / this (above 1x: faster than allreduce)",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_nodes(payload: dict[str, Any], path: Path) -> None:
    """Draw ``bench_hooks_nodes.json``'s rows: step time and bytes over the node link, one bar per hook.

    The left panel has each configuration's step time (labelled with the time and the ratio to dense
    allreduce, hierarchical rows also with their speedup over the flat version) and the dense allreduce and
    no-op times as reference lines; the right panel the bytes counted on the veth per step. A crashed,
    hung or skipped configuration is a red note where its bar would be.

    Example::

        plot_nodes(json.loads(Path("benchmarks/results/bench_hooks_nodes.json").read_text()),
                   Path("bench_hooks_nodes.png"))
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    by_name = {r["backend"]: r for r in payload["rows"] if r["metric"] == "step_time"}
    names = [c.name for c in NODE_CONFIGS if c.name in by_name]
    if not names:
        return
    colours = {n: "#55a868" if n in _HIERARCHICAL else "#4c72b0" for n in names}
    colours.update({n: "#8c8c8c" for n in _REFERENCES if n in colours})
    ok = {n: r for n, r in by_name.items() if r["extra"].get("status") == "ok" and r["value"]}
    fig, (time_ax, link_ax) = plt.subplots(1, 2, figsize=(13, 0.55 * len(names) + 2.6), sharey=True)
    for ax, value_of, unit in ((time_ax, lambda r: r["value"], "s"),
                               (link_ax, lambda r: r["extra"].get("link_MB/step"), "MB")):
        values = {n: value_of(ok[n]) for n in names if n in ok and value_of(ok[n]) is not None}
        if unit == "MB":
            # dense allreduce sends ~50x what sign does: a log axis shows both; the no-op sends nothing
            values = {n: v for n, v in values.items() if v >= 0.01}
            ax.set_xscale("log")
        x_max = (max(values.values(), default=0.0) * (6.0 if unit == "MB" else 1.45)) or 1.0
        x_min = min(values.values(), default=1.0) / 3 if unit == "MB" else 0.0
        for y, name in enumerate(names):
            if name in values:
                ax.barh(y, values[name] - x_min, left=x_min, color=colours[name], height=0.68, zorder=2)
                label = f"{values[name]:.3f} s" if unit == "s" else f"{values[name]:.1f} MB"
                extra = ok[name]["extra"]
                if unit == "s" and ok[name].get("ratio"):
                    label += f"   {ok[name]['ratio']:.2f}x"
                if unit == "s" and "speedup_vs_flat" in extra:
                    label += f", {extra['speedup_vs_flat']:.2f}x flat"
                if unit == "MB" and "link_vs_flat" in extra:
                    label += f"   {extra['link_vs_flat']:.2f} of flat"
                ax.text(values[name] * 1.08 if unit == "MB" else values[name] + 0.01 * x_max, y, label,
                        va="center", fontsize=9, zorder=4,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.85})
            elif name in ok:
                ax.text(x_min * 1.1 if unit == "MB" else 0.0, y, "nothing sent", va="center", fontsize=9)
            else:
                status = _short_status(by_name[name]["extra"].get("status", "missing"))
                ax.text(x_min * 1.1 if unit == "MB" else 0.01 * x_max, y, f"no result: {status}",
                        va="center", fontsize=9, zorder=4, color=_NO_RESULT_COLOUR, fontweight="bold",
                        bbox=_NO_RESULT_BOX)
        ax.set_xlim(x_min, x_max)
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
    lines = []
    for ref, colour, style, text in (("allreduce", "#c44e52", "--", "dense allreduce"),
                                     ("noop", "#333333", ":", "no-communication floor")):
        if ref in ok:
            lines.append(time_ax.axvline(ok[ref]["value"], color=colour, linestyle=style, linewidth=1.8,
                                         zorder=1.5, label=f"{text}: {ok[ref]['value']:.3f} s"))
    if lines:
        time_ax.legend(handles=lines, loc="lower right", fontsize=9, framealpha=0.95)
    time_ax.set_yticks(range(len(names)), names)
    time_ax.set_ylim(len(names) - 0.5, -0.6)
    time_ax.set_xlabel("step time (s), shorter is better")
    time_ax.set_title("step time; label: time, allreduce time / this, flat time / this", fontsize=10)
    link_ax.set_xlabel("MB per step over the node link (veth counters, both directions; log scale)")
    link_ax.set_title("bytes crossing between the nodes per step", fontsize=10)
    legend = [Patch(color="#4c72b0", label="flat hook (4 ranks as equals)"),
              Patch(color="#55a868", label=f"hierarchical (node_size={NODE_RANKS})"),
              Patch(color="#8c8c8c", label="dense allreduce / no-op"),
              Patch(**_NO_RESULT_BOX, label="no result (see bench_hooks_nodes.md)")]
    fig.legend(handles=legend, loc="lower center", ncol=4, frameon=False, fontsize=9)
    fig.suptitle(f"2 nodes x {NODE_RANKS} gloo ranks, {LINK_RATE.replace('gbit', ' Gbit/s')} veth between "
                 f"the nodes, MLP with {_num_params() / 1e6:.1f}M parameters", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _replot(directory: Path) -> None:
    plot_results(json.loads((directory / "bench_hooks.json").read_text()), directory / "bench_hooks.png")


def _replot_nodes(directory: Path) -> None:
    plot_nodes(json.loads((directory / f"{_NODES_RESULTS}.json").read_text()),
               directory / f"{_NODES_RESULTS}.png")


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark, write ``bench_hooks.*`` (loopback and netlab) and ``bench_hooks_nodes.*`` (two
    nodes) to ``harness.output_dir()``, each only for the networks run; return the Markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 warm-up + 2 timed steps (default 2 + 5)")
    parser.add_argument("--network", choices=(*NETWORKS, NODES_NETWORK, "both", "all"), default="all",
                        help="both = loopback and netlab; all (the default) = those and nodes")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per configuration before its ranks are killed")
    parser.add_argument("--configs", default=None,
                        help="comma-separated subset of the configurations to run (default: all of each "
                             "network's)")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile one more step on rank 0 and print its top ops")
    parser.add_argument("--replot", action="store_true",
                        help="redraw bench_hooks.png (and bench_hooks_nodes.png) from their JSON; "
                             "run nothing")
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.rank_spec:
        _rank_main(json.loads(args.rank_spec))
        return ""
    if args.replot:
        _replot(RESULTS_DIR)
        text = (RESULTS_DIR / "bench_hooks.md").read_text()
        if (RESULTS_DIR / f"{_NODES_RESULTS}.json").exists():
            _replot_nodes(RESULTS_DIR)
            text += "\n" + (RESULTS_DIR / f"{_NODES_RESULTS}.md").read_text()
        return text

    warmup, steps = (2, 2) if args.quick else (2, 5)
    # Generous: a dense step on the 1 Gbit link takes about 1 s; process start and DDP setup about 10 s.
    settings = _Settings(warmup, steps, args.timeout or 45.0 + 6.0 * (warmup + steps), args.profile)
    # Four ranks share the cores: each step and each start take about twice as long.
    node_settings = dataclasses.replace(settings, timeout_s=args.timeout or 90.0 + 15.0 * (warmup + steps))
    networks = {"both": NETWORKS, "all": (*NETWORKS, NODES_NETWORK)}.get(args.network, (args.network,))
    known = [c.name for c in CONFIGS] + [c.name for c in NODE_CONFIGS if c.name not in _BY_NAME]
    chosen = args.configs.split(",") if args.configs else known
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {known}")
    configs = tuple(c for c in CONFIGS if c.name in chosen)
    node_configs = tuple(c for c in NODE_CONFIGS if c.name in chosen)
    # A network with none of the chosen configurations is not run, and its result files stay as they are.
    tables = []
    two_rank = [n for n in networks if n in NETWORKS]
    if two_rank and configs:
        tables.append(_two_rank_networks(two_rank, configs, settings))
    if NODES_NETWORK in networks and node_configs:
        tables.append(_nodes_network(node_configs, node_settings))
    return "\n".join(tables)


def _common_notes(settings: _Settings, ranks: str) -> list[str]:
    params = _num_params()
    return [
        f"model: MLP {'-'.join(map(str, LAYERS))} with biases, {params / 1e6:.2f}M fp32 parameters "
        f"({4 * params / 1e6:.1f} MB of gradients), batch {BATCH} per rank, SGD",
        f"{ranks} gloo ranks, one thread each; {settings.warmup} warm-up + {settings.steps} timed steps per "
        "configuration, time = slower rank's median step",
        "ratio = allreduce step time / this step time (above 1 = faster than dense allreduce); "
        "x_noop_floor = this step time / the no-op hook's",
    ]


def _nodes_network(configs: Sequence[Config], settings: _Settings) -> str:
    """Run the nodes network, write ``bench_hooks_nodes.*`` and return its Markdown table."""
    rows, node_notes = _run_nodes(configs, settings)
    notes = [
        *_common_notes(settings, f"{2 * NODE_RANKS} (2 nodes x {NODE_RANKS})"),
        "speedup_vs_flat = the flat version's step time / this hierarchical one's",
        *(f"{c.name}: {c.description}" for c in NODE_CONFIGS),
        *node_notes,
    ]
    for note in notes:
        print(f"[bench_hooks] {note}", file=sys.stderr, flush=True)
    table = write_results(_NODES_RESULTS, rows, notes=notes, plot_metric="step_time")
    if rows:
        _replot_nodes(output_dir())  # replaces the harness's generic bars
    return table


def _two_rank_networks(networks: Sequence[str], configs: Sequence[Config], settings: _Settings) -> str:
    """Run the loopback and netlab networks, write ``bench_hooks.*`` and return its Markdown table."""
    notes = [
        *_common_notes(settings, "2"),
        "wire bytes: what one rank sends per step (for 2 ranks a ring allreduce and an all-gather both send "
        "the payload once); computed for torch hooks, stats()['bytes_sent'] per timed step for fastcomm "
        "(fastcomm counters, compress_s/step included, cover the timed steps only)",
        *(f"{c.name}: {c.description}" for c in CONFIGS),
        "torch_powersgd_r4 with DDP's default buckets fails over gloo here (size-mismatch abort or hang); "
        "with one bucket it runs, so the likely cause is its P/Q collectives being issued from future "
        "callbacks in an order that differs between ranks",
    ]
    rows: list[Row] = []
    for network in networks:
        if network == "loopback":
            loopback_rows = _run_network(network, configs, None, settings, None)
            rows += loopback_rows
            notes += _check_targets(network, loopback_rows)
            continue
        reason = netlab.unavailable_reason()
        if reason:
            message = f"netlab: skipped, {reason}"
            print(f"[bench_hooks] {message}", file=sys.stderr, flush=True)
            notes.append(message)
            continue
        with netlab.Link(rate=LINK_RATE) as link:
            link_mb_per_s = netlab.measure_throughput(link)
            notes.append(f"netlab: veth between two namespaces, tbf {LINK_RATE} each way, measured "
                         f"{link_mb_per_s:.1f} MB/s (TCP, one direction)")
            net_rows = _run_network(network, configs, link, settings, link_mb_per_s)
        rows += net_rows
        notes += _check_targets(network, net_rows)
    for note in notes:
        print(f"[bench_hooks] {note}", file=sys.stderr, flush=True)
    table = write_results("bench_hooks", rows, notes=notes, plot_metric="step_time")
    # The harness draws one generic bar per row; this figure replaces it.
    _replot(output_dir())
    return table

if __name__ == "__main__":
    print(main())
