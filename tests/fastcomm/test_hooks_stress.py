"""Collective order: 4 gloo ranks, 20+ buckets of mixed sizes, 20 steps, every hook, rank-skewed timing.

A hook that let two collectives reach gloo in different orders on different ranks fails here with a size
mismatch or a timeout (bounded by the harness), and any silent mix-up shows as ranks whose parameters differ.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _hooks_training_workers as workers  # noqa: E402
import _hooks_workers as harness  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_collective_order_four_ranks(tmp_path):
    harness.spawn(tmp_path, 4, workers.stress_worker, 20, timeout_s=170)
