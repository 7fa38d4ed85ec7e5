"""Resuming from ``state_dict()`` in fresh processes is bit-identical with DDP's default bucket layout.

A fresh DDP reduces its first iteration in its initial layout (all parameters in one bucket, in forward
order) and rebuilds after it, while the checkpoint was taken under the rebuilt layout; the hooks must still
give the gradients and weights the uninterrupted run had, for every hook, on 2 gloo ranks.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _hooks_workers as workers  # noqa: E402
import _resume_workers  # noqa: E402


def test_resume_from_state_dict_is_bit_identical_with_default_buckets(tmp_path):
    workers.spawn(tmp_path / "train", 2, _resume_workers.train_and_checkpoint_worker, str(tmp_path))
    workers.spawn(tmp_path / "resume", 2, _resume_workers.resume_and_compare_worker, str(tmp_path))
