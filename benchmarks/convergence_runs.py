"""The runs of :mod:`benchmarks.bench_convergence`: ``examples/train_lm.py`` on two rank processes, a loss
run per method, its phases timed on a link, and the time to a loss from both.

1. :func:`loss_run`: a method's loss run (cached in the work directory as ``loss-<method>-<steps>.json``
   and reused while its options are the method's).
2. :func:`phase_plan`, :func:`time_phase`, :func:`time_link`: a method's step time per phase (CompressedAdam's
   dense warm-up and compressed steps, DGC's sparsity warm-up, DiLoCo's whole sync periods) on a link.
3. :func:`elapsed`, :func:`time_to_loss`: a loss curve against wall time on a link, each step at its
   phase's step time, linear between validation points.

Example::

    settings = Settings(steps=100, warmup=2, timed=5, data_dir=data, work=work, reuse=True)
    run = loss_run("q8", settings)
    print(run.status, run.result["val_losses"][-1])
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import netlab
from benchmarks.common import free_port, launch, median, rank_env, tail
from benchmarks.lm_methods import EXAMPLE, METHODS, arguments

__all__ = [
    "COMM_TO_COMPUTE",
    "FAST_LINK",
    "FULL_STEPS",
    "LOSS_METHODS",
    "LOSS_ONLY",
    "NAME",
    "REFERENCE",
    "TARGET_SLACK",
    "Phase",
    "Run",
    "Settings",
    "dense_payload_bytes",
    "elapsed",
    "last_phase_step",
    "launch_example",
    "loss_run",
    "mean_step",
    "phase_plan",
    "reference_check",
    "shaped_rate",
    "time_link",
    "time_phase",
    "time_to_loss",
]

NAME = "bench_convergence"
# Rows of the loss comparison, each against its dense reference (AdamW rows: "none"; DGC: dense SGD m0.9).
LOSS_METHODS = (
    "none",
    "cast",
    "q8",
    "q4",
    "topk",
    "sign",
    "powersgd",
    "cadam",
    "cadam_w100",
    "cadam_q8w",
    "cadam_q8",
    "fp16",
    "sgd",
    "sgd_clip",
    "dgc",
    "diloco",
    "diloco_q4",
    "streaming_q4",
)
REFERENCE = {"sgd": "none", "sgd_clip": "sgd", "dgc": "sgd"}
LOSS_ONLY = {"sgd_clip": "a loss reference (top-k at ratio 1.0 sends twice the dense bytes): not timed"}
FULL_STEPS = 500  # the committed result's loss runs
FAST_LINK = "1gbit"
COMM_TO_COMPUTE = 3.0  # the shaped link: dense allreduce's communication about 3x the no-comm step
TARGET_SLACK = 1.02  # time to reach dense AdamW's 500-step validation loss + 2%
FAIL_GRACE_S = 15.0



# ---------------------------------------------------------------------------------------------------------
# Launching one method on two rank processes


@dataclasses.dataclass
class Run:
    """One run of the example: ``"ok"`` and its result (the example's ``TrainResult`` as JSON), or what
    went wrong; and how long it took."""

    status: str  # "ok", or what went wrong
    result: dict[str, Any] | None = None
    seconds: float = 0.0


def launch_example(
    args: Sequence[str], link: netlab.Link | None, port: int, timeout_s: float, work: Path, tag: str
) -> Run:
    """Run ``examples/train_lm.py args`` as ranks 0 and 1 (in the link's namespaces when given)."""
    out = work / f"{tag}.json"
    out.unlink(missing_ok=True)
    master = link.addresses[0] if link else "127.0.0.1"
    command = [sys.executable, str(EXAMPLE), *args, "--json", str(out)]
    commands = [[*link.exec_prefix(r), *command] if link else command for r in range(2)]
    interfaces = link.interfaces if link else ("lo", "lo")
    envs = [rank_env(r, 2, port, master, GLOO_SOCKET_IFNAME=interfaces[r]) for r in range(2)]
    logs = [work / f"{tag}.rank{r}.log" for r in range(2)]
    ranks = launch(commands, envs, logs, timeout_s, fail_grace_s=FAIL_GRACE_S)
    if not ranks.ok:
        return Run(ranks.describe(), seconds=ranks.seconds)
    if not out.exists():
        return Run(f"no result written: {tail(ranks.logs[0])}", seconds=ranks.seconds)
    return Run("ok", json.loads(out.read_text()), ranks.seconds)


# ---------------------------------------------------------------------------------------------------------
# Phases and timing


@dataclasses.dataclass(frozen=True)
class Phase:
    """Steps ``first..last`` of the loss run, timed in a run with ``options`` added.

    ``period``: 0, the step time is the median of the timed steps; else the timed steps are whole periods
    of that many steps (DiLoCo's syncs) and the step time is their mean.
    """

    name: str
    first: int
    last: int
    options: tuple[tuple[str, Any], ...] = ()
    period: int = 0


def phase_plan(method: str, steps: int) -> list[Phase]:
    options = METHODS[method].options
    warmup = int(options.get("warmup_steps", 0))
    if method.startswith("cadam") and 0 < warmup < steps:
        return [
            Phase("dense warm-up", 1, warmup),
            Phase("compressed", warmup + 1, steps, (("warmup_steps", 2),)),
        ]
    if method == "dgc" and 0 < warmup < steps:
        return [
            Phase("sparsity warm-up", 1, warmup),
            Phase("top-k", warmup + 1, steps, (("warmup_steps", 0),)),
        ]
    if METHODS[method].optimizer == "diloco":
        return [Phase("all", 1, steps, period=int(options["sync_every"]))]
    return [Phase("all", 1, steps)]


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a benchmark runs the example: loss-run length, untimed and timed steps of a speed run, the
    prepared data, the work directory, whether a cached run is reused (or only reused), the seed."""

    steps: int
    warmup: int
    timed: int
    data_dir: Path
    work: Path
    reuse: bool
    reuse_only: bool = False
    seed: int = 0  # train_lm's --seed (initial weights and data order); loss runs only


def time_phase(
    method: str, phase: Phase, link: netlab.Link | None, settings: Settings, tag: str, port: int
) -> tuple[dict[str, float] | None, str, str | None]:
    """Medians over the timed steps of ``method`` in ``phase`` on ``link`` (the slower rank's step time,
    rank 0's backward and optimizer step), the run's status, and how a first run crashed if it did.

    A crashed run is run once more (gloo now and then aborts a rank at process exit, after its steps:
    "terminate called without an active exception"); the second run's numbers are the row's, and the
    first run's status is returned for the notes."""
    timed_steps = -(-settings.timed // phase.period) * phase.period if phase.period else settings.timed
    n = settings.warmup + timed_steps
    args = [
        *arguments(method),
        "--steps",
        str(n),
        "--schedule-steps",
        str(settings.steps),
        "--eval-every",
        "0",
        "--val-rows",
        "1",
        "--log-every",
        "0",
        "--data-dir",
        str(settings.data_dir),
    ]
    for key, value in phase.options:
        args += ["--opt", f"{key}={value}"]
    run = launch_example(args, link, port, 90.0 + 20.0 * n, settings.work, tag)
    crashed = None
    if run.status.startswith("crashed"):
        crashed = run.status
        run = launch_example(args, link, port + 5, 90.0 + 20.0 * n, settings.work, f"{tag}-again")
    if run.status != "ok" or run.result is None:
        return None, run.status, crashed
    timed = slice(settings.warmup, None)
    steps_taken = run.result["step_seconds"][timed]
    return (
        {
            "seconds_per_step": sum(steps_taken) / len(steps_taken) if phase.period else median(steps_taken),
            "backward_s": median(run.result["backward_seconds"][timed]),
            "opt_step_s": median(run.result["optimizer_seconds"][timed]),
        },
        "ok",
        crashed,
    )


def time_link(
    methods: Sequence[str],
    link: netlab.Link | None,
    link_name: str,
    settings: Settings,
) -> dict[str, dict[str, Any]]:
    """Per method: each phase's step time on ``link`` (``{"phases": [...], "status": ...}``)."""
    timings: dict[str, dict[str, Any]] = {}
    for index, method in enumerate(methods):
        if method in LOSS_ONLY:
            timings[method] = {"status": f"skipped: {LOSS_ONLY[method]}", "phases": []}
            continue
        phases = []
        status = "ok"
        crashes = []
        for number, phase in enumerate(phase_plan(method, settings.steps)):
            port = 29600 + 10 * index + number if link else free_port()
            begin = time.perf_counter()
            measured, phase_status, crashed = time_phase(
                method, phase, link, settings, f"time-{link_name}-{method}-{number}", port
            )
            if crashed:
                crashes.append(f"{phase.name}: {crashed}")
            shown = (
                f"{measured['seconds_per_step']:.3f} s/step (backward {measured['backward_s']:.3f}, "
                f"optimizer {measured['opt_step_s']:.4f})"
                if measured
                else phase_status
            )
            print(
                f"[{NAME}] {link_name:10s} {method:8s} {phase.name:16s} {shown} "
                f"({time.perf_counter() - begin:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            if measured is None:
                status = phase_status
            phases.append(
                {
                    "name": phase.name,
                    "first": phase.first,
                    "last": phase.last,
                    "seconds_per_step": None,
                    **(measured or {}),
                    "options": dict(phase.options),
                }
            )
        timings[method] = {"status": status, "phases": phases}
        if crashes:
            timings[method]["first_run_crashed"] = crashes
    return timings


def mean_step(timing: dict[str, Any]) -> float | None:
    """The step time averaged over the whole run (phases weighted by their length)."""
    phases = timing.get("phases") or []
    if not phases or any(p["seconds_per_step"] is None for p in phases):
        return None
    steps = sum(p["last"] - p["first"] + 1 for p in phases)
    return sum(p["seconds_per_step"] * (p["last"] - p["first"] + 1) for p in phases) / steps


def last_phase_step(timing: dict[str, Any]) -> float | None:
    phases = timing.get("phases") or []
    return phases[-1]["seconds_per_step"] if phases else None


def elapsed(timing: dict[str, Any], step: int) -> float | None:
    """Wall seconds of steps 1..``step`` on the link: each step at its phase's measured step time."""
    total = 0.0
    for phase in timing.get("phases") or []:
        if phase["seconds_per_step"] is None:
            return None
        steps_in = max(0, min(step, phase["last"]) - phase["first"] + 1)
        total += steps_in * phase["seconds_per_step"]
    return total


def time_to_loss(
    val_steps: Sequence[int], val_losses: Sequence[float], timing: dict[str, Any], target: float
) -> tuple[float | None, float | None]:
    """``(seconds, step)`` at which validation loss first reaches ``target`` (linear between points)."""
    points = [(0, 0.0, math.inf)]
    for step, loss in zip(val_steps, val_losses, strict=True):
        seconds = elapsed(timing, step)
        if seconds is None:
            return None, None
        points.append((step, seconds, loss))
    for (s0, t0, l0), (s1, t1, l1) in zip(points[:-1], points[1:], strict=True):
        if l1 <= target:
            if not math.isfinite(l0):
                return t1, float(s1)
            frac = (l0 - target) / (l0 - l1)
            return t0 + frac * (t1 - t0), s0 + frac * (s1 - s0)
    return None, None


# ---------------------------------------------------------------------------------------------------------
# The shaped link


def dense_payload_bytes(train_lm: Any) -> int:
    return 4 * sum(p.numel() for p in train_lm.GPT(train_lm.ModelConfig()).parameters())


def shaped_rate(noop_seconds: float, payload_bytes: int) -> str:
    """The tbf rate at which a ring allreduce of ``payload_bytes`` between 2 ranks (each sends the payload
    once) takes ``COMM_TO_COMPUTE`` x ``noop_seconds``, rounded to a whole Mbit/s."""
    bits_per_second = 8 * payload_bytes / (COMM_TO_COMPUTE * noop_seconds)
    return f"{max(1, round(bits_per_second / 1e6))}mbit"


# ---------------------------------------------------------------------------------------------------------
# Loss runs


def loss_run(method: str, settings: Settings) -> Run:
    """Method ``method``'s loss run: its cached result in ``settings.work`` while that was trained with the
    method's options from step 0, else a fresh run (or, with ``reuse_only``, a status saying why not)."""
    tag = f"loss-{method}-{settings.steps}" + (f"-s{settings.seed}" if settings.seed else "")
    cached = settings.work / f"{tag}.json"
    if settings.reuse and cached.exists():
        found = json.loads(cached.read_text())
        wanted = json.loads(json.dumps(METHODS[method].options))
        if found.get("options") == wanted and found.get("start_step") == 0:
            return Run("ok", found)
        if settings.reuse_only:
            return Run(
                f"not run: {cached.name} was trained with options {found.get('options')} from step "
                f"{found.get('start_step')}, the method now has {wanted} from step 0"
            )
    if settings.reuse_only:
        return Run(f"not run: no {cached.name} in --work-dir (--reuse-only)")
    args = [
        *arguments(method),
        "--steps",
        str(settings.steps),
        "--eval-every",
        "50",
        "--log-every",
        "50",
        "--data-dir",
        str(settings.data_dir),
        "--seed",
        str(settings.seed),
    ]
    run = launch_example(args, None, free_port(), 120.0 + 6.0 * settings.steps, settings.work, tag)
    return run


def reference_check(kept: Run, settings: Settings) -> str:
    """Train dense AdamW's first 50 steps again and say whether they repeat ``kept``'s losses bit for bit
    (a merge keeps dense's loss curve as the loss reference: this checks that the code and data still give
    it)."""
    if kept.result is None or not kept.result.get("val_steps"):
        return "dense reference check: not run (the kept dense run has no curve)"
    check = min(50, settings.steps, kept.result["val_steps"][0])
    args = [
        *arguments("none"),
        "--steps",
        str(settings.steps),
        "--stop-after",
        str(check),
        "--eval-every",
        str(check),
        "--log-every",
        "0",
        "--data-dir",
        str(settings.data_dir),
    ]
    run = launch_example(args, None, free_port(), 120.0 + 6.0 * check, settings.work, "reference-check-none")
    if run.status != "ok" or run.result is None:
        return f"dense reference check: failed to run ({run.status})"
    same_train = run.result["train_losses"] == kept.result["train_losses"][:check]
    same_val = (
        kept.result["val_steps"][0] == check and run.result["val_losses"][0] == kept.result["val_losses"][0]
    )
    if same_train and same_val:
        return (
            f"dense reference check: dense AdamW's first {check} steps trained again repeat the kept "
            f"run's training and validation losses bit for bit (val loss {run.result['val_losses'][0]:.4f})"
        )
    return (
        f"dense reference check: DIFFERS, dense AdamW's first {check} steps trained again give val loss "
        f"{run.result['val_losses'][0]:.6f} (kept: {kept.result['val_losses'][0]:.6f}), training losses "
        f"{'equal' if same_train else 'different'}: the kept rows may be stale; rerun 'none' with the rest"
    )


