"""A user's short training script with a fastcomm hook, run many times, counting the runs that exit non-zero.

    python tests/fastcomm/_exit_script.py METHOD RUNS

Each run forks two ranks from this process (torch imported once, so a run costs its training and its exit,
not an import). Each rank trains a few steps, calls ``dist.destroy_process_group()`` and leaves through a
normal interpreter exit, with its model, hook state and optimizer still referenced from module globals as in
a script written at top level: no ``os._exit``, no ``gc.collect()``. Prints ``failed K of RUNS`` and one
line per failed rank (its signal or exit code and its last output), and exits 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time

import torch
import torch._dynamo  # noqa: F401 - DDP imports it at construction: once here, not in every run's ranks
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fastcomm

METHODS = ("topk", "sign", "quantize", "powersgd", "cadam")
RUN_TIMEOUT_S = 120.0
KEEP: list[object] = []  # what a top-level script keeps alive until its interpreter exits


def train(method: str, rank: int, port: int) -> None:
    """The script of one rank: DDP, a hook, five steps, ``destroy_process_group``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"


def run_once(method: str, logs: str) -> tuple[int, list[str]] | None:
    """Fork the two ranks of one run. In the parent: (failed ranks, their lines); in a rank: ``None``."""
    port = free_port()
    pids = {}
    for rank in range(2):
        log = os.path.join(logs, f"rank{rank}.log")
        pid = os.fork()
        if pid == 0:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            try:
                train(method, rank, port)
            except BaseException as error:  # noqa: BLE001 - a failed rank exits 1, as a script would
                print(f"rank {rank}: {type(error).__name__}: {error}", flush=True)
                os._exit(1)
            return None  # the rank leaves main() and this interpreter exits as a script's does
        pids[pid] = (rank, log)
    failures = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                for stuck in pids:
                    os.kill(stuck, signal.SIGKILL)
            time.sleep(0.01)
            continue
        rank, log = pids.pop(pid)
        if status != 0:
            with open(log, errors="replace") as f:
                tail = " | ".join(f.read().strip().splitlines()[-2:])
            failures.append(f"rank {rank}: {describe(status)}: {tail}")
    return len(failures), failures


def main() -> int:
    method, runs = sys.argv[1], int(sys.argv[2])
    if method not in METHODS:
        raise SystemExit(f"method must be one of {METHODS}, got {method!r}")
    failed, lines = 0, []
    logs = tempfile.mkdtemp()  # not a context manager: a rank returning from here must not remove it
    for _ in range(runs):
        outcome = run_once(method, logs)
        if outcome is None:
            return 0
        failed += outcome[0] > 0
        lines += outcome[1]
    shutil.rmtree(logs)
    print("\n".join(lines))
    print(f"failed {failed} of {runs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
