"""This machine's link, measured: gloo allreduce timed between local processes, and a :class:`Link` fitted.

:func:`measure_allreduce` starts ``world_size`` processes joined over gloo on this machine (a file store
in a temporary folder, TCP over loopback), times ``dist.all_reduce`` of fp32 tensors of each size and returns
the slower rank's median. :func:`fit_link` fits ``alpha`` and ``bandwidth`` of the ring model
(:func:`~fastcomm.advise.model.ring_allreduce`) to such times: each parameter from the sizes it dominates,
by least squares of the relative error.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fastcomm.advise.model import Link

__all__ = ["fit_link", "measure_allreduce"]


def _rank_main(spec: Mapping[str, Any]) -> None:
    """One rank of :func:`measure_allreduce`: print ``{size: median seconds}`` as JSON."""
    torch.set_num_threads(1)
    world_size = spec["world_size"]
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(spec["store"], world_size),
        rank=spec["rank"],
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        tensors = {nbytes: torch.ones(max(1, nbytes // 4)) for nbytes in spec["sizes"]}
        for tensor in tensors.values():
            dist.all_reduce(tensor)
        times: dict[int, list[float]] = {nbytes: [] for nbytes in tensors}
        for _ in range(spec["repeat"]):  # rounds over every size: a busy spell hits them alike
            for nbytes, tensor in tensors.items():
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                times[nbytes].append(time.perf_counter() - start)
        pick = min if spec["best"] else statistics.median
        medians = {nbytes: pick(seconds) for nbytes, seconds in times.items()}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(json.dumps(medians), flush=True)


def measure_allreduce(
    sizes: Sequence[int], world_size: int = 2, repeat: int = 7, timeout_s: float = 120.0, best: bool = False
) -> dict[int, float]:
    """Seconds of a gloo allreduce of each size in bytes (fp32) on this machine: the slower rank's median
    of ``repeat`` calls, or its fastest with ``best`` (what the link can do, without the preemptions of a busy
    machine).

    Each rank is a fresh ``python -m fastcomm.advise.calibrate`` process with one thread, over loopback.

    Raises:
        RuntimeError: a rank failed or did not finish within ``timeout_s``.

    Example::

        times = measure_allreduce([1 << 16, 1 << 22], world_size=2, repeat=5)
        link = fit_link(times, 2)
    """
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="fastcomm_advise_") as folder:
        procs = []
        for rank in range(world_size):
            spec = {
                "rank": rank,
                "world_size": world_size,
                "store": os.path.join(folder, "store"),
                "sizes": [int(s) for s in sizes],
                "repeat": repeat,
                "best": best,
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "fastcomm.advise.calibrate", json.dumps(spec)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        try:
            outputs = [proc.communicate(timeout=timeout_s) for proc in procs]
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"gloo allreduce timing did not finish in {timeout_s:.0f} s") from error
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    failed = [
        (proc.returncode, err.strip().splitlines()[-1:])
        for proc, (_, err) in zip(procs, outputs, strict=True)
        if proc.returncode != 0
    ]
    if failed:
        raise RuntimeError(f"gloo allreduce timing failed: {failed}")
    reports = [{int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()} for out, _ in outputs]
    return {int(size): max(report[int(size)] for report in reports) for size in sizes}


# A size whose time is at least this many times the fitted latency term sets the bandwidth
BANDWIDTH_SIZES_X_LATENCY = 8.0


def fit_link(
    times: Mapping[int, float], world_size: int, overlaps_compute: bool = False, name: str = "fitted"
) -> Link:
    """The :class:`Link` whose ring allreduce best fits ``times`` (bytes -> seconds) over ``world_size``.

    ``t = 2 (p-1) alpha + 2 (p-1)/p * n / B`` is linear in ``alpha`` and ``1/B``:

    1. A least-squares line through every point, each weighted by ``1 / t`` (the relative error is what is
       minimised), each parameter kept positive.
    2. ``1 / B`` again, from the sizes whose time is at least ``BANDWIDTH_SIZES_X_LATENCY`` times that
       latency term (with two such sizes or more), by least squares of the time itself, so the largest
       sizes, past any cache, count most: mid-size messages that gloo copies partly in cache (1 MB, 8 MB
       on a machine with a large L3) run faster than large ones, and counted alike they pulled ``B`` up by
       up to a third, so the line missed 12-48 MB allreduces (DDP's buckets) by 20-40%.
    3. ``alpha`` again, from every point with that ``B``.

    Example::

        >>> link = fit_link({1000: 2e-4 + 1e-6, 1_000_000: 2e-4 + 1e-3}, 2)
        >>> round(link.alpha_s * 1e6), round(link.bandwidth_Bps / 1e6)
        (100, 1000)
    """
    if len(times) < 2 or world_size < 2:
        raise ValueError("fit_link needs times at two sizes or more and world_size >= 2")
    p = world_size
    rows = [(2.0 * (p - 1), 2.0 * (p - 1) / p * n, t) for n, t in times.items()]
    alpha, inverse_bandwidth = _line(rows)
    large = [row for row in rows if row[2] >= BANDWIDTH_SIZES_X_LATENCY * row[0] * alpha]
    if alpha > 0 and len(large) >= 2:
        inverse_bandwidth = max(_one_slope([(b, t - a * alpha, 1.0) for a, b, t in large]), 1e-15)
        alpha = max(_one_slope([(a, t - b * inverse_bandwidth, t) for a, b, t in rows]), 0.0)
    return Link(alpha, 1.0 / inverse_bandwidth, overlaps_compute, name)


def _line(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """``(x, y)`` of the least-squares ``a x + b y = t`` over ``(a, b, t)`` rows, weights ``1 / t``, each
    kept positive (``y`` at least 1e-15)."""
    weights = [1.0 / t for _, _, t in rows]
    # normal equations of sum w^2 (a x + b y - t)^2
    saa = sum((w * a) ** 2 for (a, _, _), w in zip(rows, weights, strict=True))
    sbb = sum((w * b) ** 2 for (_, b, _), w in zip(rows, weights, strict=True))
    sab = sum(w * w * a * b for (a, b, _), w in zip(rows, weights, strict=True))
    sat = sum(w * w * a * t for (a, _, t), w in zip(rows, weights, strict=True))
    sbt = sum(w * w * b * t for (_, b, t), w in zip(rows, weights, strict=True))
    det = saa * sbb - sab * sab
    x = (sat * sbb - sbt * sab) / det
    y = (saa * sbt - sab * sat) / det
    if x < 0:  # the latency is too small to see: a line through the origin
        x, y = 0.0, sbt / sbb
    if y <= 0:  # flat times: latency only, and a bandwidth no size here could tell
        x, y = sat / saa, 1e-15
    return x, y


def _one_slope(rows: list[tuple[float, float, float]]) -> float:
    """``x`` of the least-squares ``c x = r`` over ``(c, r, t)`` rows, each residual weighted by ``1 / t``."""
    return sum(c * r / (t * t) for c, r, t in rows) / sum(c * c / (t * t) for c, _, t in rows)


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
