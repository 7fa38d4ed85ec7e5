"""The tables, verdicts and figure of :mod:`benchmarks.bench_convergence`, from its summary and curves.

Example::

    lines = verdict_lines(summary, "10mbit")
    text = summary_table(summary, "10mbit")
    plot(curves, "10mbit", target, Path("bench_convergence.png"))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["pct", "phase_text", "plot", "rounded", "summary_table", "verdict_lines"]

def rounded(value: float | None) -> float | str:
    return round(value, 4) if value is not None else ""


def pct(value: float, reference: float) -> float:
    return 100.0 * (value / reference - 1.0)


def verdict_lines(summary: dict[str, dict[str, Any]], shaped: str) -> list[str]:
    """The issue's targets, each PASS, FAIL or not evaluated, with the numbers."""

    def val(method: str) -> float | None:
        return summary.get(method, {}).get("val_loss")

    lines = []

    def within(method: str, reference: str, percent: float) -> None:
        v, r = val(method), val(reference)
        label = f"{method} within {percent}% of {reference} at the last step"
        if v is None or r is None:
            lines.append(f"{label}: not evaluated (no loss for {method if v is None else reference})")
            return
        gap = pct(v, r)
        lines.append(f"{label}: {'PASS' if gap <= percent else 'FAIL'} ({v:.4f} vs {r:.4f}, {gap:+.2f}%)")

    within("cadam", "none", 2.0)
    cadam, dense = summary.get("cadam", {}), summary.get("none", {})
    step_c, step_d = cadam.get("shaped_step_compressed"), dense.get("shaped_step")
    label = f"cadam >= 2.5x faster per step than dense allreduce on the {shaped} link (compressed phase)"
    if step_c and step_d:
        ratio = step_d / step_c
        lines.append(
            f"{label}: {'PASS' if ratio >= 2.5 else 'FAIL'} ({step_d:.3f} s / {step_c:.3f} s = {ratio:.2f}x)"
        )
    else:
        lines.append(f"{label}: not evaluated (no step time)")

    # Each method's time against dense's (and fp16's) timed in the same run (a merged file holds several).
    reached = {
        m: s
        for m, s in summary.items()
        if s.get("time_to_target") is not None
        and s.get("ttt_vs_dense")
        and m not in ("none", "fp16", "sgd", "sgd_clip", "dgc")
    }
    label = (
        f"best fastcomm method >= 2x sooner to dense's loss +2% than dense, and sooner than torch fp16 "
        f"({shaped} link)"
    )
    if reached:
        best = max(reached, key=lambda m: reached[m]["ttt_vs_dense"])
        seconds, vs_dense = reached[best]["time_to_target"], reached[best]["ttt_vs_dense"]
        vs_fp16 = reached[best].get("ttt_vs_fp16")
        fp16 = summary.get("fp16", {})
        ok = vs_dense >= 2.0 and (vs_fp16 is None or vs_fp16 > 1.0)
        if vs_fp16 is not None:
            fp16_text = f", fp16 {seconds * vs_fp16:.0f} s"
        elif fp16.get("time_to_target") is not None:
            fp16_text = ", fp16 not timed in the same run"
        else:
            fp16_text = ", fp16 never reached it" if "fp16" in summary else ", fp16 not run"
        lines.append(
            f"{label}: {'PASS' if ok else 'FAIL'} ({best} {seconds:.0f} s, dense "
            f"{seconds * vs_dense:.0f} s = {vs_dense:.2f}x{fp16_text})"
        )
    else:
        lines.append(f"{label}: not evaluated (no fastcomm method reached it, or dense has no time)")
    within("dgc", "sgd", 2.0)
    within("dgc", "sgd_clip", 2.0)  # the same local clipping without sparsification: what top-k itself costs
    within("q8", "none", 0.5)
    within("cast", "none", 0.5)
    return lines


def summary_table(summary: dict[str, dict[str, Any]], shaped: str) -> str:
    head = [
        "method",
        "val loss",
        "vs dense",
        f"s/step {shaped}",
        "speedup",
        "s/step 1gbit",
        "speedup",
        "time to target",
        "vs dense",
        "vs fp16",
        "backward_s 1gbit",
        "opt_step_s 1gbit",
        "status",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(value: float | None, pattern: str) -> str:
        return pattern.format(value) if value is not None else "-"

    for method, s in summary.items():
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{method} ({s['optimizer']})",
                    fmt(s.get("val_loss"), "{:.4f}"),
                    fmt(s.get("vs_reference_pct"), "{:+.2f}%")
                    + (
                        f" vs {s['reference']}"
                        if s["reference"] != "none" and s.get("vs_reference_pct") is not None
                        else ""
                    ),
                    s.get("shaped_text", "-"),
                    fmt(s.get("shaped_speedup"), "{:.2f}x"),
                    s.get("fast_text", "-"),
                    fmt(s.get("fast_speedup"), "{:.2f}x"),
                    fmt(s.get("time_to_target"), "{:.0f} s"),
                    fmt(s.get("ttt_vs_dense"), "{:.2f}x"),
                    fmt(s.get("ttt_vs_fp16"), "{:.2f}x"),
                    fmt(s.get("fast_backward"), "{:.3f}"),
                    fmt(s.get("fast_opt_step"), "{:.4f}"),
                    s.get("status", ""),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def phase_text(timing: dict[str, Any] | None) -> str:
    if not timing or not timing.get("phases"):
        return "-"
    phases = timing["phases"]
    if any(p["seconds_per_step"] is None for p in phases):
        return "failed"
    if len(phases) == 1:
        return f"{phases[0]['seconds_per_step']:.3f}"
    return " / ".join(f"{p['seconds_per_step']:.3f} ({p['name']})" for p in phases)


def plot(curves: dict[str, dict[str, Any]], shaped: str, target: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(15, 5.5))
    for method, curve in curves.items():
        if not curve.get("val_steps"):
            continue
        style = {"color": "black", "linewidth": 2.5, "zorder": 5} if method == "none" else {"linewidth": 1.3}
        dashed = {"linestyle": "--"} if curve["optimizer"].startswith("sgd") else {}
        by_step.plot(
            curve["val_steps"], curve["val_losses"], marker="o", markersize=3, label=method, **style, **dashed
        )
        if curve.get("shaped_seconds") and max(curve["shaped_seconds"]) > 0:  # untimed rows: step panel only
            by_time.plot(
                curve["shaped_seconds"], curve["val_losses"], marker="o", markersize=3, **style, **dashed
            )
    for ax in (by_step, by_time):
        if target is not None:
            ax.axhline(
                target,
                color="grey",
                linestyle=":",
                linewidth=1,
                label="dense AdamW + 2%" if ax is by_step else None,
            )
        ax.set_ylabel("validation loss (nats per byte)")
        ax.grid(alpha=0.3)
    by_step.set_xlabel("step")
    by_step.set_title("validation loss vs step (2 gloo ranks)")
    by_time.set_xlabel(f"seconds on the {shaped} link (step count x measured step time of its phase)")
    by_time.set_title(f"validation loss vs wall time, {shaped} link")
    fig.legend(loc="center right", fontsize=8, title="--hook (dashed: SGD rows)", title_fontsize=8)
    drawn = [c["val_losses"] for c in curves.values() if c.get("val_losses")]
    if drawn:
        # Every curve's end in view, without the first points' steep fall flattening the rest.
        low = min(min(v) for v in drawn)
        high = min(max(max(v) for v in drawn), max(v[-1] for v in drawn) + 0.3, low + 1.5)
        for ax in (by_step, by_time):
            ax.set_ylim(low - 0.05, max(high, low + 0.3))
    fig.tight_layout(rect=(0, 0, 0.87, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


