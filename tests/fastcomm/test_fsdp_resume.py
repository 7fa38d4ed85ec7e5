"""fastcomm.fsdp across a checkpoint and a failing peer (2 gloo ranks).

Resume: training restored from a checkpoint (model and optimizer by torch.distributed.checkpoint, the
compression state's residuals and step counters per rank) continues bit for bit as the uninterrupted run.
Fault: a peer killed (or stopped past the group's timeout) before backward makes the survivor's compressed
reduce-scatter raise PeerCollectiveError within the timeout, in that step's backward, never a hang.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _fsdp_resume_workers as workers  # noqa: E402
import _fsdp_workers as fsdp_workers  # noqa: E402

TIMEOUT_S = 5.0  # the training group's collective timeout
SLACK_S = 10.0  # detection beyond the timeout: a loaded 2-core machine
LIMIT_S = 180.0  # hard bound per case: process start-up (slow on a loaded machine), the fault, the report


def test_resume_is_bit_identical(tmp_path):
    fsdp_workers.spawn_preloaded(tmp_path, 2, workers.train_and_save, str(tmp_path))
    fsdp_workers.spawn_preloaded(tmp_path / "resumed", 2, workers.restore_and_compare, str(tmp_path))


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_survivor_raises_when_peer_fails(tmp_path, fault):
    report = workers.run_with_fault(tmp_path, fault, TIMEOUT_S, LIMIT_S)
    assert report["step"] == workers.FAULT_STEP, f"raised at another step than the fault: {report}"
    assert report["phase"] == "backward", report
    assert report["seconds"] < TIMEOUT_S + SLACK_S, report
    assert report["type"] == "PeerCollectiveError", report
    assert "fastcomm.fsdp reduce-scatter" in report["message"], report
