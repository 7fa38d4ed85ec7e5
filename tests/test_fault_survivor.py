"""The survivor of a lost peer exits on its own: two ranks of examples/train_lm.py started by hand (no
torchrun); after the peer is SIGKILLed or SIGSTOPped, rank 0 exits with ``PeerLostError`` and the documented
exit status within the collective timeout (plus slack). The harness is ``_fault_runs.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.common import free_port

sys.path.insert(0, str(Path(__file__).parent))
import _fault_runs as fr  # noqa: E402

data_dir = fr.data_dir  # the module-scoped fixture of these tests

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize(("how", "method"), [("SIGKILL", "topk"), ("SIGKILL", "none"), ("SIGSTOP", "sign")])
def test_the_survivor_of_a_lost_peer_exits_with_a_clear_error_in_time(
    how: str, method: str, data_dir: Path, tmp_path: Path
) -> None:
    # Without torchrun: two ranks by hand. After the peer is killed (or stopped), rank 0 must exit on its own
    # with PeerLostError and the documented exit status, within the collective timeout (plus slack).
    timeout = 5.0
    port = free_port()
    processes = []
    for rank in range(2):
        env = fr.run_env(
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        command = [
            sys.executable,
            str(fr.EXAMPLE),
            *fr.TINY,
            "--data-dir",
            str(data_dir),
            "--hook",
            method,
            "--steps",
            "100000",
            "--timeout",
            str(timeout),
            "--sample-log",
            str(tmp_path / "samples"),
        ]
        processes.append(
            subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path
            )
        )
    try:
        deadline = time.monotonic() + fr.RUN_TIMEOUT
        while fr.last_step(tmp_path / "samples" / "rank1.log") < 5:
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes)
            time.sleep(0.01)
        os.kill(processes[1].pid, getattr(signal, how))
        sent = time.monotonic()
        _, stderr = processes[0].communicate(timeout=timeout + 60)
        waited = time.monotonic() - sent
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.communicate()
    import fastcomm.fault  # noqa: PLC0415

    assert processes[0].returncode == fastcomm.fault.PEER_LOST_EXIT_CODE, stderr[-3000:]
    assert "PeerLostError: rank 0: a peer rank is gone" in stderr
    assert f"{timeout:g} s collective timeout" in stderr
    # A killed peer is seen at once (its sockets close); a stopped one after the timeout.
    assert waited < (timeout + 20 if how == "SIGSTOP" else 20), waited
    if how == "SIGSTOP":
        assert waited >= timeout * 0.9, waited
