"""bench_fsdp's rows (one builder per part, from the ranks' JSON) and verdicts (each target's outcome,
computed from the rows, so that a ``--merge`` computes them again).

Example::

    from benchmarks.fsdp_rows import speed_case, speed_rows, verdicts
    rows = speed_rows({"dense": {"step_s": 2.0, "params": 9}, "q8": {"step_s": 1.0, "params": 9}},
                      speed_case("1gbit", "bf16-keep"))
    speed_case("1gbit", "bf16-keep")         # 'speed-1gbit bf16-keep'
    for note in verdicts(rows):
        print(note)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from benchmarks import harness

__all__ = [
    "DEFAULT_LAYOUT",
    "hsdp_rows",
    "lm_rated",
    "lm_rows",
    "loss_rows",
    "memory_rows",
    "speed_case",
    "speed_rows",
    "verdicts",
]

DEFAULT_LAYOUT = "fp32"  # FSDP2's defaults; its speed cases carry no layout word
SPEED_TARGETS = {"loopback": "1/1.1x (loopback)", "1gbit": "2x (1 Gbit/s)"}


def speed_case(network: str, layout: str) -> str:
    """The case of the speed rows measured on ``network`` with parameters held as ``layout``."""
    return f"speed-{network}" if layout == DEFAULT_LAYOUT else f"speed-{network} {layout}"


def loss_rows(loss: dict[str, Any], layout: str = DEFAULT_LAYOUT) -> list[harness.Row]:
    """The loss part's rows; their cases carry the layout's name after a space unless it is fp32."""
    dense = loss["dense"]["val_loss"]
    suffix = "" if layout == DEFAULT_LAYOUT else f" {layout}"
    rows = [
        harness.Row(
            f"loss{suffix}",
            m,
            "val_loss",
            r["val_loss"],
            "mse",
            r["val_loss"] / dense,
            "dense",
            {"params": r["params"]},
        )
        for m, r in loss.items()
    ]
    rows += [
        harness.Row(f"correctness{suffix}", m, "first_grad_rel_error", r["grad_rel_error"], "relative L2")
        for m, r in loss.items()
    ]
    rows += [
        harness.Row(
            f"memory{suffix}", m, "residual_bytes_per_param", r["residual_bytes_per_param"], "B/param"
        )
        for m, r in loss.items()
    ]
    rows += [
        harness.Row(f"traffic{suffix}", m, "reduce_scatter_compression", r["compression_ratio"], "x")
        for m, r in loss.items()
    ]
    return rows


def speed_rows(results: dict[str, Any], case: str) -> list[harness.Row]:
    dense = results["dense"]
    rows = []
    for method, r in results.items():
        extra: dict[str, Any] = {"params": r["params"]}
        if r.get("link_bytes_per_step") is not None:
            extra["link_MB/step"] = round(r["link_bytes_per_step"] / 1e6, 2)
            extra["link_vs_dense"] = round(r["link_bytes_per_step"] / dense["link_bytes_per_step"], 3)
        rows.append(
            harness.Row(
                case, method, "step_time", r["step_s"], "s", r["step_s"] / dense["step_s"], "dense", extra
            )
        )
    return rows


def memory_rows(results: dict[str, Any]) -> list[harness.Row]:
    rows = []
    for metric in ("peak_bytes", "persistent_bytes"):
        dense = results["dense"][metric]
        rows += [
            harness.Row(
                "memory-peak",
                m,
                f"{metric}_per_param",
                r[metric] / r["params"],
                "B/param",
                r[metric] / dense,
                "dense",
                {"params": r["params"], "residual_B/param": round(r["residual_bytes"] / r["params"], 3)},
            )
            for m, r in results.items()
        ]
    return rows


def hsdp_rows(results: dict[str, Any]) -> list[harness.Row]:
    dense = results["dense"]
    rows = []
    for method, r in results.items():
        extra = {
            "params": r["params"],
            "payload_MB/step": round(r["payload_bytes_per_step"] / 1e6, 3),
            "payload_vs_dense": round(r["payload_bytes_per_step"] / dense["payload_bytes_per_step"], 4),
        }
        if r.get("link_bytes_per_step") is not None:
            rows.append(
                harness.Row(
                    "hsdp-nodes",
                    method,
                    "cross_node_bytes",
                    r["link_bytes_per_step"] / 1e6,
                    "MB/step",
                    r["link_bytes_per_step"] / dense["link_bytes_per_step"],
                    "dense",
                    extra,
                )
            )
        rows.append(
            harness.Row(
                "hsdp-nodes",
                method,
                "step_time",
                r["step_s"],
                "s",
                r["step_s"] / dense["step_s"],
                "dense",
                {"params": r["params"]},
            )
        )
    return rows


def lm_rows(results: dict[str, Any]) -> list[harness.Row]:
    """The validation loss of each LM method (ratios by :func:`_lm_rated`)."""
    rows = []
    for method, r in results.items():
        extra = {"params": r["params"], "optimizer": r["optimizer"], "s/step": round(r["step_s"], 3)}
        if r.get("diverged"):
            extra["diverged"] = r["diverged"]
        rows.append(harness.Row("lm", method, "val_loss", r["val_loss"], "nats/byte", None, None, extra))
    return rows


def lm_rated(rows: Sequence[harness.Row]) -> list[harness.Row]:
    """``rows`` with each LM row's ratio to the dense run of its optimizer (``none`` for AdamW, ``sgd`` for
    SGD), where that run is among them."""
    dense = {r.extra["optimizer"]: r for r in rows if r.case == "lm" and r.backend in ("none", "sgd")}
    rated = []
    for row in rows:
        base = dense.get(row.extra.get("optimizer")) if row.case == "lm" else None
        if base is not None and math.isfinite(row.value or math.nan):
            row = dataclasses.replace(row, ratio=row.value / base.value, ratio_to=base.backend)
        rated.append(row)
    return rated


def _find(rows: Sequence[harness.Row], case: str, backend: str, metric: str) -> harness.Row | None:
    return next((r for r in rows if (r.case, r.backend, r.metric) == (case, backend, metric)), None)


def _gap_note(row: harness.Row | None, label: str, target: float) -> list[str]:
    if row is None or row.ratio is None:
        return []
    gap = row.ratio - 1
    verdict = "meets" if gap <= target else "misses"
    return [
        f"{label} validation loss {gap:+.2%} vs {row.ratio_to} (lower is better): {verdict} the target of "
        f"at most {target:.1%} above"
    ]


def _speed_cases(rows: Sequence[harness.Row]) -> list[str]:
    return list(
        dict.fromkeys(r.case for r in rows if r.case.startswith("speed-") and r.metric == "step_time")
    )


def _speed_notes(rows: Sequence[harness.Row]) -> list[str]:
    notes = []
    for case in _speed_cases(rows):
        network = case.split()[0].removeprefix("speed-")
        for method in ("q8", "q8-qwz"):
            row = _find(rows, case, method, "step_time")
            if row is not None and row.ratio:
                notes.append(
                    f"{case.removeprefix('speed-')}: {method} is {1 / row.ratio:.2f}x dense's speed "
                    f"(target {SPEED_TARGETS.get(network, '-')})"
                )
    return notes


def _byte_bound_notes(rows: Sequence[harness.Row]) -> list[str]:
    """How much faster q8 (and q8-qwz) could be on the link, from each 1 Gbit/s case's link bytes."""
    notes = []
    for case in _speed_cases(rows):
        if case.split()[0] != "speed-1gbit":
            continue
        link = {m: _find(rows, case, m, "step_time") for m in ("dense", "q8", "q8-qwz")}
        mb = {
            m: r.extra["link_MB/step"] for m, r in link.items() if r is not None and "link_MB/step" in r.extra
        }
        if "dense" not in mb or "q8" not in mb:
            continue
        dense, q8 = mb["dense"], mb["q8"]
        note = (
            f"{case.removeprefix('speed-')} bytes on the link per step: dense {dense:.1f} MB, q8 {q8:.1f} MB "
            f"({q8 / dense:.3f}). q8 compresses the gradient's reduce-scatter only; FSDP2's parameter "
            f"all-gathers stay as they are, so a q8 step still moves {q8 / dense:.2f} of dense's bytes and "
            f"cannot be more than {dense / q8:.2f}x faster even if the link were all of the step"
        )
        if "q8-qwz" in mb:
            note += f"; with the all-gathers in 8-bit too (q8-qwz) it could be {dense / mb['q8-qwz']:.1f}x"
        notes.append(note)
    return notes


def verdicts(rows: Sequence[harness.Row]) -> list[str]:
    """Each target's verdict, computed from the rows."""
    notes = []
    for case in dict.fromkeys(r.case for r in rows if r.case.split()[0] == "loss"):
        layout = case.partition(" ")[2]
        for method, target in (("q8", 0.005), ("sign-ef", 0.02)):
            label = f"{method} ({layout})" if layout else method
            notes += _gap_note(_find(rows, case, method, "val_loss"), label, target)
    notes += _speed_notes(rows)
    notes += _byte_bound_notes(rows)
    for method in ("q8", "q4"):
        row = _find(rows, "hsdp-nodes", method, "cross_node_bytes")
        if row is not None and row.ratio is not None:
            verdict = "meets" if row.ratio <= 0.25 else "misses"
            notes.append(
                f"hsdp-nodes: {method} replicate-only sends {row.ratio:.3f} of dense HSDP's cross-node "
                f"bytes (veth counters; payload count {row.extra['payload_vs_dense']:.3f}): {verdict} "
                "the target of at most 1/4"
            )
    for method in ("q8-stochastic-no-ef", "q8", "q8-bf16-residual"):
        row = _find(rows, "memory-peak", method, "peak_bytes_per_param")
        dense = _find(rows, "memory-peak", "dense", "peak_bytes_per_param")
        if row is not None and dense is not None:
            notes.append(
                f"memory-peak: {method} peaks at {row.value:.2f} B/param per rank, dense FSDP2 at "
                f"{dense.value:.2f} ({row.value - dense.value:+.2f})"
            )
    for method, label, target in (
        ("q8", "lm q8 (AdamW)", 0.005),
        ("sign", "lm sign-ef (AdamW)", 0.02),
        ("sign_c64", "lm sign-ef chunk 64 (AdamW)", 0.02),
        ("sign_sgd", "lm sign-ef (SGD momentum)", 0.02),
    ):
        row = _find(rows, "lm", method, "val_loss")
        if row is not None and row.extra.get("diverged"):
            notes.append(
                f"{label} diverged ({row.extra['diverged']}): misses the target of at most {target:.1%} above"
            )
        notes += _gap_note(row, label, target)
    return notes
