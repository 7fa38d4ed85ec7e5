"""Interrupted runs of examples/train_lm.py continue as if nothing happened.

Each test runs the example as a user would, under ``torchrun`` on 2 (or 3) gloo ranks of a tiny GPT (the
harness is ``_fault_runs.py``), and interrupts it for real: a SIGKILL of one rank at a random step (torchrun
``--max-restarts`` restarts the group, which resumes from the last checkpoint), a restart on another world
size, a peer killed or stopped under a survivor without torchrun. What must hold: the final model and
optimizer state equal an uninterrupted run's bit for bit; the sample ids each rank logged cover every sample
of an epoch exactly once (a replayed step after a restart must repeat the same ids); the survivor of a lost
peer exits with a clear error within the timeout. Failed checkpoints are in ``test_fault_checkpoints.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

import fastio
from benchmarks.common import free_port

sys.path.insert(0, str(Path(__file__).parent))
import _fault_runs as fr  # noqa: E402

data_dir, reference = fr.data_dir, fr.reference  # the module-scoped fixtures of these tests

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


# sign and q8 are in test_fault_checkpoints.py, beside the checkpoint tests that share their reference runs
# (q8's is the kill in the middle of a checkpoint write).
@pytest.mark.parametrize("method", ["topk", "cadam"])
def test_sigkill_of_a_rank_restarts_and_ends_bit_identical(
    method: str, data_dir: Path, tmp_path: Path, reference
) -> None:
    fr.sigkill_restart(method, data_dir, tmp_path, reference)


def test_restart_on_three_ranks_then_two_sees_every_remaining_sample_once(
    data_dir: Path, tmp_path: Path
) -> None:
    # 2 ranks to step 20, 3 ranks until past the end of epoch 0, 2 ranks again: torchrun restarts at another
    # world size resume from the checkpoint the last leg ended on (each leg stops on a checkpoint step).
    num_samples = fastio.StreamLoader(fr.train_dir(data_dir), batch_size=fr.BATCH).num_samples
    first = 20
    rest = num_samples - 2 * fr.BATCH * first
    epoch_end = first + (rest // 3) // fr.BATCH  # the last step of epoch 0 in the 3-rank leg
    second = (epoch_end // 10 + 1) * 10
    args = [*fr.METHODS["topk"], "--steps", "400", "--checkpoint-every", "10"]
    work = tmp_path / "elastic"
    fr.run(fr.command(2, data_dir, work, *args, "--stop-after", str(first)), work)
    three = fr.run(fr.command(3, data_dir, work, *args, "--stop-after", str(second)), work)
    assert "saved by 2 ranks, now 3" in three.stderr, three.stderr[-3000:]
    assert "hook:" in three.stderr and "optimizer:" in three.stderr and "loader:" in three.stderr
    two = fr.run(fr.command(2, data_dir, work, *args, "--stop-after", str(second + 10)), work)
    assert "saved by 3 ranks, now 2" in two.stderr, two.stderr[-3000:]

    by_epoch: dict[int, list[int]] = defaultdict(list)
    by_step: dict[int, int] = defaultdict(int)
    for rank in range(3):
        for line in (work / "samples" / f"rank{rank}.log").read_text().splitlines():
            fields = [int(x) for x in line.split()]
            by_epoch[fields[1]].extend(fields[2:])
            by_step[fields[0]] += 1
    assert all(by_step[s] == (3 if first < s <= second else 2) for s in range(1, second + 11))
    epoch0 = by_epoch[0]
    assert len(epoch0) == len(set(epoch0)), "a sample of epoch 0 was seen twice across the world sizes"
    # Every sample once, but for the tail drop_last leaves: less than a batch per rank of the 3-rank leg.
    assert len(epoch0) == 2 * fr.BATCH * first + 3 * fr.BATCH * ((rest // 3) // fr.BATCH)
    assert num_samples - len(epoch0) < 3 * fr.BATCH
    epoch1 = by_epoch[1]
    assert epoch1 and len(epoch1) == len(set(epoch1))


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
