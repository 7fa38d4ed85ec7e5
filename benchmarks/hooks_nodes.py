"""The ``nodes`` network of :mod:`benchmarks.bench_hooks`: 2 nodes x ``NODE_RANKS`` ranks joined by a
shaped link, flat hooks beside hierarchical ones, with the bytes that cross between the nodes.

Example::

    rows, notes = run_nodes(NODE_CONFIGS, Settings(warmup=2, steps=5, timeout_s=180.0))
"""

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import netlab
from benchmarks.harness import Row
from benchmarks.hooks_jobs import HIERARCHICAL, LINK_RATE, NODE_CONFIGS, NODE_RANKS, NODES_NETWORK, Config
from benchmarks.hooks_runs import Outcome, Settings, run_config, step_time_row, verdict_lines

__all__ = ["check_node_targets", "node_rows", "run_nodes"]

def node_rows(outcomes: dict[str, Outcome], loads: dict[str, float], timed_steps: int, world_size: int,
               link_mb_per_s: float | None) -> list[Row]:
    """One ``step_time`` row per configuration of the nodes network, with the bytes over the node link and
    the machine's 1-minute load average when the configuration started (``loads``)."""

    def ok(name: str) -> Outcome | None:
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
            flat = ok(config.name.removesuffix("_hier")) if config.name in HIERARCHICAL else None
            if flat is not None and flat.link_bytes:
                extra["link_vs_flat"] = round(outcome.link_bytes / flat.link_bytes, 3)
        if outcome.stats:
            # rank 0's counters times the ranks (every rank sends as much), comparable to link_MB/step
            all_ranks = world_size / timed_steps / 1e6
            sent = outcome.stats.get("sent_bytes")
            if sent is not None:
                extra["hook_sent_MB/step"] = round(sent * all_ranks, 3)
            cross = outcome.stats.get("cross_node_bytes")
            if not cross and sent and config.name not in HIERARCHICAL:
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
        if seconds is not None and config.name in HIERARCHICAL:
            flat = ok(config.name.removesuffix("_hier"))
            if flat is not None:
                extra["speedup_vs_flat"] = round(flat.step_seconds / seconds, 2)
        dense_seconds = dense.step_seconds if dense else None
        rows.append(step_time_row(NODES_NETWORK, config.name, seconds, dense_seconds, extra))
    return rows


def check_node_targets(rows: list[Row]) -> list[str]:
    """The issue's targets on two nodes, each marked MET, MISSED or not evaluated, with the numbers."""
    ok = {r.backend: r for r in rows if r.extra.get("status") == "ok"}
    verdict, speedup = verdict_lines(NODES_NETWORK, {name: row.value for name, row in ok.items()})

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


def run_nodes(configs: Sequence[Config], settings: Settings) -> tuple[list[Row], list[str]]:
    """Build :class:`netlab.Nodes`, check where its traffic goes, run every configuration on it."""
    notes = [f"{NODES_NETWORK}: 2 nodes x {NODE_RANKS} gloo ranks (netlab.Nodes: the ranks of a node share a "
             f"network namespace, the two namespaces joined by one veth pair, tbf {LINK_RATE} each way); "
             "gloo bound to each node's veth address, so pairs inside a node connect to their own address "
             "(the namespace's loopback) and only node-to-node traffic crosses the veth",
             f"{NODES_NETWORK}: link_MB/step = the veth's tx byte counters of both ends (both directions, "
             "Ethernet/IP/TCP headers included) over the timed steps, read by local rank 0 of each node "
             "between barriers; link_vs_flat = this hierarchical row's link bytes / its flat version's",
             f"{NODES_NETWORK}: hook_*_MB/step = rank 0's stats() counters per timed step times the "
             f"{2 * NODE_RANKS} ranks (each sends as much; payload only, no headers): sent_bytes (all of "
             "the compressed exchange), cross_node_bytes and intra_node_bytes (the hierarchical hooks' "
             "own counts; for a flat hook cross-node is sent_bytes * (W - L) / (W - 1), its peers being "
             "spread evenly over the nodes)"]
    reason = netlab.unavailable_reason()
    if reason:
        notes.append(f"{NODES_NETWORK}: skipped, {reason}")
        print(f"[bench_hooks] {notes[-1]}", file=sys.stderr, flush=True)
        return [], notes
    outcomes: dict[str, Outcome] = {}
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
            outcome = run_config(config, nodes, 29500 + index, settings)
            outcomes[config.name], loads[config.name] = outcome, load
            shown = f"{outcome.step_seconds:.3f} s/step" if outcome.status == "ok" else outcome.status
            if outcome.link_bytes is not None:
                shown += f", {outcome.link_bytes / settings.steps / 1e6:.1f} MB/step on the node link"
            print(f"[bench_hooks] {NODES_NETWORK:8s} {config.name:26s} {shown}  "
                  f"({time.perf_counter() - start:.0f} s, load {load:.2f})", file=sys.stderr, flush=True)
        notes.append(f"{NODES_NETWORK}: load average (1/5/15 min) at the end {_load()}")
    rows = node_rows(outcomes, loads, settings.steps, nodes.world_size, traffic.cross_mb_per_s)
    return rows, notes + check_node_targets(rows)
