""":func:`predict`: the step time of every method, flat and two-level, as rows of data; :func:`format_table`
prints them.

A step is ``compute + compression + the communication it does not hide`` (:mod:`fastcomm.advise.model`'s
assumptions). The speedup of a row is the flat dense allreduce's step time over its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fastcomm.advise.kernels import KernelRates, kernel_rates
from fastcomm.advise.methods import METHODS, Method, method_cost, method_of
from fastcomm.advise.model import Link, Topology, exposed_seconds, parse_link, parse_seconds

__all__ = ["COMPUTE_BOUND_SHARE", "Prediction", "format_table", "predict"]

# dense allreduce showing less than this share of the compute: the step is compute-bound
COMPUTE_BOUND_SHARE = 0.05
DDP_BUCKET_MB = 25.0


@dataclass(frozen=True)
class Prediction:
    """One method under one schedule: the predicted step and where its time goes.

    Attributes:
        method: the :class:`~fastcomm.advise.methods.Method`'s name.
        schedule: ``"flat"`` or ``"two-level"``.
        step_s: predicted seconds per step (``None`` where the method has no such schedule).
        speedup: the flat dense allreduce's step time over this one's.
        vs_flat: (two-level rows) the method's flat step time over this one's.
        compute_s, codec_s, comm_s, exposed_s: the step's compute, the compression kernels, the
            communication, and the part of it the step shows.
        cross_node_bytes: bytes each node sends to the others per step (each way).
        sent_bytes: bytes one rank hands to the network per step.
        reason: why the row comes out as it does, in words.

    Example::

        row = predict(1.3e9, 64, 8, "25gbit", "nvlink", 0.8)[0]
        print(row.method, row.schedule, row.step_s, row.reason)   # allreduce flat 3.8 link-bound: ...
    """

    method: str
    schedule: str
    step_s: float | None
    speedup: float | None
    vs_flat: float | None
    compute_s: float
    codec_s: float
    comm_s: float
    exposed_s: float
    cross_node_bytes: float
    sent_bytes: float
    reason: str


def _as_link(link: str | Link, latency_s: float | None) -> Link:
    if isinstance(link, Link):
        return link
    parsed = parse_link(link)
    if latency_s is not None and parsed.name not in ("nvlink", "pcie", "loopback"):
        return Link(latency_s, parsed.bandwidth_Bps, parsed.overlaps_compute, parsed.name)
    return parsed


def _square_shapes(params: int, side: int) -> list[tuple[int, ...]]:
    """``params`` as square ``side x side`` matrices and one vector of the rest (PowerSGD's default)."""
    matrices, rest = divmod(params, side * side)
    return [(side, side)] * matrices + ([(rest,)] if rest else [])


def _reason(
    method: Method,
    step: float,
    dense: Prediction,
    flat: Prediction | None,
    codec: float,
    exposed: float,
    crossing: float,
    compute_bound: bool,
) -> str:
    """Why a row comes out as it does: compute-bound, link-bound, what compression buys, two levels."""
    if compute_bound:
        return (
            f"compute-bound: no hook helps (dense allreduce shows {dense.exposed_s * 1e3:.0f} ms of "
            f"communication in a {dense.step_s:.3g} s step)"
        )
    if flat is not None and flat.step_s is not None:
        gain = flat.step_s / step
        shown = f"shows {exposed:.3g} s of communication (flat {flat.exposed_s:.3g} s)"
        if gain >= 1.0:
            return (
                f"two-level {gain:.2f}x flat: {flat.cross_node_bytes / 1e6:,.0f} -> {crossing / 1e6:,.0f} MB "
                f"across each node's link; {shown}"
            )
        return (
            f"flat {1 / gain:.2f}x faster: the dense reduction and gather inside the node cost more; {shown}"
        )
    if method.compressor is None:
        return f"link-bound: {exposed:.3g} s of communication shows"
    saved = dense.exposed_s - exposed
    if saved <= 0:
        return (
            f"shows more communication than dense allreduce ({exposed:.3g} s vs {dense.exposed_s:.3g} s): "
            f"{crossing / 1e6:,.0f} MB across each node's link, "
            f"the dense ring {dense.cross_node_bytes / 1e6:,.0f} MB"
        )
    if codec >= saved:
        return f"compression ({codec:.3g} s) costs more than the {saved:.3g} s of communication it saves"
    return f"saves {saved:.3g} s of communication for {codec:.3g} s of compression"


def predict(
    params: float,
    gpus: int,
    gpus_per_node: int | None = None,
    link: str | Link = "25gbit",
    intra: str | Link = "nvlink",
    step_compute: float | str = 0.5,
    *,
    latency_s: float | None = None,
    rates: KernelRates | None = None,
    methods: Sequence[Method | str] = METHODS,
    bucket_mb: float = DDP_BUCKET_MB,
    buckets: int | None = None,
    backward_share: float = 2 / 3,
    shapes: Sequence[Sequence[int]] | None = None,
    matrix_side: int = 4096,
) -> list[Prediction]:
    """Predicted step time of each method, flat then two-level, for a data-parallel job.

    Args:
        params: fp32 parameters (gradients) of the model.
        gpus: ranks in all; gpus_per_node: ranks per node (default: all on one node).
        link: each node's link to the others (``25gbit``, ``100mbit``, a :class:`Link`).
        intra: the link inside a node (``nvlink``, ``pcie``, ``loopback``, a rate, a :class:`Link`).
        step_compute: seconds of forward, backward and optimizer per step with no communication.
        latency_s: per-message latency of ``link`` (default 25 us).
        rates: kernel throughputs (default: :func:`~fastcomm.advise.kernels.kernel_rates` for the CPU).
        methods: the methods to price, or their names (``"quantize8"``; default
            :data:`~fastcomm.advise.methods.METHODS`).
        bucket_mb, buckets: DDP's bucket size, or the number of buckets directly.
        backward_share: the backward pass's share of ``step_compute`` (what communication can hide behind).
        shapes, matrix_side: the parameters' shapes for PowerSGD, else square matrices of ``matrix_side``.

    Returns:
        One :class:`Prediction` per method and schedule, in the order of ``methods``, flat ones first
        (speedups are over the flat dense allreduce, priced even when ``methods`` leaves it out).

    Raises:
        ValueError: a name no method has, or a link or time that does not parse; an old method name
            (``"quant8"``) warns (``DeprecationWarning``) with its new one.

    Example::

        rows = fastcomm.advise.predict(1.3e9, 64, 8, "25gbit", "nvlink", "0.8s")
        best = min((r for r in rows if r.step_s), key=lambda r: r.step_s)
        print(best.method, best.schedule, best.speedup, best.reason)
    """
    methods = [m if isinstance(m, Method) else method_of(m, stacklevel=3) for m in methods]
    numel = int(params)
    per_node = gpus if gpus_per_node is None else gpus_per_node
    topology = Topology(gpus, per_node, inter=_as_link(link, latency_s), intra=_as_link(intra, None))
    compute = parse_seconds(step_compute)
    rates = rates if rates is not None else kernel_rates("cpu")
    count = buckets or max(1, math.ceil(4 * numel / (bucket_mb * 1e6)))
    shapes = list(shapes) if shapes is not None else _square_shapes(numel, matrix_side)
    backward = backward_share * compute
    one_node = topology.nodes == 1 or per_node == 1

    def priced(method: Method, hierarchical: bool) -> tuple[float, float, float, float, float, float]:
        cost = method_cost(method, topology, numel, count, rates, shapes, hierarchical)
        exposed = exposed_seconds(cost.transfers, topology, backward, count) if gpus > 1 else 0.0
        comm = sum(t.seconds for t in cost.transfers)
        crossing = sum(t.cross_node_bytes for t in cost.transfers)
        return compute + cost.codec_s + exposed, cost.codec_s, comm, exposed, crossing, cost.sent_bytes

    dense_method = next((m for m in methods if m.compressor is None), METHODS[0])
    step, codec, comm, exposed, crossing, sent = priced(dense_method, False)
    dense = Prediction(
        dense_method.name, "flat", step, 1.0, None, compute, codec, comm, exposed, crossing, sent, ""
    )
    compute_bound = dense.exposed_s < COMPUTE_BOUND_SHARE * compute
    rows: list[Prediction] = []
    flat_rows: dict[str, Prediction] = {}
    for schedule in ("flat", "two-level"):
        for method in methods:
            if schedule == "two-level" and (method.flat_only or one_node):
                why = method.flat_only or (
                    "one node: nothing crosses nodes"
                    if topology.nodes == 1
                    else "one GPU per node: two-level is flat"
                )
                rows.append(
                    Prediction(
                        method.name,
                        schedule,
                        None,
                        None,
                        None,
                        compute,
                        0.0,
                        0.0,
                        0.0,
                        0.0,
                        0.0,
                        f"no two-level form ({why})",
                    )
                )
                continue
            step, codec, comm, exposed, crossing, sent = priced(method, schedule == "two-level")
            flat = flat_rows.get(method.name) if schedule == "two-level" else None
            reason = _reason(method, step, dense, flat, codec, exposed, crossing, compute_bound)
            row = Prediction(
                method.name,
                schedule,
                step,
                dense.step_s / step if dense.step_s else None,
                flat.step_s / step if flat is not None and flat.step_s else None,
                compute,
                codec,
                comm,
                exposed,
                crossing,
                sent,
                reason,
            )
            rows.append(row)
            if schedule == "flat":
                flat_rows[method.name] = row
    return rows


def format_table(rows: Sequence[Prediction]) -> str:
    """The rows as an aligned text table: method, schedule, step time, speedup, parts, reason.

    Example::

        print(format_table(predict(1.3e9, 64, 8, "25gbit", "nvlink", 0.8)))
    """
    head = (
        "method",
        "schedule",
        "step s",
        "speedup",
        "vs flat",
        "compute",
        "compress",
        "comm shown",
        "cross-node MB",
        "reason",
    )
    lines = [head]
    for r in rows:
        if r.step_s is None:
            lines.append((r.method, r.schedule, "n/a", "", "", "", "", "", "", r.reason))
            continue
        lines.append(
            (
                r.method,
                r.schedule,
                f"{r.step_s:.3f}",
                f"{r.speedup:.2f}x",
                f"{r.vs_flat:.2f}x" if r.vs_flat else "",
                f"{r.compute_s:.3f}",
                f"{r.codec_s:.3f}",
                f"{r.exposed_s:.3f}",
                f"{r.cross_node_bytes / 1e6:.1f}",
                r.reason,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)) + "  " + line[-1]
        for line in lines
    )
