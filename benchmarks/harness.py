"""The shared benchmark harness: typed rows, one timer, and one writer of JSON + Markdown + PNG.

Every benchmark script builds a list of :class:`Row` (the metric's unit travels with it) and calls
:func:`write_results`, which stamps each row with the machine and versions and writes ``<name>.json``,
``<name>.md`` and ``<name>.png`` to :func:`output_dir`: the one place every benchmark writes to.

:func:`output_dir` is ``$FASTLIB_BENCH_OUTPUT`` when set, else a run folder of this process,
``benchmarks/runs/<UTC time>/`` (git-ignored), so a run never overwrites the committed results in
``benchmarks/results/`` (:data:`RESULTS_DIR`) unless asked: ``make bench UPDATE_RESULTS=1``, or
``FASTLIB_BENCH_OUTPUT=benchmarks/results`` for one script. Earlier results a script builds on
(``--merge``, ``--replot``) are read from :data:`RESULTS_DIR`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"  # the committed results
RUNS_DIR = Path(__file__).resolve().parent / "runs"  # one folder per run, git-ignored
OUTPUT_ENV = "FASTLIB_BENCH_OUTPUT"
HEARTBEAT_S = 25.0  # a silent benchmark says it is alive this often (the issue asks for every 30 s or less)

__all__ = [
    "OUTPUT_ENV",
    "RESULTS_DIR",
    "RUNS_DIR",
    "HEARTBEAT_S",
    "Row",
    "heartbeat",
    "kill_process_groups",
    "machine_info",
    "markdown_table",
    "output_dir",
    "progress",
    "run_folder",
    "time_call",
    "write_results",
]


def run_folder(now: time.struct_time) -> Path:
    """The run folder of a run started at ``now`` (UTC): ``benchmarks/runs/<YYYYmmdd-HHMMSS>Z``."""
    return RUNS_DIR / time.strftime("%Y%m%d-%H%M%SZ", now)


@functools.cache
def _this_run_folder() -> Path:
    return run_folder(time.gmtime())


def output_dir() -> Path:
    """Where benchmarks write: ``$FASTLIB_BENCH_OUTPUT`` if set, else this process's run folder."""
    chosen = os.environ.get(OUTPUT_ENV)
    return Path(chosen) if chosen else _this_run_folder()


_STARTED = time.monotonic()
_last_progress = _STARTED


def progress(message: str) -> None:
    """Print ``[<seconds since the process started> s] message`` to stderr at once, and note the time, so
    that :func:`heartbeat` stays quiet while progress lines come often enough.

    Example::

        progress("loss run 2 of 3: q8")   # [  83 s] loss run 2 of 3: q8
    """
    global _last_progress
    _last_progress = time.monotonic()
    print(f"[{_last_progress - _STARTED:5.0f} s] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def heartbeat(label: str, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """While the block runs, a daemon thread prints ``label: still running`` through :func:`progress`
    whenever no progress line came for ``every_s`` seconds, so long silent work (a child process training,
    a shard set being written) still shows it is alive.

    Example::

        with heartbeat("bench_hooks"):
            bench_hooks.main(["--quick"])
    """
    done = threading.Event()
    began = time.monotonic()

    def beat() -> None:
        def silent_since() -> float:
            return max(_last_progress, began)

        while not done.wait(max(0.05, silent_since() + every_s - time.monotonic())):
            if time.monotonic() - silent_since() >= every_s:
                progress(f"{label}: still running ({time.monotonic() - began:.0f} s)")

    thread = threading.Thread(target=beat, name=f"heartbeat-{label}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@dataclasses.dataclass
class Row:
    """One measurement: ``value`` in ``unit`` of ``metric`` for ``case`` run by ``backend``."""

    case: str
    backend: str
    metric: str
    value: float
    unit: str
    ratio: float | None = None  # against the case's named baseline, when there is one
    ratio_to: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def machine_info() -> dict[str, Any]:
    import torch

    info = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import fastcomm

        info["fastcomm_backend"] = {op: entry.to_dict() for op, entry in fastcomm.backend().items()}
    except ImportError:
        pass
    return info


def time_call(
    fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1, sync: Callable[[], None] | None = None
) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
        if sync:
            sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fmt(value: float | None) -> str:
    if value is None:
        return ""
    if value == 0 or 0.01 <= abs(value) < 1e6:
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:.3e}"


def markdown_table(rows: list[Row]) -> str:
    extra_keys = sorted({k for r in rows for k in r.extra})
    head = ["case", "backend", "metric", "value", "unit", "ratio", "vs", *extra_keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.case, r.backend, r.metric, _fmt(r.value), r.unit, _fmt(r.ratio), r.ratio_to or ""]
        cells += [str(r.extra.get(k, "")) for k in extra_keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(name: str, rows: list[Row], path: Path, metric: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [r for r in rows if metric is None or r.metric == metric]
    if not chosen:
        return
    labels = [f"{r.case}\n{r.backend}" for r in chosen]
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(chosen)), 4.5))
    ax.bar(range(len(chosen)), [r.value for r in chosen], color="#4472c4")
    ax.set_xticks(range(len(chosen)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(f"{chosen[0].metric} ({chosen[0].unit})")
    ax.set_title(name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _without_nan(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _without_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nan(v) for v in value]
    return value


def write_results(
    name: str, rows: list[Row], *, notes: list[str] | None = None, plot_metric: str | None = None
) -> str:
    """Write ``<name>.json/.md/.png`` to :func:`output_dir` and return the Markdown table."""
    out = output_dir()
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    payload = {
        "benchmark": name,
        "machine": info,
        "notes": notes or [],
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    # A crashed or skipped configuration has no number: null in JSON (NaN is not JSON).
    text_json = json.dumps(_without_nan(payload), indent=2, default=str, allow_nan=False)
    (out / f"{name}.json").write_text(text_json)
    table = markdown_table(rows)
    machine = f"{info['machine']}, {info['cpus']} CPUs, torch {info['torch']}, CUDA: {info['cuda']}"
    text = f"# {name}\n\nMachine: {machine}\n\n{table}\n"
    if notes:
        text += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    (out / f"{name}.md").write_text(text)
    _plot(name, rows, out / f"{name}.png", plot_metric)
    print(f"[{name}] results written to {out}", file=sys.stderr, flush=True)
    return text


def kill_process_groups(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL each benchmark rank's whole process group (a rank may have children) and reap it."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.wait()
