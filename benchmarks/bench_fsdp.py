"""bench_fsdp: fastcomm.fsdp against dense FSDP2 and HSDP over gloo: loss, step time, bytes, memory.

Parts (``--parts``, all by default; rank-side code in :mod:`benchmarks.fsdp_jobs`):

1. ``loss``: a student MLP (nested ``fully_shard`` on every layer and the root) fits a fixed random teacher
   MLP with Adam for ``--loss-steps`` steps on 2 ranks, each method from the same weights and batches; the
   row is the validation MSE on 2,048 held-out samples, beside dense FSDP2's. From the same runs: each
   method's first reduced gradient's error against dense's, its error-feedback bytes per parameter and its
   reduce-scatter's compression ratio (``stats()``).
2. ``speed``: a ``--width`` x ``--depth`` MLP (2048 x 6: 25M parameters), every layer and the root sharded
   (FSDP2's defaults: weights all-gathered for forward and again for backward), SGD, 2 ranks; the slower
   rank's median step time over ``--timed`` steps after ``--warmup``, on loopback and, where
   :mod:`benchmarks.netlab` works (root, ``ip``, ``tc``), over a 1 Gbit/s tbf link between two namespaces,
   where the veths' byte counters give the bytes per step. Targets: 8-bit no slower than 1.1x dense on
   loopback, at least 2x faster on the 1 Gbit/s link.
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
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks import fsdp_jobs, harness, netlab
from benchmarks.fsdp_jobs import METHODS

__all__ = ["METHODS", "PARTS", "main"]

_REPO_ROOT = Path(__file__).resolve().parent.parent
LOSS_METHODS = ("dense", "q8", "q8-bf16-residual", "q8-stochastic-no-ef", "q4", "sign-ef", "q8-qwz")
SPEED_METHODS = ("dense", "q8", "q8-qwz")
MEMORY_METHODS = ("dense", "q8-stochastic-no-ef", "q8", "q8-bf16-residual")
HSDP_METHODS = ("dense", "q8", "q4")
LM_METHODS = ("none", "q8", "sign", "sign_c64", "sgd", "sign_sgd")
PARTS = ("loss", "speed", "memory", "hsdp", "lm")
# the part each case's rows come from (for --merge)
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
        procs, logs = [], []
        pythonpath = os.pathsep.join(filter(None, (str(_REPO_ROOT), os.environ.get("PYTHONPATH"))))
        rank_spec = json.dumps(
            {**spec, "out": str(out), "timeout_s": timeout_s, "counters": [place.counter for place in places]}
        )
        try:
            for rank, place in enumerate(places):
                env = dict(
                    os.environ,
                    **spec.get("env", {}),
                    OMP_NUM_THREADS="1",
                    PYTHONPATH=pythonpath,
                    RANK=str(rank),
                    WORLD_SIZE=str(len(places)),
                    MASTER_PORT="29417",
                    **place.env,
                )
                command = [
                    *place.prefix,
                    sys.executable,
                    "-m",
                    "benchmarks.bench_fsdp",
                    "--rank-spec",
                    rank_spec,
                ]
                logs.append(Path(tmp) / f"rank{rank}.log")
                with logs[-1].open("wb") as log:
                    procs.append(
                        subprocess.Popen(
                            command,
                            cwd=_REPO_ROOT,
                            env=env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            deadline, seen = time.monotonic() + timeout_s, 0
            with harness.heartbeat(f"bench_fsdp {label}"):
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    lines = logs[0].read_text(errors="replace").splitlines()
                    for line in lines[seen:]:
                        if " step " in line:
                            harness.progress(f"{label}: {line}")
                    seen = len(lines)
                    if any(p.returncode not in (None, 0) for p in procs):
                        break
                    time.sleep(0.5)
        finally:
            harness.kill_process_groups(procs)
        if not out.exists():
            tail = "\n".join(logs[0].read_text(errors="replace").splitlines()[-5:])
            raise RuntimeError(
                f"bench_fsdp {label} failed (exit codes {[p.returncode for p in procs]}):\n{tail}"
            )
        return json.loads(out.read_text())


def _loss_rows(loss: dict[str, Any]) -> list[harness.Row]:
    dense = loss["dense"]["val_loss"]
    rows = [
        harness.Row(
            "loss",
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
        harness.Row("correctness", m, "first_grad_rel_error", r["grad_rel_error"], "relative L2")
        for m, r in loss.items()
    ]
    rows += [
        harness.Row("memory", m, "residual_bytes_per_param", r["residual_bytes_per_param"], "B/param")
        for m, r in loss.items()
    ]
    rows += [
        harness.Row("traffic", m, "reduce_scatter_compression", r["compression_ratio"], "x")
        for m, r in loss.items()
    ]
    return rows


def _speed_rows(results: dict[str, Any], case: str) -> list[harness.Row]:
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


def _memory_rows(results: dict[str, Any]) -> list[harness.Row]:
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


def _hsdp_rows(results: dict[str, Any]) -> list[harness.Row]:
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


def _lm_rows(results: dict[str, Any]) -> list[harness.Row]:
    """The validation loss of each LM method (ratios by :func:`_lm_rated`)."""
    rows = []
    for method, r in results.items():
        extra = {"params": r["params"], "optimizer": r["optimizer"], "s/step": round(r["step_s"], 3)}
        if r.get("diverged"):
            extra["diverged"] = r["diverged"]
        rows.append(harness.Row("lm", method, "val_loss", r["val_loss"], "nats/byte", None, None, extra))
    return rows


def _lm_rated(rows: Sequence[harness.Row]) -> list[harness.Row]:
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


def _byte_bound_note(rows: Sequence[harness.Row]) -> list[str]:
    """Why q8 alone cannot make a step 2x faster on the link, from the link bytes of the speed rows."""
    link = {m: _find(rows, "speed-1gbit", m, "step_time") for m in ("dense", "q8", "q8-qwz")}
    if any(r is None or "link_MB/step" not in r.extra for r in link.values()):
        return []
    dense, q8, qwz = (link[m].extra["link_MB/step"] for m in ("dense", "q8", "q8-qwz"))  # type: ignore[union-attr]
    return [
        f"1gbit bytes on the link per step: dense {dense:.1f} MB, q8 {q8:.1f} MB ({q8 / dense:.3f}), "
        f"q8-qwz {qwz:.1f} MB ({qwz / dense:.3f}). q8 compresses the gradient's reduce-scatter only; "
        "FSDP2's parameter all-gathers (for forward, and again for backward) stay dense, so a q8 step still "
        f"moves {q8 / dense:.2f} of dense's bytes and cannot be more than {dense / q8:.2f}x faster even if "
        "the link were all of the step; with the all-gathers in 8-bit too (q8-qwz) it could be "
        f"{dense / qwz:.1f}x"
    ]


def _notes(rows: Sequence[harness.Row]) -> list[str]:
    """Each target's verdict, computed from the rows."""
    notes = []
    for method, target in (("q8", 0.005), ("sign-ef", 0.02)):
        notes += _gap_note(_find(rows, "loss", method, "val_loss"), method, target)
    for case in ("speed-loopback", "speed-1gbit"):
        for method in ("q8", "q8-qwz"):
            row = _find(rows, case, method, "step_time")
            if row is not None and row.ratio:
                target = "1/1.1x (loopback)" if case == "speed-loopback" else "2x (1 Gbit/s)"
                notes.append(
                    f"{case.removeprefix('speed-')}: {method} is {1 / row.ratio:.2f}x dense's speed "
                    f"(target {target})"
                )
    notes += _byte_bound_note(rows)
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
    merged = sorted([*kept, *rows], key=lambda r: order[CASE_PART[r.case]])
    return _lm_rated(merged), [*(n for n in data["notes"] if keep(n)), *notes]


def _run_parts(args: argparse.Namespace, parts: Sequence[str]) -> tuple[list[harness.Row], list[str]]:
    rows: list[harness.Row] = []
    notes: list[str] = []
    reason = netlab.unavailable_reason()
    if "loss" in parts:
        spec = {"job": "loss", "methods": args.loss_methods.split(","), "steps": args.loss_steps}
        harness.progress(f"bench_fsdp: loss, {args.loss_steps} steps x {len(spec['methods'])} methods")
        rows += _loss_rows(_launch(spec, None, "loss", args.timeout))
        notes.append(f"loss: 2 gloo ranks, a 39k-parameter student MLP, Adam, {args.loss_steps} steps")
    if "speed" in parts:
        spec = {
            "job": "speed",
            "methods": args.speed_methods.split(","),
            "width": args.width,
            "depth": args.depth,
            "warmup": args.warmup,
            "timed": args.timed,
        }
        notes.append(
            f"speed: 2 gloo ranks; {args.width} x {args.depth} MLP, every layer and the root sharded, "
            "SGD, batch 16; link_MB/step = both veths' tx counters over the timed steps (headers "
            "included)"
        )
        if args.network in ("loopback", "both"):
            harness.progress("bench_fsdp: speed on loopback")
            rows += _speed_rows(_launch(spec, None, "loopback", args.timeout), "speed-loopback")
        if args.network in ("1gbit", "both"):
            if reason is not None:
                print(f"skip bench_fsdp 1gbit link: {reason}", flush=True)
            else:
                harness.progress(f"bench_fsdp: speed over a {LINK_RATE} link")
                with netlab.Link(rate=LINK_RATE) as link:
                    rows += _speed_rows(_launch(spec, link, LINK_RATE, args.timeout), "speed-1gbit")
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
        rows += _memory_rows(results)
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
                rows += _hsdp_rows(_launch(spec, nodes, "hsdp", args.timeout))
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
        train_lm = fsdp_jobs.load_example()
        train_lm.prepare_data(train_lm.default_data_dir())
        results = {}
        for method in args.lm_methods.split(","):
            harness.progress(f"bench_fsdp: lm {method}, {args.lm_steps} steps")
            spec = {"job": "lm", "methods": [method], "steps": args.lm_steps}
            results.update(_launch(spec, None, f"lm {method}", args.timeout))
        rows += _lm_rows(results)
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
    parser.add_argument("--speed-methods", default=",".join(SPEED_METHODS))
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
    rows = _lm_rated(rows)
    if args.merge is not None:
        rows, notes = _merged(args.merge, parts, rows, notes)
    table = harness.write_results("bench_fsdp", rows, notes=[*notes, *_notes(rows)], plot_metric="step_time")
    print(table)
    return table


if __name__ == "__main__":
    main()
