"""The survivor of a lost peer exits on its own: two ranks of examples/train_lm.py with no torchrun to
restart them; after the peer is SIGKILLed or SIGSTOPped, rank 0 exits with ``PeerLostError`` and the
documented exit status within the collective timeout (plus slack). The harness is ``_fault_runs.py``; the
ranks are forked by its :class:`_fault_runs.ForkedRanks` (a script's ranks, without a start-up each).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

import fastcomm.fault

sys.path.insert(0, str(Path(__file__).parent))
import _fault_runs as fr  # noqa: E402

data_dir, forked = fr.data_dir, fr.forked  # the module-scoped fixtures of these tests

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize(("how", "method"), [("SIGKILL", "topk"), ("SIGKILL", "none"), ("SIGSTOP", "sign")])
def test_the_survivor_of_a_lost_peer_exits_with_a_clear_error_in_time(
    how: str, method: str, data_dir: Path, tmp_path: Path, forked: fr.ForkedRanks
) -> None:
    # After the peer is killed (or stopped), rank 0 must exit on its own with PeerLostError and the
    # documented exit status, within the collective timeout (plus slack). A killed peer is seen at once (its
    # sockets close), well within a timeout long enough for a loaded machine's slow start (rank 1 waits in a
    # barrier while rank 0 lists the data); a stopped one only after the timeout, which is shorter.
    timeout = 10.0 if how == "SIGSTOP" else 30.0
    argv = [
        *fr.TINY,
        *fr.data_args(data_dir),
        "--hook",
        method,
        "--steps",
        "100000",
        "--timeout",
        str(timeout),
        "--sample-log",
        str(tmp_path / "samples"),
    ]
    peer = forked.start(argv, tmp_path)[1]
    try:
        deadline = time.monotonic() + fr.RUN_TIMEOUT
        while fr.last_step(tmp_path / "samples" / "rank1.log") < 5:
            ended = forked.poll(0.01)
            assert ended is None, f"a rank ended before step 5: {ended}"
            assert time.monotonic() < deadline, "rank 1 never reached step 5"
        os.kill(peer, getattr(signal, how))
        sent = time.monotonic()
        survivor = forked.next_reply(sent + timeout + 60)
        while survivor["rank"] != 0:  # the killed peer's end
            survivor = forked.next_reply(sent + timeout + 60)
    finally:
        forked.kill()
        forked.wait(time.monotonic() + 60)
    stderr = (tmp_path / "rank0.err").read_text()
    assert survivor["rank"] == 0 and survivor["status"] == fastcomm.fault.PEER_LOST_EXIT_CODE, stderr[-3000:]
    assert "PeerLostError: rank 0: a peer rank is gone" in stderr
    assert f"{timeout:g} s collective timeout" in stderr
    waited = survivor["time"] - sent
    assert waited < (timeout + 20 if how == "SIGSTOP" else 20), waited
    if how == "SIGSTOP":
        assert waited >= timeout * 0.9, waited
