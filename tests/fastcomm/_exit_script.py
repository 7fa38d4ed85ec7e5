"""A user's short training script with a fastcomm hook, run many times, counting the runs that exit non-zero.

    python tests/fastcomm/_exit_script.py METHOD[,METHOD...] RUNS [CONCURRENT]

Each run forks two ranks from this process (torch imported once, so a run costs its training and its exit,
not an import). Each rank trains a few steps, calls ``dist.destroy_process_group()`` and leaves through a
normal interpreter exit, with its model, hook state and optimizer still referenced from module globals as in
a script written at top level: no ``os._exit``, no ``gc.collect()``. RUNS runs of every METHOD, up to
CONCURRENT (default 4) runs at a time: a run mostly waits (rendezvous, collectives, the exit wait), and each
run has its own ranks, rendezvous file and logs (a file, not a port: a free port picked here can be taken
by another test before rank 0 listens on it). Prints one line per failed rank (its signal or exit code and its
last output), then ``METHOD: failed K of RUNS`` for each method, and exits 0.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch._dynamo  # noqa: F401 - DDP imports it at construction: once here, not in every run's ranks
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fastcomm
import fastcomm.hooks  # noqa: F401 - register() and CompressedAdam load it on first use: once here, not per rank

METHODS = ("topk", "sign", "quantize", "powersgd", "cadam")
RUN_TIMEOUT_S = 120.0
KEEP: list[object] = []  # what a top-level script keeps alive until its interpreter exits


def train(method: str, rank: int, rendezvous: str) -> None:
    """The script of one rank: DDP, a hook, five steps, ``destroy_process_group``."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    # two buckets: sign and quantize pipeline phase 2 across them
    ddp = DDP(model, bucket_cap_mb=0.05)
    if method == "cadam":
        optimizer: torch.optim.Optimizer = fastcomm.CompressedAdam(ddp.parameters(), lr=1e-3, warmup_steps=2)
        state = fastcomm.register(ddp, optimizer)
    else:
        state = fastcomm.register(ddp, method, **({"ratio": 0.01} if method == "topk" else {}))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    if os.environ.get("FASTCOMM_TEST_SWITCH_INTERVAL"):
        # a main thread that keeps the GIL longer: the window between the last backward and the exit widens
        sys.setswitchinterval(float(os.environ["FASTCOMM_TEST_SWITCH_INTERVAL"]))
    for _ in range(5):
        x = torch.randn(32, 64, generator=generator)
        y = torch.randint(0, 10, (32,), generator=generator)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()
    KEEP.extend((ddp, state, optimizer))


def describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"


def last_lines(log: str) -> str:
    """The rank's last two lines of output, without the leak report nanobind prints at every exit."""
    with open(log, errors="replace") as f:
        own = [line for line in f.read().strip().splitlines() if "nanobind" not in line and line[:3] != " - "]
    return " | ".join(own[-2:])


@dataclass
class Run:
    method: str
    index: int
    deadline: float
    logs: list[str] = field(default_factory=list)  # by rank
    pids: list[int] = field(default_factory=list)  # by rank
    failures: list[str] = field(default_factory=list)
    exited: int = 0


def start(method: str, index: int, logs: str) -> Run | None:
    """Fork the two ranks of one run. In the parent: the run; in a rank: ``None``."""
    rendezvous = os.path.join(logs, f"{method}-{index}.rendezvous")
    run = Run(method, index, time.monotonic() + RUN_TIMEOUT_S)
    for rank in range(2):
        log = os.path.join(logs, f"{method}-{index}-rank{rank}.log")
        pid = os.fork()
        if pid == 0:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            try:
                train(method, rank, rendezvous)
            except BaseException as error:  # noqa: BLE001 - a failed rank exits 1, as a script would
                print(f"rank {rank}: {type(error).__name__}: {error}", flush=True)
                os._exit(1)
            return None  # the rank leaves main() and this interpreter exits as a script's does
        run.logs.append(log)
        run.pids.append(pid)
    return run


def main() -> int:
    methods, runs = sys.argv[1].split(","), int(sys.argv[2])
    concurrent = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    unknown = [method for method in methods if method not in METHODS]
    if unknown:
        raise SystemExit(f"methods must be among {METHODS}, got {unknown}")
    # Every rank is forked from this process, whose heap holds torch: without this, each rank's exit
    # collects, and so copies on write, that whole heap (seconds of CPU per run that a script that was
    # not forked does not pay). The rank's own objects (model, hook state, futures) are still collected.
    gc.freeze()
    # one intra-op thread per rank, as torchrun sets for several ranks on one machine (OMP_NUM_THREADS=1)
    torch.set_num_threads(1)
    todo = [(method, index) for index in range(runs) for method in methods]
    active: list[Run] = []
    running: dict[int, tuple[Run, int]] = {}  # rank pid -> (its run, its rank)
    failed = dict.fromkeys(methods, 0)
    lines: list[str] = []
    logs = tempfile.mkdtemp()  # not a context manager: a rank returning from here must not remove it
    while todo or running:
        while todo and len(active) < concurrent:
            run = start(*todo.pop(0), logs)
            if run is None:
                return 0
            active.append(run)
            running.update((pid, (run, rank)) for rank, pid in enumerate(run.pids))
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for stuck, (run, _) in running.items():
                if time.monotonic() > run.deadline:
                    os.kill(stuck, signal.SIGKILL)
            time.sleep(0.01)
            continue
        run, rank = running.pop(pid)
        run.exited += 1
        if status != 0:
            run.failures.append(
                f"{run.method} run {run.index} rank {rank}: {describe(status)}: {last_lines(run.logs[rank])}"
            )
        if run.exited == len(run.pids):
            active.remove(run)
            failed[run.method] += bool(run.failures)
            lines += run.failures
    shutil.rmtree(logs)
    gc.unfreeze()  # this process was not forked: its own exit collects its heap as usual
    lines += [f"{method}: failed {failed[method]} of {runs}" for method in methods]
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
