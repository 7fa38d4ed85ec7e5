"""Interrupted runs of examples/train_lm.py continue as if nothing happened: a SIGKILL and a restart.

Each test runs the example as a user would, under ``torchrun`` on 2 gloo ranks of a tiny GPT (the harness is
``_fault_runs.py``), and SIGKILLs one rank at a random step (torchrun ``--max-restarts`` restarts the group,
which resumes from the last checkpoint). What must hold: the final model and optimizer state equal an
uninterrupted run's bit for bit, and a replayed step after a restart repeats the same sample ids. A restart on
another world size is in ``test_fault_elastic.py``, the survivor of a lost peer in ``test_fault_survivor.py``,
failed checkpoints in ``test_fault_checkpoints.py`` (one file each, so pytest-xdist runs them side by side).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _fault_runs as fr  # noqa: E402

data_dir, forked, reference = fr.data_dir, fr.forked, fr.reference  # the module-scoped fixtures here

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


# sign and q8 are in test_fault_checkpoints.py, beside the checkpoint tests that share their reference runs
# (q8's is the kill in the middle of a checkpoint write).
@pytest.mark.parametrize("method", ["topk", "cadam"])
def test_sigkill_of_a_rank_restarts_and_ends_bit_identical(
    method: str, data_dir: Path, tmp_path: Path, reference, forked: fr.ForkedRanks
) -> None:
    fr.sigkill_restart(method, data_dir, tmp_path, reference, forked)
