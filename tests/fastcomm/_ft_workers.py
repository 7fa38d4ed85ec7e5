"""Replicas of a tiny job on torchft, for tests/fastcomm/test_ft.py and benchmarks/bench_ft.py.

:func:`run` starts a real Lighthouse in this process and each replica in a process of its own (forked from
a forkserver that imported torch, torchft, fastcomm.ft and fastio once), kills replicas where a plan says
(``os.kill(SIGKILL)`` from inside, at a named point), starts each killed one again, and collects what every
replica wrote: the sample ids it committed (appended as it goes, so a killed replica's survive it), its
step times, and at the end its weights and loss on a held-out set.

A job is one of:

* ``"diloco"``: :class:`fastcomm.DiLoCo` (4-bit quantize, ``sync_every`` H, ``fragments``, ``delay``) under
  :class:`fastcomm.ft.FaultTolerantDiLoCo`, SGD with momentum inner;
* ``"ddp"``: a DDP model with :func:`fastcomm.ft.register` (8-bit quantize, or ``"auto"`` given a 1 MB/s
  link), SGD with momentum, a quorum a step.

Where a replica can be killed (``Kill.where``): ``"interval"`` (after the backward of inner step ``step``,
between syncs), ``"sync"`` (inside the exchange issued at step ``step``: phase 1 sent, before its
wait), ``"exchange"`` (DDP: in the hook of step ``step``, before its all-reduce, while the peers are in
theirs).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

DIM_IN, DIM_OUT, NOISE = 16, 8, 0.1
# imported once by the forkserver (torch._dynamo: what an optimizer's constructor imports, seconds of CPU)
AWAY = "away"  # the file :func:`run` keeps while a killed replica has not healed yet
PRELOAD = ["_ft_workers", "torchft", "fastcomm.ft", "fastio", "torch._dynamo"]


@dataclass(frozen=True)
class Kill:
    """Kill replica ``replica``'s incarnation ``incarnation`` at ``where`` of step ``step``."""

    replica: int
    incarnation: int
    where: str
    step: int


@dataclass
class Job:
    """One run: the method, its schedule, the faults, and the timeouts (short: this is a test)."""

    mode: str = "diloco"
    replicas: int = 3
    steps: int = 150
    sync_every: int = 5
    fragments: int = 1
    delay: int = 0
    bits: int = 4
    batch_size: int = 4
    samples: int = 2400
    lr: float = 0.02
    kills: list[Kill] = field(default_factory=list)
    step_sleep_s: float = 0.0  # a slower step, for the benchmark's failure rate in time
    odd_bits: int | None = None  # replica 1's bits instead of ``bits``: settings that do not match
    restart_after_s: float = 0.0  # how long a killed replica stays away before it is started again
    # while a killed replica is away (killed, not yet healed), each other replica's steps take at least this
    # long: a test's survivors must not finish before it is back, however slowly a loaded machine starts it
    away_step_s: float = 0.0
    method: str = "quantize"  # DDP: the hook's method ("auto": on a given 1 MB/s link, decided per quorum)
    heartbeat_timeout_ms: int = 1000
    join_timeout_ms: int = 5000
    timeout_s: int = 5
    quorum_timeout_s: int = 30


def true_weights() -> torch.Tensor:
    return torch.randn(DIM_IN, DIM_OUT, generator=torch.Generator().manual_seed(1))


def write_dataset(path: Path, samples: int) -> None:
    """``samples`` rows ``(idx, x, y = x W + noise)``, in shards of 97."""
    import fastio

    rng = np.random.default_rng(2)
    weights = true_weights().numpy()
    x = rng.standard_normal((samples, DIM_IN)).astype(np.float32)
    y = (x @ weights + NOISE * rng.standard_normal((samples, DIM_OUT))).astype(np.float32)
    schema = {"idx": ("int64", ()), "x": ("float32", (DIM_IN,)), "y": ("float32", (DIM_OUT,))}
    with fastio.ShardWriter(str(path), schema=schema, max_samples=97) as writer:
        for i in range(samples):
            writer.write({"idx": i, "x": x[i], "y": y[i]})


def eval_loss(model: torch.nn.Module) -> float:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(512, DIM_IN, generator=generator)
    y = x @ true_weights() + NOISE * torch.randn(512, DIM_OUT, generator=generator)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def make_loader(path: str, batch_size: int):
    import fastio

    def build(rank: int, world_size: int) -> Any:
        order = fastio.OrderOptions(rank=rank, world_size=world_size)
        return fastio.StreamLoader(path, batch_size=batch_size, shuffle=True, seed=0, order=order)

    return build


def global_order(path: str) -> list[int]:
    """The epoch-0 order every replica's share is cut from (one loader of world size 1)."""
    loader = make_loader(path, 512)(0, 1)
    return [int(i) for batch in loader for i in batch["idx"]]


class _Log:
    """What a replica writes as it goes: committed sample ids and step times (lines of JSON)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def write(self, **record: Any) -> None:
        self.file.write(json.dumps(record) + "\n")


def _logged_data(make: Any, log: _Log) -> Any:
    import fastcomm.ft

    class LoggedData(fastcomm.ft.ReplicaData):
        pending: list[int] = []

        def next(self) -> Any:
            batch = super().next()
            self.pending = self.pending + [int(i) for i in batch["idx"]]
            return batch

        def commit(self) -> None:
            super().commit()
            log.write(kind="commit", ids=self.pending)
            self.pending = []

        def rollback(self) -> None:
            super().rollback()
            self.pending = []

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            self.pending = []
            log.write(kind="healed")

    return LoggedData(make)


def _kill_if(job: Job, replica: int, incarnation: int, where: str, step: int) -> None:
    if Kill(replica, incarnation, where, step) in job.kills:
        os.kill(os.getpid(), signal.SIGKILL)


def _pace(job: Job, out_dir: Path) -> None:
    """The job's step sleep, or ``away_step_s`` while :func:`run` says a killed replica is away."""
    away = job.away_step_s if job.away_step_s and (out_dir / AWAY).exists() else 0.0
    time.sleep(max(job.step_sleep_s, away))


def replica_main(job: Job, replica: int, incarnation: int, lighthouse: str, out: str) -> None:
    """One replica's whole run (a process of its own); an exception is written beside its log."""
    try:
        _replica(job, replica, incarnation, lighthouse, Path(out))
    except BaseException as error:
        (Path(out) / f"r{replica}.{incarnation}.error").write_text(f"{type(error).__name__}: {error}")
        os._exit(3)
    os._exit(0)  # torchft's server threads would hold the process on


def _replica(job: Job, replica: int, incarnation: int, lighthouse: str, out_dir: Path) -> None:
    import torch.distributed as dist

    import fastcomm
    import fastcomm.ft
    from fastcomm.advise.model import Link
    from fastcomm.diloco import fragments

    torch.set_num_threads(1)
    log = _Log(out_dir / f"r{replica}.{incarnation}.jsonl")
    log.write(kind="entered", t=time.time())
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM_IN, DIM_OUT)
    inner = torch.optim.SGD(model.parameters(), lr=job.lr, momentum=0.9)
    data = _logged_data(make_loader(str(out_dir / "data"), job.batch_size), log)
    manager = fastcomm.ft.connect(
        f"replica{replica}", lighthouse=lighthouse, min_replicas=2, store=store,
        timeout=timedelta(seconds=job.timeout_s), quorum_timeout=timedelta(seconds=job.quorum_timeout_s),
        connect_timeout=timedelta(seconds=5),
    )  # fmt: skip
    log.write(kind="connected", t=time.time())
    times = []
    if job.mode == "ddp":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        options = {"link": Link(1e-6, 1e6)} if job.method == "auto" else {"bits": 8}
        hook = fastcomm.ft.register(ddp, manager, job.method, **options)
        real_all_reduce = hook.exchange.all_reduce

        def all_reduce(*args: Any, **kwargs: Any) -> bool:
            _kill_if(job, replica, incarnation, "exchange", manager.current_step() + 1)
            return real_all_reduce(*args, **kwargs)

        hook.exchange.all_reduce = all_reduce  # type: ignore[method-assign]
        fastcomm.ft.heal_state(manager, model=model, inner=inner, hook=hook, data=data)
        while manager.current_step() < job.steps:
            manager.start_quorum()
            data.split(manager)
            batch = data.next()
            torch.nn.functional.mse_loss(ddp(batch["x"]), batch["y"]).backward()
            if manager.should_commit():
                inner.step()
                data.commit()
            else:
                data.rollback()
            inner.zero_grad()
            _pace(job, out_dir)
            times.append((manager.current_step(), time.time()))
        stats: dict[str, Any] = {"failed_exchanges": hook.exchange.failures, "step": manager.current_step()}
        if hook.auto is not None:  # each quorum's size and its choice by bucket size, in order
            stats["auto_decisions"] = [(n, dict(choices)) for n, choices in hook.auto.decisions]
    else:
        bits = job.odd_bits if job.odd_bits is not None and replica == 1 else job.bits
        outer = fastcomm.DiLoCo(model, inner, sync_every=job.sync_every, outer_lr=0.7, outer_momentum=0.5,
                                compressor="quantize", bits=bits, fragments=job.fragments,
                                delay=job.delay)  # fmt: skip
        real_settle = fragments.Exchange.settle

        def settle(exchange: Any) -> None:
            _kill_if(job, replica, incarnation, "sync", exchange.issued)
            real_settle(exchange)

        fragments.Exchange.settle = settle  # type: ignore[method-assign]
        ft = fastcomm.ft.FaultTolerantDiLoCo(manager, outer, data=data)
        fastcomm.ft.heal_state(manager, model=model, inner=inner, outer=ft, data=data)
        ft.start()
        log.write(kind="start", step=outer.inner_steps, t=time.time())
        while outer.inner_steps < job.steps:
            batch = data.next()
            torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
            _kill_if(job, replica, incarnation, "interval", outer.inner_steps + 1)
            ft.step()
            inner.zero_grad()
            _pace(job, out_dir)
            times.append((outer.inner_steps, time.time()))
        outer.finish()
        stats = {
            "global": torch.cat([f.global_weights for f in outer.fragments]),
            "failed_syncs": ft.failed_syncs,
            "last_error": str(ft.last_error)[:2000],
            "discarded_steps": ft.discarded_steps,
            "step": outer.inner_steps,
            **outer.stats(),
        }
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save({"weights": weights, "loss": eval_loss(model), "times": times, "stats": stats},
               out_dir / f"r{replica}.{incarnation}.final.pt")  # fmt: skip
    manager.shutdown(wait=False)


def run(job: Job, out_dir: Path, deadline_s: float = 120.0) -> dict[str, Any]:
    """Run ``job`` with a Lighthouse here; restart each killed replica once per kill. Returns every
    replica's final record (the last incarnation's), every incarnation's log, and the wall time."""
    from torchft.coordination import LighthouseServer

    if not (out_dir / "data").exists():
        write_dataset(out_dir / "data", job.samples)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=job.join_timeout_ms,
                                  heartbeat_timeout_ms=job.heartbeat_timeout_ms)  # fmt: skip
    address = lighthouse.address().replace("[::]", "127.0.0.1")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    processes = {}
    incarnations = dict.fromkeys(range(job.replicas), 0)
    begin = time.time()

    def start(replica: int) -> None:
        process = context.Process(target=replica_main, args=(job, replica, incarnations[replica], address,
                                                             str(out_dir)))  # fmt: skip
        process.start()
        processes[replica] = process

    def healed(replica: int) -> bool:
        log = out_dir / f"r{replica}.{incarnations[replica]}.jsonl"
        return log.exists() and '"healed"' in log.read_text()

    away: set[int] = set()  # killed replicas whose next incarnation has not healed yet

    for replica in range(job.replicas):
        start(replica)
    exits: list[tuple[int, int, int | None]] = []
    restarts: dict[int, float] = {}  # replica -> when it is started again
    cpu = _CpuMeter()
    try:
        while (
            restarts or any(p.is_alive() for p in processes.values())
        ) and time.time() - begin < deadline_s:
            cpu.read([p.pid for p in processes.values()])
            for replica, due in list(restarts.items()):
                if time.time() >= due:
                    del restarts[replica]
                    start(replica)
            for replica, process in list(processes.items()):
                if process.is_alive() or process.exitcode is None:
                    continue
                exits.append((replica, incarnations[replica], process.exitcode))
                del processes[replica]
                if process.exitcode == -signal.SIGKILL:
                    incarnations[replica] += 1
                    restarts[replica] = time.time() + job.restart_after_s
                    away.add(replica)
            away -= {replica for replica in away if replica not in restarts and healed(replica)}
            if away:
                (out_dir / AWAY).touch()
            else:
                (out_dir / AWAY).unlink(missing_ok=True)
            time.sleep(0.05)
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
            process.join()
            exits.append((-1, -1, process.exitcode))
        lighthouse.shutdown()
    result = collect(job, out_dir, incarnations, exits, time.time() - begin)
    result["replica_cpu_s"] = cpu.total()
    return result


def forkserver_cpu_s() -> float:
    """The CPU seconds of this process's forkserver so far (its imports; its children are counted apart)."""
    from multiprocessing import forkserver

    meter = _CpuMeter()
    meter.read([forkserver._forkserver._forkserver_pid])
    return meter.total()


class _CpuMeter:
    """The CPU seconds of the replica processes, read from /proc while they run (a killed one's last read)."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self.tick = os.sysconf("SC_CLK_TCK")

    def read(self, pids: list[int | None]) -> None:
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            self.seen[pid] = (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime

    def total(self) -> float:
        return sum(self.seen.values())


def collect(job: Job, out_dir: Path, incarnations: dict[int, int], exits: list, wall_s: float) -> dict:
    finals, logs = {}, {}
    for replica, last in incarnations.items():
        path = out_dir / f"r{replica}.{last}.final.pt"
        if path.exists():
            finals[replica] = torch.load(path)
        for incarnation in range(last + 1):
            path = out_dir / f"r{replica}.{incarnation}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            logs[(replica, incarnation)] = [json.loads(line) for line in lines]
    errors = {path.name: path.read_text() for path in out_dir.glob("*.error")}
    order = global_order(str(out_dir / "data"))
    return {"job": asdict(job), "finals": finals, "logs": logs, "exits": exits, "wall_s": wall_s,
            "errors": errors, "order": order}  # fmt: skip
