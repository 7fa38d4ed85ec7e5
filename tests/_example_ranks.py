"""A server that forks ranks of examples/train_lm.py from one process that imported it once.

    python tests/_example_ranks.py [LISTEN_FD]   # then one JSON request a line on stdin

A ``torchrun`` job costs a launcher (2 s of CPU) and, in every rank, the imports of torch, ``torch._dynamo``
(DDP's constructor loads it) and the example (4 s), where 30 training steps cost 1 s. The fault-tolerance
tests (harness: ``_fault_runs.py``) need many runs, and every one of their ranks is forked from here, each
calling its script's ``main(argv)`` as the script would, in the environment torchrun gives its workers, and
leaving through a normal interpreter exit, as a script does. What every rank would compute alike all session
(the stdlib listing that names the example's data set) is computed here once. Two ways in:

- A whole run, a JSON line on stdin: ``{"argv": [...], "world": 2, "cwd": "...", "logs": "...", "env":
  {...}}`` (and ``"script"``, the example by default). Its ranks get torchrun's worker environment (``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, attempt 0, the rendezvous store held outside the
  ranks: ``TORCHELASTIC_USE_AGENT_STORE``), the store held by a forked holder process; nothing restarts them.
  Replies on stdout, a line each: ``{"pids": [...]}`` once the ranks run; ``{"rank": r, "status": s, "time":
  t}`` as each one ends (``s`` the exit code, or minus the signal; ``t`` its ``time.monotonic()``); ``{"done":
  true}`` when all have. Each rank's stdout and stderr go to ``logs/rank<r>.err``.
- One rank of a real ``torchrun`` job, a connection to the Unix socket listening on the inherited LISTEN_FD,
  from ``_rank_client.py`` (torchrun's worker, which imports no torch): ``{"script": ..., "argv": [...],
  "cwd": ..., "env": {...}}`` with the client's stdin, stdout and stderr passed along (SCM_RIGHTS). The rank
  gets the client's environment (torchrun's, with its store and its restart count) and output; the replies
  are ``{"pid": p}``, then ``{"status": s}`` when it ends. If the client's connection closes first (torchrun
  stopped it), the rank is SIGKILLed.

Example::

    server = subprocess.Popen([sys.executable, "tests/_example_ranks.py"], stdin=PIPE, stdout=PIPE)
    server.stdin.write(json.dumps({"argv": ["--steps", "30"], "world": 2, "cwd": ".", "logs": "."}) + "\\n")
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
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
# listed once here, in the subsets the tests use (21 and 40 files), and remembered (the files' sizes are still
# read).
lm_data.stdlib_sources = functools.cache(lm_data.stdlib_sources)
lm_data.stdlib_sources(21)
lm_data.stdlib_sources(40)

__all__ = ["serve"]

_MAINS: dict[str, Callable[[list[str]], int]] = {str(Path(train_lm.__file__).resolve()): train_lm.main}


def _main_of(script: str) -> Callable[[list[str]], int]:
    """``main(argv)`` of ``script``: the example's, or a test's stand-in for it, imported here once."""
    path = str(Path(script).resolve())
    if path not in _MAINS:
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import {script}: give the path of a Python file with a main(argv)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _MAINS[path] = module.main
    return _MAINS[path]


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message) + "\n").encode()


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.buffer.write(_line(message))
    sys.stdout.flush()


def _detach(log: str | None) -> None:
    """In a child: stdin from /dev/null, stdout and stderr to ``log`` (or /dev/null), off the server pipes."""
    null = os.open(os.devnull, os.O_RDWR)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if log else null
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)


def _worker_environment(request: dict[str, Any], rank: int, port: int) -> dict[str, str]:
    """torchrun's worker environment for rank ``rank`` of a stdin request, its store on ``port``."""
    world = str(request["world"])
    return {
        **os.environ,
        **request.get("env", {}),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": world,
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


class _Server:
    """The event loop: requests on stdin, clients on the listening socket, and the ends of forked children
    (each watched through its pidfd: no SIGCHLD handler for the ranks to inherit). No thread: every child
    is a fork of this one thread.

    The ranks fork inside the callbacks of :meth:`serve` and leave through ``SystemExit`` back up its
    frames, so nothing on that way up may clean up after the server (no ``finally``, no ``with``).
    """

    def __init__(self, listener: socket.socket | None) -> None:
        self.pid = os.getpid()
        self.selector = selectors.DefaultSelector()
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, self._on_stdin)
        self.listener = listener
        if listener is not None:
            self.selector.register(listener, selectors.EVENT_READ, self._on_connect)
        self.pending = b""  # a request line not yet whole
        self.run: dict[int, int] = {}  # pid -> rank of the stdin run in progress
        self.holder = 0  # the pid of the stdin run's store holder
        self.clients: dict[int, socket.socket] = {}  # pid -> the connection of a torchrun worker's rank
        self.children: set[int] = set()
        self.open = True

    def serve(self) -> int:
        """Answer until stdin closes; then SIGKILL what still runs (nothing, in a finished test)."""
        while self.open:
            for key, _ in self.selector.select():
                key.data(key.fileobj)
        for pid in self.children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        return 0

    def _forget(self) -> None:
        """In a forked child: close the server's descriptors (the rank is not a server)."""
        for key in list(self.selector.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
            elif key.fileobj != sys.stdin.fileno():
                os.close(key.fileobj)
        self.selector.close()

    def _fork(self) -> int:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            self._forget()
            return 0
        self.children.add(pid)
        self.selector.register(os.pidfd_open(pid), selectors.EVENT_READ, functools.partial(self._on_end, pid))
        return pid

    def _be_rank(self, script: str, argv: list[str], cwd: str, environ: dict[str, str]) -> NoReturn:
        """In a forked child: be the rank of ``script``, then leave as a script does."""
        main = _main_of(script)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        sys.argv = [script, *argv]
        raise SystemExit(main(argv))

    def _on_stdin(self, fd: int) -> None:
        data = os.read(fd, 1 << 16)
        if not data:
            self.open = False
            return
        self.pending += data
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            self._start_run(json.loads(line))

    def _start_run(self, request: dict[str, Any]) -> None:
        if self.run:
            raise RuntimeError("a run was requested before the last one was done")
        script = request.get("script", train_lm.__file__)
        _main_of(script)  # imported here, not in each rank
        self.holder, port = self._hold_store()
        for rank in range(int(request["world"])):
            if (pid := self._fork()) == 0:
                _detach(os.path.join(request["logs"], f"rank{rank}.err"))
                self._be_rank(
                    script, request["argv"], request["cwd"], _worker_environment(request, rank, port)
                )
            self.run[pid] = rank
        _reply({"pids": list(self.run)})

    def _hold_store(self) -> tuple[int, int]:
        """Fork a process holding a TCP store on a free port, as torchrun's agent does: its pid and port.

        A process of its own: a store's thread in this server would be forked into every rank. It ends when
        killed, or when this server is gone.
        """
        read, write = os.pipe()
        if (pid := self._fork()) == 0:
            _detach(None)
            os.close(read)
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            os.write(write, str(store.port).encode())
            os.close(write)
            while os.getppid() == self.pid:
                time.sleep(0.5)
            os._exit(0)
        os.close(write)
        port = int(os.read(read, 64) or b"0")
        os.close(read)
        if not port:
            raise RuntimeError("the store holder died before it listened")
        return pid, port

    def _on_connect(self, listener: socket.socket) -> None:
        connection, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        while not message.endswith(b"\n"):
            more = connection.recv(1 << 20)
            if not more:  # the client is gone
                for fd in fds:
                    os.close(fd)
                connection.close()
                return
            message += more
        request = json.loads(message)
        _main_of(request["script"])
        if (pid := self._fork()) == 0:
            connection.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                os.close(fd)
            self._be_rank(request["script"], request["argv"], request["cwd"], request["env"])
        for fd in fds:
            os.close(fd)
        self.clients[pid] = connection
        self.selector.register(connection, selectors.EVENT_READ, functools.partial(self._on_client, pid))
        self._tell(pid, {"pid": pid})

    def _tell(self, pid: int, message: dict[str, Any]) -> None:
        """Send ``message`` to the client of rank ``pid``; a client that is gone has its rank SIGKILLed."""
        try:
            self.clients[pid].sendall(_line(message))
        except OSError:
            self._on_client(pid, self.clients[pid])

    def _on_client(self, pid: int, connection: socket.socket) -> None:
        """The client sends nothing after its request: readable means gone. Its rank goes too."""
        self.selector.unregister(connection)
        connection.close()
        del self.clients[pid]
        if pid in self.children:
            os.kill(pid, signal.SIGKILL)

    def _on_end(self, pid: int, pidfd: int) -> None:
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self.children.discard(pid)
        status = os.waitstatus_to_exitcode(status)
        if pid == self.holder:  # died early: the ranks fail to rendezvous, and say so
            self.holder = 0
        elif pid in self.clients:
            self._tell(pid, {"status": status})
            if pid in self.clients:
                self._on_client(pid, self.clients[pid])
        elif pid in self.run:
            _reply({"rank": self.run.pop(pid), "status": status, "time": time.monotonic()})
            if not self.run:
                if self.holder:
                    os.kill(self.holder, signal.SIGKILL)
                self.holder = 0
                _reply({"done": True})


def serve(listen_fd: int | None = None) -> int:
    """Answer requests from stdin, and ranks' clients on the socket listening on ``listen_fd``, until stdin
    closes."""
    gc.freeze()  # the ranks' exits would otherwise collect, and so copy on write, this heap of torch
    listener = None if listen_fd is None else socket.socket(fileno=listen_fd)
    status = _Server(listener).serve()
    gc.unfreeze()  # this process was not forked: its own exit collects its heap as usual
    return status


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]) if len(sys.argv) > 1 else None))
