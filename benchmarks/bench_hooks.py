"""Step time of DDP with each communication hook: 2 gloo ranks on loopback and on a shaped 1 Gbit/s link, and
4 ranks on two "nodes" joined by a 1 Gbit/s link (flat against hierarchical compression).

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
6. The ``nodes`` network (:class:`benchmarks.netlab.Nodes`): 2 nodes x 2 ranks, the ranks of a node in one
   namespace (their pairs go over its loopback), the nodes joined by the 1 Gbit/s veth. It runs dense
   allreduce, the no-op floor, flat (``node_size=1``) and hierarchical (``node_size=2``: dense inside the
   node, compressed between nodes) sign and 8-bit quantization, and flat PowerSGD, and counts the bytes
   that cross the veth during the timed steps (its tx counters, read by one rank per node between
   barriers) beside the hooks' own counters. Its rows go to ``bench_hooks_nodes.*``, so running it alone
   leaves the two-rank results in ``bench_hooks.*`` of the same output folder as they are, and vice versa.

Wire bytes are the payload each rank hands to the network per step: computed for torch's hooks (4, 2 bytes
per parameter; P and Q factors plus uncompressed 1-D tensors for powerSGD) and read from ``stats()`` for
fastcomm's. Ratios: ``ratio`` is dense allreduce time / this time (above 1 is faster than allreduce),
``x_noop_floor`` is this time / the no-op hook's time, ``speedup_vs_fp16`` is the fp16 hook's time / this.

The rank side and configurations are :mod:`benchmarks.hooks_jobs`, the two-rank runs and rows
:mod:`benchmarks.hooks_runs`, the nodes network :mod:`benchmarks.hooks_nodes`, the figures
:mod:`benchmarks.hooks_plots`; this module is the command line.

Run::

    python -m benchmarks.bench_hooks                 # all networks, 2 warm-up + 5 timed steps each
    python -m benchmarks.bench_hooks --quick --network loopback
    python -m benchmarks.bench_hooks --network nodes   # only the two-node network (about 3 minutes)
    python -m benchmarks.bench_hooks --network both    # loopback and netlab, not nodes
    python -m benchmarks.bench_hooks --replot          # redraw the PNGs from results/bench_hooks*.json
"""

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from benchmarks import netlab
from benchmarks.harness import RESULTS_DIR, Row, output_dir, write_results
from benchmarks.hooks_jobs import (
    BATCH,
    BY_NAME,
    CONFIGS,
    LAYERS,
    LINK_RATE,
    NETWORKS,
    NODE_CONFIGS,
    NODE_RANKS,
    NODES_NETWORK,
    NODES_RESULTS,
    Config,
    rank_main,
)
from benchmarks.hooks_nodes import run_nodes
from benchmarks.hooks_plots import replot, replot_nodes
from benchmarks.hooks_runs import Settings, check_targets, num_params, run_network

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark, write ``bench_hooks.*`` (loopback and netlab) and ``bench_hooks_nodes.*`` (two
    nodes) to ``harness.output_dir()``, each only for the networks run; return the Markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 warm-up + 2 timed steps (default 2 + 5)")
    parser.add_argument("--network", choices=(*NETWORKS, NODES_NETWORK, "both", "all"), default="all",
                        help="both = loopback and netlab; all (the default) = those and nodes")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per configuration before its ranks are killed")
    parser.add_argument("--configs", default=None,
                        help="comma-separated subset of the configurations to run (default: all of each "
                             "network's)")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile one more step on rank 0 and print its top ops")
    parser.add_argument("--replot", action="store_true",
                        help="redraw bench_hooks.png (and bench_hooks_nodes.png) from their JSON; "
                             "run nothing")
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.rank_spec:
        rank_main(json.loads(args.rank_spec))
        return ""
    if args.replot:
        replot(RESULTS_DIR)
        text = (RESULTS_DIR / "bench_hooks.md").read_text()
        if (RESULTS_DIR / f"{NODES_RESULTS}.json").exists():
            replot_nodes(RESULTS_DIR)
            text += "\n" + (RESULTS_DIR / f"{NODES_RESULTS}.md").read_text()
        return text

    warmup, steps = (2, 2) if args.quick else (2, 5)
    # Generous: a dense step on the 1 Gbit link takes about 1 s; process start and DDP setup about 10 s.
    settings = Settings(warmup, steps, args.timeout or 45.0 + 6.0 * (warmup + steps), args.profile)
    # Four ranks share the cores: each step and each start take about twice as long.
    node_settings = dataclasses.replace(settings, timeout_s=args.timeout or 90.0 + 15.0 * (warmup + steps))
    networks = {"both": NETWORKS, "all": (*NETWORKS, NODES_NETWORK)}.get(args.network, (args.network,))
    known = [c.name for c in CONFIGS] + [c.name for c in NODE_CONFIGS if c.name not in BY_NAME]
    chosen = args.configs.split(",") if args.configs else known
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {known}")
    configs = tuple(c for c in CONFIGS if c.name in chosen)
    node_configs = tuple(c for c in NODE_CONFIGS if c.name in chosen)
    # A network with none of the chosen configurations is not run, and its result files stay as they are.
    tables = []
    two_rank = [n for n in networks if n in NETWORKS]
    if two_rank and configs:
        tables.append(_two_rank_networks(two_rank, configs, settings))
    if NODES_NETWORK in networks and node_configs:
        tables.append(_nodes_network(node_configs, node_settings))
    return "\n".join(tables)


def _common_notes(settings: Settings, ranks: str) -> list[str]:
    params = num_params()
    return [
        f"model: MLP {'-'.join(map(str, LAYERS))} with biases, {params / 1e6:.2f}M fp32 parameters "
        f"({4 * params / 1e6:.1f} MB of gradients), batch {BATCH} per rank, SGD",
        f"{ranks} gloo ranks, one thread each; {settings.warmup} warm-up + {settings.steps} timed steps per "
        "configuration, time = slower rank's median step",
        "ratio = allreduce step time / this step time (above 1 = faster than dense allreduce); "
        "x_noop_floor = this step time / the no-op hook's",
    ]


def _nodes_network(configs: Sequence[Config], settings: Settings) -> str:
    """Run the nodes network, write ``bench_hooks_nodes.*`` and return its Markdown table."""
    rows, node_notes = run_nodes(configs, settings)
    notes = [
        *_common_notes(settings, f"{2 * NODE_RANKS} (2 nodes x {NODE_RANKS})"),
        "speedup_vs_flat = the flat version's step time / this hierarchical one's",
        *(f"{c.name}: {c.description}" for c in NODE_CONFIGS),
        *node_notes,
    ]
    for note in notes:
        print(f"[bench_hooks] {note}", file=sys.stderr, flush=True)
    table = write_results(NODES_RESULTS, rows, notes=notes, plot_metric="step_time")
    if rows:
        replot_nodes(output_dir())  # replaces the harness's generic bars
    return table


def _two_rank_networks(networks: Sequence[str], configs: Sequence[Config], settings: Settings) -> str:
    """Run the loopback and netlab networks, write ``bench_hooks.*`` and return its Markdown table."""
    notes = [
        *_common_notes(settings, "2"),
        "wire bytes: what one rank sends per step (for 2 ranks a ring allreduce and an all-gather both send "
        "the payload once); computed for torch hooks, stats()['sent_bytes'] per timed step for fastcomm "
        "(fastcomm counters, compress_s/step included, cover the timed steps only)",
        *(f"{c.name}: {c.description}" for c in CONFIGS),
        "torch_powersgd_r4 with DDP's default buckets fails over gloo here (size-mismatch abort or hang); "
        "with one bucket it runs, so the likely cause is its P/Q collectives being issued from future "
        "callbacks in an order that differs between ranks",
    ]
    rows: list[Row] = []
    for network in networks:
        if network == "loopback":
            loopback_rows = run_network(network, configs, None, settings, None)
            rows += loopback_rows
            notes += check_targets(network, loopback_rows)
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
            net_rows = run_network(network, configs, link, settings, link_mb_per_s)
        rows += net_rows
        notes += check_targets(network, net_rows)
    for note in notes:
        print(f"[bench_hooks] {note}", file=sys.stderr, flush=True)
    table = write_results("bench_hooks", rows, notes=notes, plot_metric="step_time")
    # The harness draws one generic bar per row; this figure replaces it.
    replot(output_dir())
    return table

if __name__ == "__main__":
    print(main())
