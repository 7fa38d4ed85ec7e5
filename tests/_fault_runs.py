"""The interrupted-run harness of the fault-tolerance tests (``test_fault_tolerance.py``,
``test_fault_checkpoints.py``, ``test_fault_elastic.py``, ``test_fault_survivor.py``): examples/train_lm.py
under ``torchrun`` on a tiny GPT, killed, restarted and compared bit for bit with an uninterrupted run.

The test files split the work so that ``make test``'s pytest-xdist workers can run them side by side;
each has its own module-scoped data set and reference runs, grouped so that no reference runs twice.
Every rank is forked from one process that imported the example once (:class:`ForkedRanks`, its server
``_example_ranks.py``): a rank that imports torch and the example costs ten times its thirty training steps.
What a test does not test the launch of (its uninterrupted references, the legs of a run it restarts by hand,
hand-started ranks) runs in ranks the server forks on its own; a kill test's job is a real ``torchrun``
(launch, SIGKILL seen, group stopped and restarted), whose workers are ``_rank_client.py``: each has the
server fork its rank, in torchrun's environment and with its output, and ends as that rank ends.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import _rank_client
import pytest
import torch

import fastio
from benchmarks.lm_methods import EXAMPLE, load_example

BATCH = 16
TINY = [
    "--d-model",
    "32",
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--batch-size",
    str(BATCH),
    "--val-rows",
    "8",
    "--log-every",
    "0",
    "--eval-every",
    "0",
    "--threads",
    "1",
]
RUN_TIMEOUT = 300  # seconds for one torchrun (a loaded 2-core machine)
RANKS_SERVER = Path(__file__).with_name("_example_ranks.py")
RANK_CLIENT = Path(_rank_client.__file__)  # torchrun's worker: the server forks its rank
# The methods of the issue killed at a random step, as the example's arguments: topk, sign, and compressed
# Adam past its warm-up (quantize 8-bit is killed in the middle of a checkpoint write, in
# test_fault_checkpoints.py).
METHODS = {
    "topk": ["--hook", "topk", "--opt", "ratio=0.01"],
    "sign": ["--hook", "sign"],
    "cadam": [
        "--optimizer",
        "compressed_adam",
        "--opt",
        "compressor=sign",
        "--opt",
        "warmup_compressor=quantize",
        "--opt",
        "warmup_steps=8",
    ],
}


def data_set(max_files: int):
    """A module-scoped ``data_dir`` fixture: the example's shards of ``max_files`` stdlib files, prepared once
    per module (the runs find the count in the set's ``meta.json``: see :func:`data_args`).

    Example::

        data_dir = data_set(21)  # at a test module's top level
    """

    @pytest.fixture(scope="module")
    def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
        directory = tmp_path_factory.mktemp("data")
        load_example().prepare_data(directory, max_files=max_files)
        return directory

    return data_dir


# 20 train files (an epoch is 74 steps on 2 ranks), 1 validation file; 20 files left one validation file of 5
# rows, under one batch a rank
data_dir = data_set(21)


_SHARED: list[ForkedRanks] = []  # this test process's, for every module that forks ranks


@pytest.fixture(scope="module")
def forked(request: pytest.FixtureRequest) -> ForkedRanks:
    """This test process's :class:`ForkedRanks`, its server started at first use and shared by the modules
    it runs (the server's imports cost 4 s of CPU); closed at the session's end."""
    if not _SHARED:
        _SHARED.append(ForkedRanks())
        request.config.add_cleanup(_SHARED[0].close)
    return _SHARED[0]


@pytest.fixture(scope="module")
def reference(data_dir: Path, tmp_path_factory: pytest.TempPathFactory, forked: ForkedRanks):
    """``reference(args)``: the work directory of an uninterrupted run with ``args``, run once per module."""
    runs: dict[tuple[str, ...], Path] = {}

    def uninterrupted(args: list[str]) -> Path:
        key = tuple(args)
        if key not in runs:
            work = tmp_path_factory.mktemp("reference")
            forked.run(example_args(data_dir, work, *args), work)
            runs[key] = work
        return runs[key]

    return uninterrupted


class ForkedRanks:
    """Ranks of the example that ``_example_ranks.py`` forks: runs of their own, one at a time, in torchrun's
    worker environment (without its launcher: nothing restarts them), and the ranks of real ``torchrun``
    jobs whose workers are ``_rank_client.py`` (:meth:`torchrun_env`).

    Example::

        ranks = ForkedRanks()
        stderr = ranks.run(example_args(data_dir, work, "--hook", "sign", "--steps", "30"), work)
        ranks.close()
    """

    def __init__(self) -> None:
        self._server: subprocess.Popen[bytes] | None = None
        self._socket_dir = ""
        self._unfinished = False  # a run whose end was not read (its test failed first)
        self.pids: list[int] = []

    def _started(self) -> subprocess.Popen[bytes]:
        """The server, started at first use with the socket its torchrun workers connect to (listening before
        the server runs: a client that connects early waits in the backlog)."""
        if self._server is None:
            self._socket_dir = tempfile.mkdtemp(prefix="ranks-")  # short: a socket path has 107 bytes
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(os.path.join(self._socket_dir, "socket"))
            listener.listen(16)
            self._server = subprocess.Popen(
                [sys.executable, str(RANKS_SERVER), str(listener.fileno())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,
                env=run_env(),
                pass_fds=[listener.fileno()],
            )
            listener.close()
        return self._server

    def torchrun_env(self, **extra: str) -> dict[str, str]:
        """:func:`run_env` of a ``torchrun`` job of :func:`command`, whose workers have this server fork their
        ranks."""
        self._started()
        return run_env(**{_rank_client.ADDRESS: os.path.join(self._socket_dir, "socket")}, **extra)

    def start(self, argv: list[str], cwd: Path, world: int = 2, **env: str) -> list[int]:
        """Fork the ``world`` ranks of the example with ``argv`` in ``cwd`` (their output to
        ``cwd/rank<r>.err``); return their pids."""
        self._started()
        assert self._server is not None
        if self._unfinished:  # the last run's test failed before its end: end it, so its replies go
            self.kill()
            self.wait(time.monotonic() + RUN_TIMEOUT)
        cwd.mkdir(parents=True, exist_ok=True)
        request = {"argv": argv, "world": world, "cwd": str(cwd), "logs": str(cwd), "env": env}
        assert self._server.stdin is not None
        self._server.stdin.write((json.dumps(request) + "\n").encode())
        self.pids = self.next_reply(time.monotonic() + RUN_TIMEOUT)["pids"]
        self._unfinished = True
        return self.pids

    def next_reply(self, deadline: float) -> dict:
        """The server's next line: the pids, a rank's end (``rank``, ``status``, ``time``) or ``done``.
        Past ``deadline``, the ranks are killed and the test fails."""
        reply = self.poll(max(0.0, deadline - time.monotonic()))
        if reply is None:
            self.kill()
            raise AssertionError("the forked ranks did not finish in time")
        return reply

    def poll(self, timeout: float = 0.0) -> dict | None:
        """The server's next line if one comes within ``timeout`` seconds, else None."""
        assert self._server is not None and self._server.stdout is not None
        ready, _, _ = select.select([self._server.stdout], [], [], timeout)
        if not ready:
            return None
        line = self._server.stdout.readline()
        if not line:
            self.kill()
            raise AssertionError(f"the ranks' server ended (rc {self._server.wait()})")
        return json.loads(line)

    def wait(self, deadline: float) -> dict[int, int]:
        """Every rank's exit status (minus the signal for a signal), once all have ended."""
        statuses = {}
        while "done" not in (reply := self.next_reply(deadline)):
            statuses[reply["rank"]] = reply["status"]
        self._unfinished = False
        return statuses

    def run(self, argv: list[str], cwd: Path, world: int = 2) -> str:
        """A whole run of the example with ``argv`` (see :func:`example_args`), which must succeed; returns
        its ranks' output."""
        self.start(argv, cwd, world)
        statuses = self.wait(time.monotonic() + RUN_TIMEOUT)
        output = "".join((cwd / f"rank{rank}.err").read_text() for rank in range(world))
        assert statuses == dict.fromkeys(range(world), 0), f"{statuses}\n{output[-4000:]}"
        return output

    def kill(self) -> None:
        """SIGKILL the ranks of the run (those still running)."""
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self._server is not None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            try:
                self._server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
            shutil.rmtree(self._socket_dir, ignore_errors=True)


def train_dir(data_dir: Path) -> Path:
    (found,) = [p for p in data_dir.iterdir() if p.name.startswith("stdlib-")]
    return found / "train"


def data_args(data_dir: Path) -> list[str]:
    """The example's arguments that find the set prepared in ``data_dir`` (its directory and file count)."""
    (meta,) = data_dir.glob("stdlib-*/meta.json")
    files = json.loads(meta.read_text())
    return ["--data-dir", str(data_dir), "--max-files", str(files["train_files"] + files["val_files"])]


def example_args(data_dir: Path, work: Path, *args: str) -> list[str]:
    """The example's arguments for the tiny GPT, with checkpoints under ``work`` (resumed when there are
    some), a sample log and the final state, then ``args``."""
    return [
        *TINY,
        *data_args(data_dir),
        "--checkpoint-dir",
        str(work / "ckpt"),
        "--resume",
        "--sample-log",
        str(work / "samples"),
        "--final-state",
        str(work / "final.pt"),
        *args,
    ]


def torchrun(nproc: int, *script_and_args: str, restarts: int = 0) -> list[str]:
    """The ``torchrun`` command line of a standalone job of ``nproc`` workers, each ``script_and_args``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.1",
        *script_and_args,
    ]


def command(
    nproc: int, data_dir: Path, work: Path, *args: str, restarts: int = 3, script: Path = EXAMPLE
) -> list[str]:
    """torchrun of ``script`` (the example, or a test's stand-in for it) with :func:`example_args`, each of
    its workers a ``_rank_client.py`` whose rank the :class:`ForkedRanks` server forks: run it with that
    server's :meth:`ForkedRanks.torchrun_env`."""
    return torchrun(
        nproc, str(RANK_CLIENT), str(script), *example_args(data_dir, work, *args), restarts=restarts
    )


def run_env(**extra: str) -> dict[str, str]:
    """The environment of a run: this one's, less a fault switch (``KILL_AT``), plus ``extra``."""
    environ = {k: v for k, v in os.environ.items() if k != "KILL_AT"}
    environ.update(OMP_NUM_THREADS="1", FASTCOMM_TIMEOUT="60", **extra)
    return environ


def run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def last_step(log: Path) -> int:
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        head = line.split(" ", 1)[0]
        if head.isdigit():
            return int(head)
    return 0


def run_and_kill(
    command: list[str], work: Path, kill_step: int, kill_rank: int, env: dict[str, str]
) -> tuple[str, int]:
    """Start ``command``; once rank ``kill_rank`` logged step ``kill_step``, SIGKILL it (the process that
    trains, which wrote its pid beside its log); wait for the end.

    Returns torchrun's stderr and the step the killed rank had logged when the signal was sent.
    """
    work.mkdir(parents=True, exist_ok=True)
    stderr = open(work / "torchrun.err", "w+")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=work, env=env)
    log, pid_file = work / "samples" / f"rank{kill_rank}.log", work / "samples" / f"rank{kill_rank}.pid"
    deadline = time.monotonic() + RUN_TIMEOUT
    killed_at = -1
    try:
        while time.monotonic() < deadline and process.poll() is None:
            step = last_step(log)
            if step >= kill_step:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
                killed_at = step
                break
            time.sleep(0.01)  # a step takes longer: the kill still lands within one
        assert killed_at >= 0, f"rank {kill_rank} never reached step {kill_step} (rc {process.poll()})"
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr.seek(0)
    text = stderr.read()
    stderr.close()
    assert process.returncode == 0, text[-4000:]
    return text, killed_at


def final_state(work: Path) -> dict:
    return torch.load(work / "final.pt", weights_only=False)


def assert_bit_identical(a: dict, b: dict) -> None:
    """Every tensor of two final states (model and optimizer) equal bit for bit."""
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"model weight {name} differs"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for pid in sa:
        for key, value in sa[pid].items():
            other = sb[pid][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"optimizer state {pid}/{key} differs"
            else:
                assert value == other, f"optimizer state {pid}/{key} differs"


def sample_log(work: Path, world: int) -> dict[tuple[int, int], tuple[int, list[int]]]:
    """(rank, step) -> (epoch, ids) of the last attempt of each step; a replayed step must equal the first."""
    steps: dict[tuple[int, int], tuple[int, list[int]]] = {}
    for rank in range(world):
        for line in (work / "samples" / f"rank{rank}.log").read_text().splitlines():
            fields = line.split()
            if len(fields) != 2 + BATCH:  # a line cut by the SIGKILL
                continue
            step, epoch, ids = int(fields[0]), int(fields[1]), [int(x) for x in fields[2:]]
            if (rank, step) in steps:
                assert steps[(rank, step)] == (epoch, ids), f"rank {rank} replayed step {step} differently"
            steps[(rank, step)] = (epoch, ids)
    return steps


def assert_each_sample_once_per_epoch(steps: dict, world: int, num_samples: int, last_step: int) -> None:
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for (rank, step), (epoch, ids) in steps.items():
        assert rank < world and 1 <= step <= last_step
        per_epoch[epoch].extend(ids)
    assert len(steps) == world * last_step, "some step of some rank is missing from the log"
    full_epoch = world * BATCH * ((num_samples // world) // BATCH)  # drop_last drops the tail
    for epoch, ids in per_epoch.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample was seen twice"
        assert all(0 <= i < num_samples for i in ids)
    complete = [e for e in per_epoch if e < max(per_epoch)]
    assert complete, "the run must cover at least one whole epoch"
    for epoch in complete:
        assert len(per_epoch[epoch]) == full_epoch, f"epoch {epoch} has {len(per_epoch[epoch])} samples"


def method_args(method: str, steps: int) -> list[str]:
    """The example's arguments for a ``method`` run of ``steps`` steps, checkpointed every 10, the newest
    three kept (``test_fault_checkpoints.py`` damages two of the sign reference's)."""
    return [*METHODS[method], "--steps", str(steps), "--checkpoint-every", "10", "--checkpoint-keep", "3"]


def sigkill_restart(method: str, data_dir: Path, tmp_path: Path, reference, forked: ForkedRanks) -> None:
    """SIGKILL one rank of a ``method`` run at a random step; torchrun restarts it; it must end as the
    uninterrupted run did, bit for bit (and, for topk, with the same sample ids at every step)."""
    num_samples = fastio.StreamLoader(train_dir(data_dir), batch_size=BATCH).num_samples
    epoch_steps = (num_samples // 2) // BATCH
    # topk runs past one epoch so the sample log can show every sample once; the others are shorter.
    steps = epoch_steps + 12 if method == "topk" else 30
    args = method_args(method, steps)
    uninterrupted = reference(args)

    rng = random.Random(f"{method}-{os.getpid()}-{time.time_ns()}")
    kill_step, kill_rank = rng.randint(12, steps - 6), rng.randint(0, 1)
    stderr, killed_at = run_and_kill(
        command(2, data_dir, tmp_path / "killed", *args),
        tmp_path / "killed",
        kill_step,
        kill_rank,
        forked.torchrun_env(),
    )
    context = f"{method}: rank {kill_rank} killed at step {killed_at}"
    assert "resumed" in stderr and "at step" in stderr, context + "\n" + stderr[-3000:]
    assert_bit_identical(final_state(uninterrupted), final_state(tmp_path / "killed"))
    if method == "topk":
        assert_each_sample_once_per_epoch(sample_log(tmp_path / "killed", 2), 2, num_samples, steps)
        assert sample_log(tmp_path / "killed", 2) == sample_log(uninterrupted, 2), context
