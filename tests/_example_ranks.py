"""A server that forks ranks of examples/train_lm.py from one process that imported it once.

    python tests/_example_ranks.py        # then one JSON request a line on stdin

A ``torchrun`` job costs a launcher (2 s of CPU) and, in every rank, the imports of torch, ``torch._dynamo``
(DDP's constructor loads it) and the example (4 s), where 30 training steps cost 1 s. The fault-tolerance
tests (harness: ``_fault_runs.py``) need many runs that are not what they test: the uninterrupted
references and the first legs of the runs they interrupt, and the two hand-started ranks of the survivor
tests. Those ranks are forked from here, each calling the example's ``main`` as a script would, in the
environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
attempt 0, the rendezvous store held outside the ranks: ``TORCHELASTIC_USE_AGENT_STORE``), the store held by
a forked holder process. A rank leaves through a normal interpreter exit, as a script does. What every
rank would compute alike all session (the stdlib listing that names the example's data set) is computed
here once.

Request: ``{"argv": [...], "world": 2, "cwd": "...", "logs": "...", "env": {...}}``. Replies, a line each:
``{"pids": [...]}`` once the ranks run; ``{"rank": r, "status": s, "time": t}`` as each one ends (``s`` the
exit code, or minus the signal; ``t`` its ``time.monotonic()``); ``{"done": true}`` when all have. Each rank's
stdout and stderr go to ``logs/rank<r>.err``.

Example::

    server = subprocess.Popen([sys.executable, "tests/_example_ranks.py"], stdin=PIPE, stdout=PIPE)
    server.stdin.write(json.dumps({"argv": ["--steps", "30"], "world": 2, "cwd": ".", "logs": "."}) + "\\n")
"""

from __future__ import annotations

import functools
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

# Run as a script, this folder comes first on sys.path, and its fastcomm/ (the tests) would shadow the
# package; the example's folder is where train_lm and its modules are.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent / "examples"), *(p for p in sys.path if Path(p or ".").resolve() != _HERE)]

import lm_data  # noqa: E402
import torch  # noqa: E402, F401
import torch._dynamo  # noqa: E402, F401 - DDP's constructor imports it: once here, not in every rank
import torch.distributed as dist  # noqa: E402
import train_lm  # noqa: E402

# Every rank's prepare_data lists the stdlib to name the data set (0.5 s of CPU, the same list all session):
# listed once here, in the 40-file subset the tests use, and remembered (the files' sizes are still read).
lm_data.stdlib_sources = functools.cache(lm_data.stdlib_sources)
lm_data.stdlib_sources(40)

__all__ = ["serve"]


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _detach(log: str | None) -> None:
    """In a child: stdin from /dev/null, stdout and stderr to ``log`` (or /dev/null), off the server pipes."""
    null = os.open(os.devnull, os.O_RDWR)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if log else null
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)


def _hold_store(server: int) -> tuple[int, int]:
    """Fork a process holding a TCP store on a free port, as torchrun's agent does; return its pid and port.

    A process of its own: a store's thread in this server would be forked into every rank. It ends when
    killed, or when this server is gone.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        _detach(None)
        os.close(read)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        os.write(write, str(store.port).encode())
        os.close(write)
        while os.getppid() == server:
            time.sleep(0.5)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        port = int(pipe.read() or b"0")
    if not port:
        raise RuntimeError("the store holder died before it listened")
    return pid, port


def _rank(request: dict[str, Any], rank: int, port: int) -> NoReturn:
    """In a forked child: be rank ``rank`` of the example, then leave as a script does."""
    _detach(os.path.join(request["logs"], f"rank{rank}.err"))
    os.chdir(request["cwd"])
    world = int(request["world"])
    os.environ.update(request.get("env", {}))
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    sys.argv = [train_lm.__file__, *request["argv"]]
    raise SystemExit(train_lm.main(request["argv"]))


def serve() -> int:
    """Answer requests from stdin until it closes."""
    gc.freeze()  # the ranks' exits would otherwise collect, and so copy on write, this heap of torch
    server = os.getpid()
    for line in sys.stdin:
        request = json.loads(line)
        holder, port = _hold_store(server)
        pids = []
        for rank in range(int(request["world"])):
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _rank(request, rank, port)
            pids.append(pid)
        _reply({"pids": pids})
        running = set(pids)
        while running:
            pid, status = os.wait()
            if pid == holder:  # died early: the ranks fail to rendezvous, and say so
                holder = 0
                continue
            running.discard(pid)
            status = os.waitstatus_to_exitcode(status)
            _reply({"rank": pids.index(pid), "status": status, "time": time.monotonic()})
        if holder:
            os.kill(holder, signal.SIGKILL)
            os.waitpid(holder, 0)
        _reply({"done": True})
    return 0


if __name__ == "__main__":
    sys.exit(serve())
