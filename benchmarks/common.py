"""Process helpers shared by the benchmarks and the tests that start rank processes.

One place for what every multi-process benchmark needs: a free loopback port, the environment of one
rank, starting the ranks (each in its own process group, its output in a log) and waiting for them with a
timeout, the line of a log that says what went wrong, and a median. Result rows, tables and plots are
:mod:`benchmarks.harness`'s job; links and namespaces are :mod:`benchmarks.netlab`'s.

Example::

    from benchmarks.common import free_port, launch, rank_env, tail

    port = free_port()
    logs = [work / f"rank{rank}.log" for rank in range(2)]
    ranks = launch(
        [[sys.executable, "train.py"]] * 2,
        [rank_env(rank, 2, port) for rank in range(2)],
        logs,
        timeout_s=120,
    )
    if not ranks.ok:
        raise RuntimeError(ranks.describe())
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import math
import os
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from benchmarks.harness import kill_process_groups

__all__ = ["REPO_ROOT", "Ranks", "cache_folder_bytes", "free_port", "launch", "median", "rank_env", "tail"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on now (the OS picks it; free again once returned).

    Example::

        env = rank_env(0, 2, free_port())
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (the mean of the two middle ones for an even count); NaN when empty.

    Example::

        median([3.0, 1.0, 2.0, 10.0])  # 2.5
    """
    ordered = sorted(values)
    if not ordered:
        return math.nan
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def tail(path: Path, lines: int = 3) -> str:
    """The last ``lines`` non-empty lines of a log that name an error (else its last lines), joined by
    ``" | "`` and cut to 400 characters: what a failed rank said, short enough for a table's note.

    Example::

        tail(work / "rank1.log")  # "RuntimeError: Connection reset by peer"
    """
    text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in text if "Error" in line or "error" in line]
    return " | ".join((errors or text)[-lines:])[-400:] or "(no output)"


def rank_env(
    rank: int, world_size: int, port: int, master_addr: str = "127.0.0.1", **extra: str
) -> dict[str, str]:
    """The environment of rank ``rank`` of ``world_size`` local ranks: this one's, plus torch.distributed's
    variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` 0, ``MASTER_ADDR``, ``MASTER_PORT``), one intra-op
    thread, the repository on ``PYTHONPATH`` (so ``benchmarks`` and the examples import), and ``extra``
    over all of these.

    Example::

        rank_env(1, 2, 29500, GLOO_SOCKET_IFNAME="lo")
    """
    pythonpath = os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    env = dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE=str(world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=pythonpath,
    )
    env.update(extra)
    return env


@dataclasses.dataclass(frozen=True)
class Ranks:
    """What became of the rank processes :func:`launch` started.

    ``returncodes``: each rank's exit code (negative once killed); ``failed``: the ranks that exited
    with a non-zero code on their own, in the order they were seen to (the first one usually holds the
    cause; its peers only see the connection drop); ``killed``: the ranks still running when the wait
    ended (timeout, a failed peer, or ``stop``), then killed; ``seconds``: how long the wait took.
    """

    returncodes: tuple[int | None, ...]
    failed: tuple[int, ...]
    killed: tuple[int, ...]
    seconds: float
    logs: tuple[Path, ...]

    @property
    def ok(self) -> bool:
        """Every rank exited with code 0 on its own."""
        return not self.failed and not self.killed

    def describe(self) -> str:
        """One line for a table's note: ``"ok"``, the first failed rank and its log's :func:`tail`, or
        which ranks were killed after how long."""
        if self.failed:
            rank = self.failed[0]
            return f"crashed (rank {rank} exit {self.returncodes[rank]}): {tail(self.logs[rank])}"
        if self.killed:
            return f"timed out after {self.seconds:.0f} s (rank(s) {list(self.killed)} killed)"
        return "ok"


def launch(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    logs: Sequence[Path],
    timeout_s: float,
    *,
    fail_grace_s: float = 15.0,
    poll_s: float = 0.5,
    stop: Callable[[Sequence[subprocess.Popen[bytes]]], bool] | None = None,
    cwd: Path = REPO_ROOT,
) -> Ranks:
    """Run one command per rank and wait for all of them, at most ``timeout_s``.

    1. Start ``commands[r]`` with ``envs[r]`` (see :func:`rank_env`), stdout and stderr into ``logs[r]``,
       each in a new session so that the rank and its children are one process group.
    2. Every ``poll_s``: stop waiting when all have exited, when ``timeout_s`` has passed, when a rank
       failed ``fail_grace_s`` ago (its peers are then blocked in a collective; the grace lets them
       report), or when ``stop(procs)`` returns True (a caller's hang or progress check).
    3. Kill the process group of every rank still running, reap all of them.

    Returns:
        :class:`Ranks`: exit codes, failed and killed ranks, seconds waited.

    Example::

        ranks = launch([[sys.executable, "-c", "pass"]], [rank_env(0, 1, free_port())], [log], 30)
        assert ranks.ok, ranks.describe()
    """
    if not len(commands) == len(envs) == len(logs):
        raise ValueError(
            f"launch: {len(commands)} commands, {len(envs)} environments and {len(logs)} logs; "
            "give one of each per rank"
        )
    procs: list[subprocess.Popen[bytes]] = []
    failed: list[int] = []
    start = time.monotonic()
    try:
        for command, env, path in zip(commands, envs, logs, strict=True):
            with Path(path).open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        list(command),
                        cwd=cwd,
                        env=dict(env),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        failed_at: float | None = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            failed += [r for r, p in enumerate(procs) if p.returncode not in (None, 0) and r not in failed]
            if failed and failed_at is None:
                failed_at = now
            if now - start > timeout_s or (failed_at is not None and now - failed_at > fail_grace_s):
                break
            if stop is not None and stop(procs):
                break
            time.sleep(poll_s)
        killed = [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        kill_process_groups(procs)
    failed += [r for r, p in enumerate(procs) if p.returncode != 0 and r not in failed and r not in killed]
    return Ranks(
        tuple(p.returncode for p in procs),
        tuple(failed),
        tuple(killed),
        time.monotonic() - start,
        tuple(logs),
    )


def cache_folder_bytes(directory: Path) -> int:
    """Every byte a fastio node cache folder holds, by its own walk (not the cache's accounting), under the
    cache's lock (``.fastio-cache.lock``, which every admission, eviction and rename takes): a walk without it
    could count an evicted entry and the one admitted after it, which never were there together.

    Example::

        peak = max(peak, cache_folder_bytes(cache_dir))
    """
    total = 0
    with open(directory / ".fastio-cache.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for root, _, files in os.walk(directory):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(root, name)).st_size
    return total
