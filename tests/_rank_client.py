"""torchrun's worker in the fault tests: the warm rank server forks the real rank; this one ends as it does.

    FASTLIB_EXAMPLE_RANKS=/tmp/.../ranks torchrun ... tests/_rank_client.py examples/train_lm.py ARGS...

``torchrun`` launches this script as each of its workers, watches it, restarts it when it fails and stops it
with SIGTERM, as it would the example. The rank itself (the script's ``main(ARGS)``) is forked by
``_example_ranks.py`` from a process that imported torch and the example once: a worker that imports them
costs 4 s of CPU at every start and restart, this one a few milliseconds (it imports no torch). The rank runs
with this process's environment (torchrun's: ``RANK``, the agent's store, ``TORCHELASTIC_RESTART_COUNT``),
working directory, stdin, stdout and stderr; a signal torchrun sends here goes on to the rank, and the rank's
end (an exit code, or the signal that killed it) is this process's end. If this process dies first, the
server SIGKILLs the rank.

Example::

    torchrun --nproc-per-node 2 tests/_rank_client.py examples/train_lm.py --steps 30  # server at $ADDRESS
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import NoReturn

__all__ = ["ADDRESS", "main"]

ADDRESS = "FASTLIB_EXAMPLE_RANKS"  # the environment variable naming the server's Unix socket
_PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what torchrun may stop its workers with


def _end_as(status: int) -> NoReturn:
    """Exit with ``status``, or die of the signal ``-status``, as the rank did."""
    sys.stdout.flush()
    sys.stderr.flush()
    if status < 0:
        if -status in _PASSED_ON:
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        status = 128 - status  # a signal that does not end a process (none the ranks die of)
    os._exit(status)


def main() -> NoReturn:
    """Have the server fork the rank of ``sys.argv[1]`` with arguments ``sys.argv[2:]``; end as it ends."""
    script, *argv = sys.argv[1:]
    rank = {"pid": 0, "pending": []}

    def pass_on(signum: int, _frame: object) -> None:
        if rank["pid"]:
            os.kill(rank["pid"], signum)
        else:
            rank["pending"].append(signum)

    for signum in _PASSED_ON:
        signal.signal(signum, pass_on)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(os.environ[ADDRESS])
    request = {"script": script, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(server, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    replies = server.makefile("rb")
    started = replies.readline()
    if not started:
        sys.exit(f"{__file__}: the rank server closed the connection before the rank started")
    rank["pid"] = json.loads(started)["pid"]
    for signum in rank["pending"]:
        os.kill(rank["pid"], signum)
    ended = replies.readline()
    if not ended:
        sys.exit(f"{__file__}: the rank server ended before rank {os.environ.get('RANK')} did")
    _end_as(json.loads(ended)["status"])


if __name__ == "__main__":
    main()
