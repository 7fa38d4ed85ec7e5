"""Hook results against the test's own simulation of every rank from the reference ops (W = 2 and 4).

Top-k and sign (and quantization with nearest rounding) must match exactly; stochastic quantization must
stay within one quantization step per phase. Error feedback over many steps must lose nothing.
"""

import sys
from pathlib import Path

import pytest

import fastcomm

sys.path.insert(0, str(Path(__file__).parent))
import _hooks_correctness_workers as workers  # noqa: E402
import _hooks_workers as harness  # noqa: E402


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_hooks_match_reference_simulation(tmp_path, world_size):
    harness.spawn(tmp_path, world_size, workers.correctness_worker)


@pytest.mark.distributed
def test_error_feedback_invariant_and_bad_input(tmp_path):
    harness.spawn(tmp_path, 2, workers.error_feedback_and_validation_worker)


def test_warmup_schedule_and_fixed_size_payload():
    import torch

    from fastcomm.compress.topk import fit_to_k as _fit

    state = fastcomm.TopKState(ratio=0.01, warmup_ratios=(0.5, 0.25), warmup_steps=4, start_iter=2)
    assert [state.ratio_at(step) for step in range(8)] == [0.01, 0.01, 0.5, 0.5, 0.25, 0.25, 0.01, 0.01]
    values = torch.tensor([0.5, -3.0, 0.1, 2.0])
    indices = torch.tensor([1, 4, 6, 9], dtype=torch.int32)
    kept_values, kept_indices, kept = _fit(values, indices, 2)
    assert kept_indices.tolist() == [4, 9] and kept_values.tolist() == [-3.0, 2.0] and kept.tolist() == [1, 3]
    padded_values, padded_indices, none = _fit(values, indices, 6)
    assert padded_indices.tolist() == [1, 4, 6, 9, 0, 0] and padded_values[4:].tolist() == [0.0, 0.0]
    assert none is None
    # ties in magnitude keep the lower index, in every dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tied = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0], dtype=dtype)
        _, tied_indices, tied_kept = _fit(tied, torch.arange(10, 15, dtype=torch.int32), 2)
        assert tied_indices.tolist() == [11, 12] and tied_kept.tolist() == [1, 2]
