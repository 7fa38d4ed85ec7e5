"""bench_fsdp: fastcomm.fsdp against dense FSDP2 and HSDP over gloo: loss, step time, bytes, memory.

Parts (``--parts``, all by default; rank-side code in :mod:`benchmarks.fsdp_jobs`):

1. ``loss``: a student MLP (nested ``fully_shard`` on every layer and the root, in each of
   ``--loss-layouts``) fits a fixed random teacher MLP with Adam for ``--loss-steps`` steps on 2 ranks,
   each method from the same weights and batches; the row is the validation MSE on 2,048 held-out
   samples, beside dense FSDP2's. From the same runs: each method's first reduced gradient's error
   against dense's, its error-feedback bytes per parameter and its reduce-scatter's compression ratio
   (``stats()``).
2. ``speed``: a ``--width`` x ``--depth`` MLP (2048 x 6: 25M parameters), every layer and the root sharded
   in each of ``--speed-layouts`` (:data:`benchmarks.fsdp_jobs.LAYOUTS`: fp32 weights all-gathered for
   forward and again for backward, as FSDP2's defaults do, or bf16 compute weights with an fp32 gradient
   reduction; each with ``reshard_after_forward`` True or False), SGD, 2 ranks; the slower rank's median
   step time over ``--timed`` steps after ``--warmup``, on loopback and, where :mod:`benchmarks.netlab`
   works (root, ``ip``, ``tc``), over a 1 Gbit/s tbf link between two namespaces, where the veths' byte
   counters give the bytes per step. Targets: 8-bit no slower than 1.1x dense on loopback, at least 2x
   faster on the 1 Gbit/s link.
3. ``memory``: the same MLP at ``--memory-width``, Adam, ``--memory-steps`` steps, each method in a fresh
   pair of processes: peak and between-step bytes per model parameter on the fuller rank (the sharded
   parameters plus the resident size the steps added, from Linux's ``VmHWM``), for dense FSDP2 and
   compressed without and with error feedback.
4. ``hsdp``: HSDP on :class:`benchmarks.netlab.Nodes` (2 nodes x 2 ranks, 1 Gbit/s between the nodes; mesh
   2 replicas x 2 shards, the shards inside a node): dense native HSDP against the replicate-only
   compression. Bytes that crossed the node link per step (veth counters) and the cross-replica payload
   counted by the ranks; target: compressed at most 1/4 of dense. The step time is reported, not claimed:
   4 ranks on a 2-core host are CPU-bound.
5. ``lm``: ``examples/train_lm.py --fsdp`` (the byte-level GPT, FSDP2 on every block and the root) for
   ``--lm-steps`` steps on 2 ranks, methods ``--lm-methods``, each in its own launch; the validation loss
   beside dense's. Targets: q8 within 0.5%, sign with error feedback within 2% (of the same optimizer's
   dense run).

``--merge FILE`` keeps the rows of an earlier ``bench_fsdp.json`` that this run did not measure again,
and the setting notes (those that start with a part's name) of the parts not run, so one part, or one LM
method, can be run again on its own; the verdict notes are computed again from the merged rows.

Example::

    python -m benchmarks.bench_fsdp --parts loss,speed --loss-steps 120 --width 1024   # a short run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks import fsdp_jobs, fsdp_rows, harness, lm_methods, netlab
from benchmarks.common import launch, rank_env, tail
from benchmarks.fsdp_jobs import LAYOUTS, METHODS
from benchmarks.fsdp_rows import speed_case, verdicts

__all__ = ["METHODS", "PARTS", "main"]

LOSS_METHODS = ("dense", "q8", "q8-bf16-residual", "q8-stochastic-no-ef", "q4", "sign-ef", "q8-qwz")
SPEED_METHODS = ("dense", "q8", "q8-qwz")
MEMORY_METHODS = ("dense", "q8-stochastic-no-ef", "q8", "q8-bf16-residual")
HSDP_METHODS = ("dense", "q8", "q4")
LM_METHODS = ("none", "q8", "sign", "sign_c64", "sgd", "sign_sgd")
PARTS = ("loss", "speed", "memory", "hsdp", "lm")
SPEED_LAYOUTS = tuple(LAYOUTS)  # every layout
# the part each case's rows come from (for --merge), by the case's first word
CASE_PART = {
    "loss": "loss",
    "correctness": "loss",
    "memory": "loss",
    "traffic": "loss",
    "speed-loopback": "speed",
    "speed-1gbit": "speed",
    "memory-peak": "memory",
    "hsdp-nodes": "hsdp",
    "lm": "lm",
}


def case_part(case: str) -> str:
    """The part whose run gives ``case``'s rows (``speed-1gbit bf16-keep`` -> ``speed``)."""
    return CASE_PART[case.split()[0]]


LINK_RATE = "1gbit"
_JOBS = {
    "loss": fsdp_jobs.loss_run,
    "speed": fsdp_jobs.speed_run,
    "memory": fsdp_jobs.memory_run,
    "hsdp": fsdp_jobs.hsdp_run,
    "lm": fsdp_jobs.lm_run,
}


# ------------------------------------------------------------------------------------------ rank side
def _rank_main(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout_s"]))
    rank = dist.get_rank()
    spec = {**spec, "counter": spec["counters"][rank]}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {method: _JOBS[spec["job"]](method, spec, rank, mesh) for method in spec["methods"]}
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ parent side
@dataclasses.dataclass(frozen=True)
class _Place:
    """Where one rank runs: its command prefix, its own environment, and the veth byte counter it reads
    around the timed steps (None: not counted by this rank)."""

    prefix: tuple[str, ...]
    env: dict[str, str]
    counter: str | None = None


def _places(link: netlab.Link | None) -> list[_Place]:
    """Two ranks on loopback or on a :class:`netlab.Link`'s two sides (each counting its veth), or a
    :class:`netlab.Nodes`'s ranks node by node (local rank 0 counting its node's veth)."""
    if link is None:
        return [_Place((), {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}) for _ in range(2)]
    if isinstance(link, netlab.Nodes):
        return [
            _Place(
                tuple(link.rank_prefix(rank)),
                link.rank_env(rank),
                link.counter_path(link.node_of(rank)) if rank % link.ranks_per_node == 0 else None,
            )
            for rank in range(link.world_size)
        ]
    return [
        _Place(
            tuple(link.exec_prefix(rank)),
            {"GLOO_SOCKET_IFNAME": link.interfaces[rank], "MASTER_ADDR": link.addresses[0]},
            f"/sys/class/net/{link.interfaces[rank]}/statistics/tx_bytes",
        )
        for rank in range(2)
    ]


def _launch(spec: dict[str, Any], link: netlab.Link | None, label: str, timeout_s: float) -> dict[str, Any]:
    """Run the job on its rank processes (:func:`_places`), at most ``timeout_s``; rank 0's results."""
    places = _places(link)
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_") as tmp:
        out = Path(tmp) / "results.json"
        rank_spec = json.dumps(
            {**spec, "out": str(out), "timeout_s": timeout_s, "counters": [place.counter for place in places]}
        )
        command = [sys.executable, "-m", "benchmarks.bench_fsdp", "--rank-spec", rank_spec]
        commands = [[*place.prefix, *command] for place in places]
        master = {"MASTER_ADDR": "127.0.0.1"}  # a place's own env names the link's address
        envs = [
            rank_env(rank, len(places), 29417, **{**master, **spec.get("env", {}), **place.env})
            for rank, place in enumerate(places)
        ]
        logs = [Path(tmp) / f"rank{rank}.log" for rank in range(len(places))]
        seen = 0

        def report(_procs: object) -> bool:
            nonlocal seen
            lines = logs[0].read_text(errors="replace").splitlines()
            for line in lines[seen:]:
                if " step " in line:
                    harness.progress(f"{label}: {line}")
            seen = len(lines)
            return False

        with harness.heartbeat(f"bench_fsdp {label}"):
            ranks = launch(commands, envs, logs, timeout_s, fail_grace_s=0.0, stop=report)
        if not out.exists():
            codes = list(ranks.returncodes)
            raise RuntimeError(f"bench_fsdp {label} failed (exit codes {codes}):\n{tail(logs[0], 5)}")
        return json.loads(out.read_text())


def _merged(
    previous: Path, parts: Sequence[str], rows: list[harness.Row], notes: list[str]
) -> tuple[list[harness.Row], list[str]]:
    """``rows`` and setting ``notes`` of this run, with every row of ``previous`` (an earlier
    ``bench_fsdp.json``) that this run did not measure again (same case, backend and metric), and the
    setting notes of the parts not run (for ``lm``, the per-method notes of the methods not run)."""
    data = json.loads(previous.read_text())
    measured = {(r.case, r.backend, r.metric) for r in rows}
    kept = [harness.Row(**r) for r in data["rows"] if (r["case"], r["backend"], r["metric"]) not in measured]
    ran_lm = {r.backend for r in rows if r.case == "lm"}

    def keep(note: str) -> bool:
        part, _, rest = note.partition(": ")
        if part not in PARTS:
            return False  # a verdict: computed again from the rows
        if part == "lm" and part in parts:
            method = rest.split(":")[0]
            return method in {r["backend"] for r in data["rows"] if r["case"] == "lm"} - ran_lm
        return part not in parts

    order = {part: i for i, part in enumerate(PARTS)}
    merged = sorted([*kept, *rows], key=lambda r: order[case_part(r.case)])
    return fsdp_rows.lm_rated(merged), [*(n for n in data["notes"] if keep(n)), *notes]


def _layouts(names: str) -> list[str]:
    """``--*-layouts``'s names, each a key of :data:`~benchmarks.fsdp_jobs.LAYOUTS`."""
    layouts = [name for name in names.split(",") if name]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"bench_fsdp: unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    return layouts


def _speed_part(args: argparse.Namespace, reason: str | None, notes: list[str]) -> list[harness.Row]:
    """The speed part: one launch per network and layout (:data:`~benchmarks.fsdp_jobs.LAYOUTS`)."""
    layouts = _layouts(args.speed_layouts)
    spec = {
        "job": "speed",
        "methods": args.speed_methods.split(","),
        "width": args.width,
        "depth": args.depth,
        "warmup": args.warmup,
        "timed": args.timed,
    }
    notes.append(
        f"speed: 2 gloo ranks; {args.width} x {args.depth} MLP, every layer and the root sharded, SGD, "
        "batch 16; link_MB/step = both veths' tx counters over the timed steps (headers included). "
        "Layouts (the case's second word; none: fp32): fp32 = FSDP2's defaults (fp32 parameters, "
        "resharded after forward, so all-gathered for forward and again for backward); bf16 = "
        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (parameters all-gathered and computed "
        "in bf16, gradients reduced in fp32); -keep = reshard_after_forward=False (one all-gather per "
        "step; the unsharded parameters are held from forward to backward). Dense and compressed run the "
        "same layout"
    )
    rows: list[harness.Row] = []
    networks = [n for n in ("loopback", LINK_RATE) if args.network in (n, "both")]
    if LINK_RATE in networks and reason is not None:
        print(f"skip bench_fsdp {LINK_RATE} link: {reason}", flush=True)
        networks.remove(LINK_RATE)
    for network in networks:
        for layout in layouts:
            harness.progress(f"bench_fsdp: speed on {network}, layout {layout}")
            layout_spec = {**spec, "layout": layout}
            if network == "loopback":
                results = _launch(layout_spec, None, f"loopback {layout}", args.timeout)
            else:
                with netlab.Link(rate=LINK_RATE) as link:
                    results = _launch(layout_spec, link, f"{LINK_RATE} {layout}", args.timeout)
            rows += fsdp_rows.speed_rows(results, speed_case(network, layout))
    return rows


def _run_parts(args: argparse.Namespace, parts: Sequence[str]) -> tuple[list[harness.Row], list[str]]:
    rows: list[harness.Row] = []
    notes: list[str] = []
    reason = netlab.unavailable_reason()
    if "loss" in parts:
        for layout in _layouts(args.loss_layouts):
            spec = {
                "job": "loss",
                "methods": args.loss_methods.split(","),
                "steps": args.loss_steps,
                "layout": layout,
            }
            harness.progress(
                f"bench_fsdp: loss, {args.loss_steps} steps x {len(spec['methods'])} methods, {layout}"
            )
            rows += fsdp_rows.loss_rows(_launch(spec, None, f"loss {layout}", args.timeout), layout)
        notes.append(
            f"loss: 2 gloo ranks, a 39k-parameter student MLP, Adam, {args.loss_steps} steps; a case's "
            "second word is the layout (as for speed; none: fp32)"
        )
    if "speed" in parts:
        rows += _speed_part(args, reason, notes)
    if "memory" in parts:
        results = {}
        for method in MEMORY_METHODS:  # a fresh pair of processes each: nothing left from the one before
            harness.progress(f"bench_fsdp: memory {method}")
            spec = {
                "job": "memory",
                "methods": [method],
                "width": args.memory_width,
                "depth": args.depth,
                "steps": args.memory_steps,
                "env": {"MALLOC_MMAP_THRESHOLD_": "65536"},
            }
            results.update(_launch(spec, None, f"memory {method}", args.timeout))
        rows += fsdp_rows.memory_rows(results)
        notes.append(
            f"memory: 2 gloo ranks, {args.memory_width} x {args.depth} MLP, Adam, {args.memory_steps} "
            "steps, a fresh pair of processes per method; bytes per rank = the sharded parameters + the "
            "resident size the steps added (Linux VmHWM, reset before the first step; glibc's mmap threshold "
            "fixed at 64 KiB so a freed tensor leaves the resident size): the peak, and persistent = after "
            "the last zero_grad; the fuller rank, per model parameter"
        )
    if "hsdp" in parts:
        if reason is not None:
            print(f"skip bench_fsdp hsdp nodes: {reason}", flush=True)
        else:
            spec = {
                "job": "hsdp",
                "methods": args.hsdp_methods.split(","),
                "width": args.width,
                "depth": args.depth,
                "warmup": args.warmup,
                "timed": args.timed,
            }
            harness.progress("bench_fsdp: HSDP on two netlab nodes")
            with netlab.Nodes(ranks_per_node=2, rate=LINK_RATE) as nodes:
                rows += fsdp_rows.hsdp_rows(_launch(spec, nodes, "hsdp", args.timeout))
            notes.append(
                f"hsdp: netlab.Nodes, 2 nodes x 2 gloo ranks, {LINK_RATE} tbf between them; "
                f"{args.width} x {args.depth} MLP, mesh 2 replicas x 2 shards (shards inside a node), "
                "SGD; dense = FSDP2's native HSDP (2-D mesh), others = sharded on mesh['shard'] with "
                "fastcomm.fsdp.compress(replicate_group=); cross_node_bytes = both veths' tx counters "
                "over the timed steps (headers, ACKs and barriers included); payload = the "
                "cross-replica all-reduce's bytes as the ranks count them, all ranks; step times are "
                "CPU-bound (4 ranks on 2 cores), not a wall-time claim"
            )
    if "lm" in parts:
        train_lm = lm_methods.load_example()
        train_lm.prepare_data(train_lm.default_data_dir())
        results = {}
        for method in args.lm_methods.split(","):
            harness.progress(f"bench_fsdp: lm {method}, {args.lm_steps} steps")
            spec = {"job": "lm", "methods": [method], "steps": args.lm_steps}
            results.update(_launch(spec, None, f"lm {method}", args.timeout))
        rows += fsdp_rows.lm_rows(results)
        notes.append(
            f"lm: examples/train_lm.py --fsdp (GPT d_model 192, 3 layers, 1.46M parameters; FSDP2 on "
            f"every block and the root), 2 gloo ranks x 16 x 128 tokens, {args.lm_steps} steps, warm-up 30 "
            "then cosine; AdamW lr 2e-3 or SGD momentum 0.9 lr 0.1 as the method says; val loss on 128 "
            "rows per rank; each row against its optimizer's dense FSDP2 run"
        )
        for method, r in results.items():
            curve = dict(zip(r["val_steps"], (round(v, 4) for v in r["val_losses"]), strict=True))
            notes.append(f"lm: {method}: {r['description']}; val loss by step {curve}")
    return rows, notes


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument(
        "--merge",
        type=Path,
        default=None,
        help="an earlier bench_fsdp.json whose rows of the parts not run are kept",
    )
    parser.add_argument("--loss-steps", type=int, default=400)
    parser.add_argument("--loss-methods", default=",".join(LOSS_METHODS))
    parser.add_argument(
        "--loss-layouts", default="fp32,bf16-keep", help="as --speed-layouts, for the loss part"
    )
    parser.add_argument("--speed-methods", default=",".join(SPEED_METHODS))
    parser.add_argument(
        "--speed-layouts",
        default=",".join(SPEED_LAYOUTS),
        help=f"comma-separated, of {', '.join(LAYOUTS)}: how FSDP2 holds the parameters in the speed part",
    )
    parser.add_argument("--hsdp-methods", default=",".join(HSDP_METHODS))
    parser.add_argument("--lm-methods", default=",".join(LM_METHODS))
    parser.add_argument("--lm-steps", type=int, default=500)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--memory-width", type=int, default=2048)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timed", type=int, default=5)
    parser.add_argument(
        "--network", choices=("loopback", "1gbit", "both"), default="both", help="where the speed part runs"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch of the ranks")
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_spec:
        _rank_main(json.loads(args.rank_spec))
        return ""
    parts = [part for part in args.parts.split(",") if part]  # none: re-render --merge's rows
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    rows, notes = _run_parts(args, parts)
    rows = fsdp_rows.lm_rated(rows)
    if args.merge is not None:
        rows, notes = _merged(args.merge, parts, rows, notes)
    table = harness.write_results(
        "bench_fsdp", rows, notes=[*notes, *verdicts(rows)], plot_metric="step_time"
    )
    print(table)
    return table


if __name__ == "__main__":
    main()
