"""What a dead replica costs: live recovery on torchft (fastcomm.ft) against a restart from a checkpoint.

One run, three jobs of the same tiny regression model, 3 replicas (DDP, 8-bit quantize hook, SGD with
momentum), each step made ``--step-s`` long (a sleep: this model's own step is milliseconds, and what a
failure costs is a fixed time, so the ratio is only meaningful at a realistic step time):

1. ``fastcomm.ft``, no failure: a real Lighthouse, one Manager per replica (tests/fastcomm/_ft_workers.py);
2. ``fastcomm.ft``, replica 1 killed (SIGKILL) every ``--fail-every`` steps and started again at once: the
   others go on, the restarted one heals from a peer;
3. restart from a checkpoint (``fastcomm.Checkpointer`` every ``--checkpoint-every`` steps, as
   ``torchrun --max-restarts`` does it): the same kills stop every rank, all start again and resume from
   the newest checkpoint.

Each job's throughput is its steps over the wall time from its first step to its last (restarts, heals
and replayed steps inside); the loss is on a held-out set after the last step. torchft's published anchor
is 81% of the fault-free throughput at one failure a minute; ``--full`` runs that rate (one failure per
300 steps of 0.2 s).

Example::

    python -m benchmarks.bench_ft                 # short: 240 steps of 0.05 s, a failure every 80 steps
    python -m benchmarks.bench_ft --full          # 900 steps of 0.2 s, a failure a minute
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks import harness

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fastcomm"))
import _ft_workers as workers  # noqa: E402

__all__ = ["checkpoint_job", "main"]


def _rank_main(job: workers.Job, rank: int, attempt: int, checkpoint_every: int, out: str) -> None:
    """One rank of the checkpointed job's attempt ``attempt``; rank 1 kills itself at the planned steps."""
    import torch
    import torch.distributed as dist

    import fastcomm

    torch.set_num_threads(1)
    out_dir = Path(out)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store.{attempt}", rank=rank,
                            world_size=job.replicas, timeout=timedelta(seconds=job.timeout_s))  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Linear(workers.DIM_IN, workers.DIM_OUT)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = fastcomm.register(ddp, "quantize", bits=8)
    inner = torch.optim.SGD(model.parameters(), lr=job.lr, momentum=0.9)
    loader = workers.make_loader(str(out_dir / "data"), job.batch_size)(rank, job.replicas)
    ckpt = fastcomm.Checkpointer(str(out_dir / "ckpt"), every=checkpoint_every, keep=2, model=model,
                                 optimizer=inner, hook=state, loader=loader)  # fmt: skip
    start = ckpt.restore()
    batches = iter(loader)
    with open(out_dir / f"times.{rank}", "a") as log:
        for step in range(start + 1, job.steps + 1):
            batch = next(batches)
            torch.nn.functional.mse_loss(ddp(batch["x"]), batch["y"]).backward()
            if rank == 1 and workers.Kill(1, attempt, "exchange", step) in job.kills:
                os.kill(os.getpid(), signal.SIGKILL)
            inner.step()
            inner.zero_grad()
            time.sleep(job.step_sleep_s)
            ckpt.maybe_save(step)
            log.write(json.dumps([step, time.time()]) + "\n")
            log.flush()
    if rank == 0:
        (out_dir / "loss").write_text(str(workers.eval_loss(model)))
    dist.destroy_process_group()


def checkpoint_job(job: workers.Job, checkpoint_every: int, out_dir: Path) -> dict[str, Any]:
    """Run ``job`` as torchrun would with ``--max-restarts``: every rank again after any rank dies."""
    workers.write_dataset(out_dir / "data", job.samples)
    context = multiprocessing.get_context("forkserver")
    attempt = 0
    while True:
        ranks = [context.Process(target=_rank_main, args=(job, rank, attempt, checkpoint_every, str(out_dir)))
                 for rank in range(job.replicas)]  # fmt: skip
        for process in ranks:
            process.start()
        while all(process.exitcode in (None, 0) for process in ranks) and any(p.is_alive() for p in ranks):
            time.sleep(0.05)
        for process in ranks:  # torchrun stops the group when one worker fails
            if process.is_alive():
                process.kill()
            process.join()
        if all(process.exitcode == 0 for process in ranks):
            break
        attempt += 1
    times = [json.loads(line) for line in (out_dir / "times.0").read_text().splitlines()]
    return {"loss": float((out_dir / "loss").read_text()), "times": times, "restarts": attempt}


def _throughput(times: list, steps: int) -> float:
    return steps / (times[-1][1] - times[0][1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="900 steps of 0.2 s, a failure per 300 steps")
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--fail-every", type=int, default=80)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    args = parser.parse_args(argv)
    if args.full:
        args.steps, args.step_s, args.fail_every, args.checkpoint_every = 900, 0.2, 300, 50
    fail_at = list(range(args.fail_every, args.steps, args.fail_every))
    common = {
        "mode": "ddp",
        "steps": args.steps,
        "step_sleep_s": args.step_s,
        "samples": 4 * 3 * args.steps * 2,
    }
    ft_kills = [workers.Kill(1, life, "exchange", step) for life, step in enumerate(fail_at)]
    ckpt_kills = [workers.Kill(1, attempt, "exchange", step) for attempt, step in enumerate(fail_at)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp, harness.heartbeat("bench_ft"):
        for name, kills in (("fastcomm.ft, no failure", []), ("fastcomm.ft, failures", ft_kills)):
            harness.progress(f"bench_ft: {name}")
            result = workers.run(workers.Job(**common, kills=kills), Path(tmp) / name.replace(" ", "_"),
                                 deadline_s=60 + 4 * args.steps * args.step_s)  # fmt: skip
            final = result["finals"][0]
            results[name] = {"loss": final["loss"], "steps_per_s": _throughput(final["times"], args.steps),
                             "events": len(kills)}  # fmt: skip
        harness.progress("bench_ft: restart from a checkpoint")
        ckpt = checkpoint_job(workers.Job(**common, kills=ckpt_kills), args.checkpoint_every,
                              Path(tmp) / "checkpoint")  # fmt: skip
        rate = _throughput(ckpt["times"], args.steps)
        results["restart from checkpoint, failures"] = {"loss": ckpt["loss"], "steps_per_s": rate,
                                                        "events": ckpt["restarts"]}  # fmt: skip
    clean = results["fastcomm.ft, no failure"]["steps_per_s"]
    rows = []
    for name, measured in results.items():
        extra = {"loss": round(measured["loss"], 6), "failures": measured["events"]}
        rate = measured["steps_per_s"]
        rows.append(harness.Row(name, "gloo, 3 replicas", "steps_per_s", rate, "steps/s", rate / clean,
                                "fastcomm.ft, no failure", extra))  # fmt: skip
        rows.append(harness.Row(name, "gloo, 3 replicas", "final_loss", measured["loss"], "mse"))
    minutes = args.fail_every * args.step_s / 60
    notes = [
        f"{args.steps} steps of {args.step_s} s (a sleep; the tiny model's compute is milliseconds), "
        f"replica 1 killed every {args.fail_every} steps (one failure per {minutes:.2f} min), checkpoint "
        f"every {args.checkpoint_every} steps; Lighthouse heartbeat timeout 1 s, collective timeout 5 s.",
        "ratio: throughput against fastcomm.ft without failures, in the same run. torchft's anchor: 81% at "
        "one failure a minute; the issue's target for fastcomm.ft: >= 90% at that rate (--full).",
    ]
    print(harness.write_results("bench_ft", rows, notes=notes, plot_metric="steps_per_s"))


if __name__ == "__main__":
    main()
