"""Hook results against the test's own simulation of every rank from the reference ops (W = 2 and 4).

Top-k and sign (and quantization with nearest rounding) must match exactly; stochastic quantization must
stay within one quantization step per phase. Error feedback over many steps must lose nothing.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _hooks_workers as workers  # noqa: E402


@pytest.mark.parametrize("world_size", [2, 4])
def test_hooks_match_reference_simulation(tmp_path, world_size):
    workers.spawn(tmp_path, world_size, workers.correctness_worker)


def test_error_feedback_invariant_and_bad_input(tmp_path):
    workers.spawn(tmp_path, 2, workers.error_feedback_and_validation_worker)
