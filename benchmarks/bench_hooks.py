"""Step time of DDP with each communication hook, 2 gloo ranks, on loopback and on a shaped 1 Gbit/s link.

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

Wire bytes are the payload each rank hands to the network per step: computed for torch's hooks (4, 2 bytes
per parameter; P and Q factors plus uncompressed 1-D tensors for powerSGD) and read from ``stats()`` for
fastcomm's. Ratios: ``ratio`` is dense allreduce time / this time (above 1 is faster than allreduce),
``x_noop_floor`` is this time / the no-op hook's time, ``speedup_vs_fp16`` is the fp16 hook's time / this.

Run::

    python -m benchmarks.bench_hooks                 # both networks, 2 warm-up + 5 timed steps each
    python -m benchmarks.bench_hooks --quick --network loopback
    python -m benchmarks.bench_hooks --replot          # redraw the PNG from results/bench_hooks.json
"""

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import socket
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
from benchmarks.harness import RESULTS_DIR, Row, kill_process_groups, time_call, write_results

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
)
_FASTCOMM_CONFIGS = tuple(c.name for c in CONFIGS if c.fastcomm_names)


# ---------------------------------------------------------------------------------------------------------
# Rank process


# DDP compares these annotations with the real classes, so this module must not postpone annotations.
def _noop_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Return the bucket's own gradients in a completed future, communicating nothing."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _make_hook(name: str) -> tuple[Any, Callable[..., Any]] | None:
    """The ``(state, hook)`` pair of configuration ``name``, or ``None`` for plain allreduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "allreduce":
        return None
    if name == "noop":
        return None, _noop_hook
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

    fastcomm_pairs: dict[str, Callable[[], tuple[Any, Callable[..., Any]]]] = {
        "bf16_cast": lambda: (fastcomm.CastState(dtype=torch.bfloat16), fastcomm.cast_hook),
        "topk_0.01": lambda: (fastcomm.TopKState(ratio=0.01), fastcomm.topk_hook),
        "quant8": lambda: (fastcomm.QuantState(bits=8), fastcomm.quantize_hook),
        "quant4": lambda: (fastcomm.QuantState(bits=4), fastcomm.quantize_hook),
        "sign": lambda: (fastcomm.SignState(), fastcomm.sign_hook),
        "powersgd_r4": lambda: (fastcomm.PowerSGDState(rank=POWERSGD_RANK), fastcomm.powersgd_hook),
    }
    return fastcomm_pairs[name]()


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
    """The hook's counters over the timed steps only (warm-up allocates residuals and rebuilds buckets)."""
    if before is None or after is None:
        return None
    delta = {k: after[k] - before[k] for k in after if k != "compression_ratio"}
    if delta.get("bytes_sent"):
        delta["compression_ratio"] = delta.get("dense_bytes", 0.0) / delta["bytes_sent"]
    return delta


def _profile_step(step: Callable[[], None]) -> str:
    """Run ``step`` once under the CPU profiler; return the ops that took the most time of their own."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        step()
    return str(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


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
        pair = _make_hook(spec["config"])
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

        for _ in range(spec["warmup"]):
            step()
        before = _hook_stats(state)
        seconds = time_call(step, repeat=spec["steps"], warmup=0)
        stats = _stats_delta(before, _hook_stats(state))
        profile = _profile_step(step) if spec["profile"] else None
        dist.barrier()
    finally:
        gc.collect()  # free DDP's reference cycles before gloo is torn down, not during finalization
        dist.destroy_process_group()
    result = {"rank": rank, "step_seconds": seconds, "stats": stats, "profile": profile}
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
    return [name for name in config.fastcomm_names if not hasattr(fastcomm, name)]


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class _Settings:
    """How each configuration is run."""

    warmup: int
    steps: int
    timeout_s: float
    profile: bool = False


@dataclasses.dataclass
class _Outcome:
    status: str
    step_seconds: float = math.nan
    stats: dict[str, float] | None = None


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
    """Run ``config`` on two fresh rank processes and collect the slower rank's median step time."""
    missing = _fastcomm_missing(config)
    if missing:
        return _Outcome(f"skipped: not available in fastcomm ({', '.join(missing)})")
    with tempfile.TemporaryDirectory(prefix="bench_hooks_") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        try:
            for rank in range(2):
                spec = {
                    "config": config.name, "bucket_cap_mb": config.bucket_cap_mb, "rank": rank,
                    "world_size": 2, "port": port, "warmup": settings.warmup, "steps": settings.steps,
                    "timeout_s": settings.timeout_s, "profile": settings.profile,
                    "out": str(Path(tmp) / f"rank{rank}.json"),
                    "master_addr": link.addresses[0] if link else "127.0.0.1",
                }
                pythonpath = os.pathsep.join(filter(None, (str(_REPO_ROOT), os.environ.get("PYTHONPATH"))))
                env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath,
                           GLOO_SOCKET_IFNAME=link.interfaces[rank] if link else "lo")
                prefix = link.exec_prefix(rank) if link else []
                command = [*prefix, sys.executable, "-m", "benchmarks.bench_hooks",
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
        results = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
        if results[0].get("profile"):
            print(f"[bench_hooks] {config.name}: rank 0 profile of one step\n{results[0]['profile']}",
                  file=sys.stderr, flush=True)
    return _Outcome("ok", max(r["step_seconds"] for r in results), results[0]["stats"])


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


def _check_targets(network: str, rows: list[Row]) -> list[str]:
    """The issue's targets for ``network``, each marked MET, MISSED or not evaluated, with the numbers."""
    times = {r.backend: r.value for r in rows if r.extra.get("status") == "ok"}

    def verdict(label: str, needed: Sequence[str], test: Callable[[], tuple[bool, str]]) -> str:
        absent = [n for n in needed if n not in times]
        if absent:
            return f"{network}: {label}: not evaluated (no step time for {', '.join(absent)})"
        passed, detail = test()
        return f"{network}: {label}: {'MET' if passed else 'MISSED'} ({detail})"

    def speedup(name: str, base: str, at_least: float) -> tuple[bool, str]:
        value = times[base] / times[name]
        return value >= at_least, f"{base} {times[base]:.3f} s / {name} {times[name]:.3f} s = {value:.2f}x"

    if network == "loopback":
        notes = []
        for name in _FASTCOMM_CONFIGS:
            def slower(name: str = name) -> tuple[bool, str]:
                value = times[name] / times["allreduce"]
                dense = times["allreduce"]
                return value <= 1.5, f"{name} {times[name]:.3f} s / allreduce {dense:.3f} s = {value:.2f}x"

            notes.append(verdict(f"{name} at most 1.5x slower than allreduce", (name, "allreduce"), slower))
        return notes

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
        port = 29500 + index if link else _free_loopback_port()
        start = time.perf_counter()
        outcome = _run_config(config, link, port, settings)
        outcomes[config.name] = outcome
        shown = f"{outcome.step_seconds:.3f} s/step" if outcome.status == "ok" else outcome.status
        print(f"[bench_hooks] {network:8s} {config.name:26s} {shown}  ({time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
    return _rows_for(network, outcomes, settings.steps, link_mb_per_s)


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


def _replot() -> None:
    plot_results(json.loads((RESULTS_DIR / "bench_hooks.json").read_text()), RESULTS_DIR / "bench_hooks.png")


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark, write ``benchmarks/results/bench_hooks.*`` and return the Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 warm-up + 2 timed steps (default 2 + 5)")
    parser.add_argument("--network", choices=(*NETWORKS, "both"), default="both")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per configuration before its ranks are killed")
    parser.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                        help="comma-separated subset of the configurations to run (default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile one more step on rank 0 and print its top ops")
    parser.add_argument("--replot", action="store_true",
                        help="redraw bench_hooks.png from the existing bench_hooks.json; run nothing")
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.rank_spec:
        _rank_main(json.loads(args.rank_spec))
        return ""
    if args.replot:
        _replot()
        return (RESULTS_DIR / "bench_hooks.md").read_text()

    warmup, steps = (2, 2) if args.quick else (2, 5)
    # Generous: a dense step on the 1 Gbit link takes about 1 s; process start and DDP setup about 10 s.
    settings = _Settings(warmup, steps, args.timeout or 45.0 + 6.0 * (warmup + steps), args.profile)
    networks = NETWORKS if args.network == "both" else (args.network,)
    chosen = args.configs.split(",")
    unknown = sorted(set(chosen) - {c.name for c in CONFIGS})
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {[c.name for c in CONFIGS]}")
    configs = tuple(c for c in CONFIGS if c.name in chosen)
    params = _num_params()
    notes = [
        f"model: MLP {'-'.join(map(str, LAYERS))} with biases, {params / 1e6:.2f}M fp32 parameters "
        f"({4 * params / 1e6:.1f} MB of gradients), batch {BATCH} per rank, SGD",
        f"2 gloo ranks, one thread each; {warmup} warm-up + {steps} timed steps per configuration, "
        "time = slower rank's median step",
        "ratio = allreduce step time / this step time (above 1 = faster than dense allreduce); "
        "x_noop_floor = this step time / the no-op hook's",
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
    _replot()
    return table


if __name__ == "__main__":
    print(main())
