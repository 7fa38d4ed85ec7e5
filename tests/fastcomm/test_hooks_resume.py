"""Resuming from ``state_dict()`` in fresh processes is bit-identical with DDP's default bucket layout.

A fresh DDP reduces its first iteration in its initial layout (all parameters in one bucket, in forward
order) and rebuilds after it, while the checkpoint was taken under the rebuilt layout; the hooks must still
give the gradients and weights the uninterrupted run had, for every hook, on 2 gloo ranks. So must a
checkpoint taken right after that first iteration, resumed in another fresh DDP.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _hooks_workers as workers  # noqa: E402
import _resume_workers  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Checkpoints and the recorded later steps of an uninterrupted run of every case."""
    workdir = tmp_path_factory.mktemp("resume")
    workers.spawn(workdir / "train", 2, _resume_workers.train_and_checkpoint_worker, str(workdir))
    return workdir


def test_resume_from_state_dict_is_bit_identical_with_default_buckets(trained):
    workers.spawn(trained / "resume", 2, _resume_workers.resume_and_compare_worker, str(trained), False)


def test_resume_from_a_checkpoint_taken_one_step_after_a_resume_is_bit_identical(trained):
    workers.spawn(trained / "resume_again", 2, _resume_workers.resume_and_compare_worker, str(trained), True)
