"""A run of examples/train_lm.py restarted on another world size (2, then 3, then 2 ranks) resumes from the
checkpoint the last leg ended on, and the sample ids each rank logged cover every sample of epoch 0 exactly
once (but for the tail ``drop_last`` leaves). The harness is ``_fault_runs.py``; each leg's ranks are forked
in torchrun's worker environment (:class:`_fault_runs.ForkedRanks`): what is tested is the checkpoint
re-sharded on resume, not the launch, and a torchrun job costs ten times a leg's steps.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest

import fastio

sys.path.insert(0, str(Path(__file__).parent))
import _fault_runs as fr  # noqa: E402

data_dir, forked = fr.data_dir, fr.forked  # the module-scoped fixtures of these tests

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_restart_on_three_ranks_then_two_sees_every_remaining_sample_once(
    data_dir: Path, tmp_path: Path, forked: fr.ForkedRanks
) -> None:
    # 2 ranks to step 20, 3 ranks until past the end of epoch 0, 2 ranks again: the restarts at another
    # world size resume from the checkpoint the last leg ended on (each leg stops on a checkpoint step).
    num_samples = fastio.StreamLoader(fr.train_dir(data_dir), batch_size=fr.BATCH).num_samples
    first = 20
    rest = num_samples - 2 * fr.BATCH * first
    epoch_end = first + (rest // 3) // fr.BATCH  # the last step of epoch 0 in the 3-rank leg
    second = (epoch_end // 10 + 1) * 10
    args = [*fr.METHODS["topk"], "--steps", "400", "--checkpoint-every", "10"]
    work = tmp_path / "elastic"
    forked.run(fr.example_args(data_dir, work, *args, "--stop-after", str(first)), work)
    three = forked.run(fr.example_args(data_dir, work, *args, "--stop-after", str(second)), work, world=3)
    assert "saved by 2 ranks, now 3" in three, three[-3000:]
    assert "hook:" in three and "optimizer:" in three and "loader:" in three
    two = forked.run(fr.example_args(data_dir, work, *args, "--stop-after", str(second + 10)), work)
    assert "saved by 3 ranks, now 2" in two, two[-3000:]

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
