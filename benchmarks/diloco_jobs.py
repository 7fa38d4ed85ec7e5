"""Many short LM runs on one pair of rank processes: the runs of :mod:`benchmarks.bench_diloco_seeds`.

A :class:`Job` is one run of ``examples/train_lm.py``'s :func:`train` (dense DDP AdamW, or DiLoCo with the
job's options) at one seed, data order, length and model shape. :func:`run_jobs` starts two gloo ranks once
and trains every job that is not yet cached in the work directory, one after another in the same two
processes (no process start, import or data preparation per run: on a shared 2-core machine that overhead is
as long as a short run). Each result is cached as ``<work>/job-<tag>.json``, the tag a hash of the job, so a
changed job is trained again and an unchanged one never is. With a ``link`` (a
:class:`benchmarks.netlab.Link`, as root) the two ranks run in its two network namespaces instead and talk
over its shaped veth (``python -m benchmarks.diloco_jobs`` is that rank process):
:mod:`benchmarks.bench_diloco_eager` times its runs there.

Example::

    jobs = [Job("dense", None, seed=s) for s in range(3)]
    results = run_jobs(jobs, work=Path("/tmp/w"))
    print(results[jobs[0]]["val_losses"][-1])
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import netlab
from benchmarks.common import free_port, launch, rank_env, tail
from benchmarks.lm_methods import load_example

__all__ = ["SMALL_MODEL", "WORLD", "Job", "main", "run_jobs"]

WORLD = 2
# The LM of examples/train_lm.py, smaller (about 1/10 of its compute per step), so that a 250-step run costs
# about a minute of a loaded 2-core machine and every row can afford six seeds (docs/diloco.md).
SMALL_MODEL = {"d_model": 64, "n_layer": 2, "n_head": 4, "context": 64}
# fields added after runs were cached: left out of the tag while at these defaults, so those runs keep theirs
_LATER_FIELDS = {"hook": "none", "schedule_steps": None, "val_rows": 128, "repeat": 0, "link": ""}


@dataclasses.dataclass(frozen=True)
class Job:
    """One LM run: ``options`` None is dense DDP AdamW (with ``hook``: ``"noop"`` is the no-communication
    step), else DiLoCo's keyword arguments (through ``lm_optim.diloco_arguments``: ``outer_lr_ramp=[...]``
    allowed); ``data_seed`` None is ``seed``. ``repeat`` and ``link`` only tell apart runs that are the same
    training (a timing repeated, or run on another link)."""

    name: str
    options: dict[str, Any] | None
    seed: int = 0
    data_seed: int | None = None
    steps: int = 250
    model: dict[str, int] = dataclasses.field(default_factory=lambda: dict(SMALL_MODEL))
    batch_size: int = 16
    warmup_steps: int = 30
    eval_every: int = 50
    hook: str = "none"
    schedule_steps: int | None = None  # the cosine's length (None: steps)
    val_rows: int = 128
    repeat: int = 0
    link: str = ""

    def __hash__(self) -> int:
        return hash(self.tag)

    @property
    def tag(self) -> str:
        """A short hash of everything that decides the run (not the name: two rows of one run share it)."""
        decides = {k: v for k, v in dataclasses.asdict(self).items()
                   if k != "name" and (k not in _LATER_FIELDS or v != _LATER_FIELDS[k])}  # fmt: skip
        text = json.dumps(decides, sort_keys=True, default=repr)
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def config(self, train_lm: Any) -> Any:
        """This job as a ``train_lm.TrainConfig``."""
        optimizer = "adamw" if self.options is None else "diloco"
        return train_lm.TrainConfig(
            optimizer=optimizer, options=dict(self.options or {}), steps=self.steps, seed=self.seed,
            data_seed=self.data_seed, batch_size=self.batch_size, warmup_steps=self.warmup_steps,
            eval_every=self.eval_every, log_every=0, model=train_lm.ModelConfig(**self.model),
            hook=self.hook, schedule_steps=self.schedule_steps, val_rows=self.val_rows,
        )  # fmt: skip


def _path(work: Path, job: Job) -> Path:
    return work / f"job-{job.tag}.json"


def _worker(
    rank: int, port: int, jobs: list[Job], work: Path, data_dir: Path, master: str = "127.0.0.1"
) -> None:
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        train_lm = load_example()
        paths = train_lm.prepare_data(data_dir)
        for job in jobs:
            begin = time.monotonic()
            result = train_lm.train(job.config(train_lm), paths)
            if rank == 0:
                found = dataclasses.asdict(result)
                found.update(job=dataclasses.asdict(job), wall_s=time.monotonic() - begin)
                temporary = _path(work, job).with_suffix(".tmp")
                temporary.write_text(json.dumps(found, default=str))
                temporary.replace(_path(work, job))
                print(f"[diloco_jobs] {job.name} seed {job.seed} ({job.steps} steps): val loss "
                      f"{result.val_losses[-1]:.4f} in {found['wall_s']:.0f} s", flush=True)
    finally:
        dist.destroy_process_group()


def _on_link(jobs: list[Job], work: Path, data: Path, link: netlab.Link, timeout_s: float) -> None:
    """Train ``jobs`` on two rank processes in ``link``'s namespaces (``python -m benchmarks.diloco_jobs``),
    at most ``timeout_s``; ``RuntimeError`` if a rank failed or ran out of time."""
    listed = work / f"jobs-{jobs[0].tag}.json"
    listed.write_text(json.dumps([dataclasses.asdict(job) for job in jobs]))
    command = [sys.executable, "-m", "benchmarks.diloco_jobs", "--jobs", str(listed), "--work", str(work),
               "--data-dir", str(data)]  # fmt: skip
    port = free_port()
    envs = [rank_env(r, WORLD, port, link.addresses[0], GLOO_SOCKET_IFNAME=link.interfaces[r])
            for r in range(WORLD)]  # fmt: skip
    logs = [work / f"{listed.stem}.rank{r}.log" for r in range(WORLD)]
    ranks = launch([[*link.exec_prefix(r), *command] for r in range(WORLD)], envs, logs, timeout_s)
    if not ranks.ok:
        raise RuntimeError(f"diloco_jobs on {link.rate}: {ranks.describe()}; rank 0: {tail(logs[0])}")


def run_jobs(
    jobs: Sequence[Job],
    work: Path,
    data_dir: Path | None = None,
    reuse_only: bool = False,
    log: Callable[[str], None] = print,
    link: netlab.Link | None = None,
    timeout_s: float = 3600.0,
) -> dict[Job, dict[str, Any] | None]:
    """Each job's ``TrainResult`` dict (with ``job`` and ``wall_s``), trained unless cached in ``work``.

    The missing jobs run in order on two gloo rank processes started once (``reuse_only``: none run, and a
    missing one is None): on loopback, or in ``link``'s two namespaces over its shaped veth (bounded by
    ``timeout_s``). A failed rank raises ``RuntimeError`` (the jobs finished before it stay cached).
    """
    work.mkdir(parents=True, exist_ok=True)
    missing = list({job.tag: job for job in jobs if not _path(work, job).exists()}.values())
    if missing and not reuse_only:
        train_lm = load_example()
        data = data_dir or train_lm.default_data_dir()
        train_lm.prepare_data(data)  # once, before the ranks read it
        where = f" on {link.rate}" if link is not None else ""
        log(f"[diloco_jobs] training {len(missing)} of {len(jobs)} runs{where} in {work}")
        if link is not None:
            _on_link(missing, work, data, link, timeout_s)
        else:
            mp.start_processes(_worker, args=(free_port(), missing, work, data), nprocs=WORLD, join=True,
                               start_method="spawn")  # fmt: skip
    return {job: json.loads(_path(work, job).read_text()) if _path(work, job).exists() else None
            for job in jobs}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    """One rank of :func:`run_jobs` on a link: the jobs listed in ``--jobs``, the rank and the rendezvous
    from torch.distributed's variables (``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diloco_jobs", description=main.__doc__)
    parser.add_argument("--jobs", type=Path, required=True, help="a JSON list of Job fields")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    jobs = [Job(**fields) for fields in json.loads(args.jobs.read_text())]
    _worker(int(os.environ["RANK"]), int(os.environ["MASTER_PORT"]), jobs, args.work, args.data_dir,
            os.environ["MASTER_ADDR"])  # fmt: skip


if __name__ == "__main__":
    main()
