"""The hooks inside real DDP models on 2 gloo ranks: register(), per-model default states, bucket rebuilds,
checkpoints, GradScaler skips, half-precision models, no_sync with and without static_graph, convergence.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _hooks_ddp_workers as workers  # noqa: E402
import _hooks_training_workers as training  # noqa: E402
import _hooks_workers as harness  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_register_rebuild_and_checkpoint(tmp_path):
    harness.spawn(tmp_path, 2, workers.ddp_worker)


def test_grad_scaler_half_precision_and_no_sync(tmp_path):
    harness.spawn(tmp_path, 2, workers.training_modes_worker)


def test_convergence_within_1_5_points_of_dense(tmp_path):
    harness.spawn(tmp_path, 2, training.convergence_worker, 300, str(tmp_path))
    accuracy = training.read_accuracies(tmp_path)
    assert 80 < accuracy["dense"] < 97, accuracy  # learnable, yet not so easy that any hook would do
    for name, value in accuracy.items():
        dense = accuracy["dense"]
        assert value >= dense - 1.5, f"{name} reached {value:.2f}% vs dense {dense:.2f}%"
