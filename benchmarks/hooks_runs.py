"""The parent side of :mod:`benchmarks.bench_hooks` on two ranks: run each configuration on fresh rank
processes (killed at a timeout, after a rank failed, or once both sit idle in a mismatched collective),
and turn the outcomes into rows, wire bytes and verdicts.

Example::

    settings = Settings(warmup=2, steps=5, timeout_s=90.0)
    outcome = run_config(BY_NAME["quant8"], None, free_port(), settings)
    print(outcome.status, outcome.step_seconds)
"""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import netlab
from benchmarks.common import free_port, launch, rank_env
from benchmarks.harness import Row
from benchmarks.hooks_jobs import (
    AUTO_SETTLE_STEPS,
    CONFIGS,
    FASTCOMM_CONFIGS,
    LAYERS,
    POWERSGD_MIN_COMPRESSION_RATE,
    POWERSGD_RANK,
    Config,
    make_hook,
)

__all__ = [
    "Outcome",
    "Settings",
    "check_targets",
    "num_params",
    "run_config",
    "run_network",
    "step_time_row",
    "verdict_lines",
]

# Ranks blocked in a mismatched collective use almost no CPU (background threads wake now and then); a
# healthy pair uses about one core each and never waits this long (a dense 1 Gbit/s step waits about 1 s).
_IDLE_HANG_S = 20
_BUSY_CPU_S = 0.5


def num_params() -> int:
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
            make_hook(config.name, {"node_size": config.node_size})
        except (TypeError, ValueError) as exc:
            missing.append(f"{config.fastcomm_names[-1]}(node_size={config.node_size}): {exc}")
    return missing


@dataclasses.dataclass(frozen=True)
class Settings:
    """How each configuration is run."""

    warmup: int
    steps: int
    timeout_s: float
    profile: bool = False
    paired_floor: bool = False  # time the no-op hook's step beside each step (_paired_times)


@dataclasses.dataclass
class Outcome:
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


class _IdleWatch:
    """:func:`benchmarks.common.launch`'s ``stop``: true once the ranks together used under
    ``_BUSY_CPU_S`` of CPU in ``_IDLE_HANG_S`` (blocked in a mismatched collective)."""

    def __init__(self) -> None:
        self.cpu_seconds: float | None = None
        self.busy_at = time.monotonic()
        self.idle = False

    def __call__(self, procs: Sequence[subprocess.Popen[bytes]]) -> bool:
        now = time.monotonic()
        used = _cpu_seconds(procs)
        if used is None or self.cpu_seconds is None or used > self.cpu_seconds + _BUSY_CPU_S:
            self.cpu_seconds, self.busy_at = used, now
        self.idle = now - self.busy_at > _IDLE_HANG_S
        return self.idle


def run_config(config: Config, link: netlab.Link | None, port: int, settings: Settings) -> Outcome:
    """Run ``config`` on fresh rank processes (:func:`_places`) and collect the slower rank's median step
    time."""
    missing = _fastcomm_missing(config)
    if missing:
        return Outcome(f"skipped: not available in fastcomm ({', '.join(missing)})")
    places = _places(link)
    with tempfile.TemporaryDirectory(prefix="bench_hooks_") as tmp:
        commands, envs = [], []
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
            commands.append([*place.prefix, sys.executable, "-m", "benchmarks.bench_hooks",
                             "--rank-spec", json.dumps(spec)])
            envs.append(rank_env(rank, len(places), port, place.master_addr, **place.env))
        logs = [Path(tmp) / f"rank{rank}.log" for rank in range(len(places))]
        idle = _IdleWatch()
        # A rank that died leaves its peer blocked in a collective: 10 s to report before it is killed.
        ranks = launch(commands, envs, logs, settings.timeout_s, fail_grace_s=10.0, poll_s=0.2, stop=idle)
        if ranks.failed:
            # The rank that failed first holds the cause; its peer only sees the connection drop.
            first = ranks.failed[0]
            crashed = sorted(ranks.failed, key=lambda r: ("Connection reset" in _last_error_line(logs[r]),
                                                           r != first))
            rank = crashed[0]
            code = ranks.returncodes[rank]
            return Outcome(f"crashed (rank {rank} exit {code}): {_last_error_line(logs[rank])}")
        if ranks.killed:
            why = f"under {_BUSY_CPU_S} s of CPU in {_IDLE_HANG_S} s" if idle.idle else "timeout"
            hung = list(ranks.killed)
            return Outcome(f"hung: rank(s) {hung} still running after {ranks.seconds:.0f} s ({why}), killed")
        results = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(len(places))]
        if results[0].get("profile"):
            print(f"[bench_hooks] {config.name}: rank 0 profile of one step\n{results[0]['profile']}",
                  file=sys.stderr, flush=True)
    counted = [r["link_sent"] for r in results if r.get("link_sent") is not None]
    floors = [r["floor_seconds"] for r in results if r.get("floor_seconds") is not None]
    return Outcome("ok", max(r["step_seconds"] for r in results), results[0]["stats"],
                    float(sum(counted)) if counted else None, sum(r["cpu_seconds"] for r in results),
                    max(floors) if floors else None)


def _wire_bytes(config: Config, outcome: Outcome, timed_steps: int) -> float | None:
    params = num_params()
    computed = {"allreduce": 4 * params, "noop": 0, "torch_fp16": 2 * params,
                "torch_powersgd_r4": _powersgd_wire_bytes(),
                "torch_powersgd_r4_1bucket": _powersgd_wire_bytes()}
    if config.name in computed:
        return float(computed[config.name])
    if outcome.stats and "sent_bytes" in outcome.stats:
        return outcome.stats["sent_bytes"] / timed_steps
    return None


def step_time_row(
    case: str, name: str, seconds: float | None, dense: float | None, extra: dict[str, Any]
) -> Row:
    """The ``step_time`` row of configuration ``name`` (NaN without a time), its ratio dense allreduce's
    step time over it.

    Example::

        step_time_row("loopback", "quant8", 0.5, 1.0, {})  # ratio 2.0, "allreduce speedup"
    """
    return Row(
        case=case,
        backend=name,
        metric="step_time",
        value=seconds if seconds is not None else math.nan,
        unit="s",
        ratio=dense / seconds if seconds and dense else None,
        ratio_to="allreduce speedup" if seconds and dense else None,
        extra=extra,
    )


def _rows_for(
    network: str, outcomes: dict[str, Outcome], timed_steps: int, link_mb_per_s: float | None
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
            extra["wire_vs_dense"] = round(wire / (4 * num_params()), 4)
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
        rows.append(step_time_row(network, config.name, seconds, dense, extra))
    return rows


def verdict_lines(
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


def check_targets(network: str, rows: list[Row]) -> list[str]:
    """The issue's targets for ``network``, each marked MET, MISSED or not evaluated, with the numbers."""
    times = {r.backend: r.value for r in rows if r.extra.get("status") == "ok"}
    verdict, speedup = verdict_lines(network, times)

    if network == "loopback":
        notes = []
        for name in FASTCOMM_CONFIGS:
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


def run_network(
    network: str,
    configs: Sequence[Config],
    link: netlab.Link | None,
    settings: Settings,
    link_mb_per_s: float | None,
) -> list[Row]:
    """Run every configuration on ``network`` (through ``link`` when given) and return its rows."""
    outcomes: dict[str, Outcome] = {}
    for index, config in enumerate(configs):
        # Fresh namespaces have no other listeners; on loopback ask the kernel for a free port.
        port = 29500 + index if link else free_port()
        start = time.perf_counter()
        outcome = run_config(config, link, port, settings)
        outcomes[config.name] = outcome
        shown = f"{outcome.step_seconds:.3f} s/step" if outcome.status == "ok" else outcome.status
        print(f"[bench_hooks] {network:8s} {config.name:26s} {shown}  ({time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
    return _rows_for(network, outcomes, settings.steps, link_mb_per_s)
