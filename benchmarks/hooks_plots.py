"""The figures of :mod:`benchmarks.bench_hooks`: step time per hook and network (``bench_hooks.png``) and
the two-node step time and cross-node bytes (``bench_hooks_nodes.png``), drawn from the result JSON.

Example::

    replot(RESULTS_DIR)  # redraw results/bench_hooks.png from results/bench_hooks.json
"""

import json
from pathlib import Path
from typing import Any

from benchmarks.hooks_jobs import CONFIGS, HIERARCHICAL, LINK_RATE, NODE_CONFIGS, NODE_RANKS, NODES_RESULTS
from benchmarks.hooks_runs import num_params

__all__ = ["plot_nodes", "plot_results", "replot", "replot_nodes"]

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
    fig.suptitle(f"DDP step time by communication hook, 2 gloo ranks, MLP with {num_params() / 1e6:.1f}M "
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
    colours = {n: "#55a868" if n in HIERARCHICAL else "#4c72b0" for n in names}
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
                 f"the nodes, MLP with {num_params() / 1e6:.1f}M parameters", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(directory: Path) -> None:
    plot_results(json.loads((directory / "bench_hooks.json").read_text()), directory / "bench_hooks.png")


def replot_nodes(directory: Path) -> None:
    plot_nodes(json.loads((directory / f"{NODES_RESULTS}.json").read_text()),
               directory / f"{NODES_RESULTS}.png")
