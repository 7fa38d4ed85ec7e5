"""fastcomm.fsdp across a checkpoint and a failing peer (2 gloo ranks).

Resume: training restored from a checkpoint (model and optimizer by torch.distributed.checkpoint, the
compression state's residuals and step counters per rank) continues bit for bit as the uninterrupted run;
on 3 ranks, the residuals are re-sharded (FSDPCompression.merge_state_dicts); one checkpoint for both.
Fault: a peer killed (or stopped past the group's timeout) before backward makes the survivor's compressed
reduce-scatter raise PeerCollectiveError within the timeout, in that step's backward, never a hang.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp  # noqa: F401 - registers torch.ops.fsdp.chunk_cat, the layout's oracle

import fastcomm.fsdp
from fastcomm.collectives import Residual
from fastcomm.fsdp.reshard import FSDPReshardError, GroupLayout

sys.path.insert(0, str(Path(__file__).parent))
import _fsdp_resume_workers as workers  # noqa: E402
import _fsdp_workers as fsdp_workers  # noqa: E402

TIMEOUT_S = 5.0  # the training group's collective timeout
SLACK_S = 10.0  # detection beyond the timeout: a loaded 2-core machine
LIMIT_S = 180.0  # hard bound per case: process start-up (slow on a loaded machine), the fault, the report


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The run of 2 ranks that saved at SAVE_AT and trained on: its directory."""
    workdir = tmp_path_factory.mktemp("fsdp_checkpoint")
    fsdp_workers.spawn_preloaded(workdir, 2, workers.train_and_save, str(workdir))
    return workdir


def test_resume_is_bit_identical(checkpoint):
    fsdp_workers.spawn_preloaded(checkpoint / "resumed", 2, workers.restore_and_compare, str(checkpoint))


def test_a_restart_on_3_ranks_gives_every_rank_the_mean_owed_residual(checkpoint):
    fsdp_workers.spawn_preloaded(
        checkpoint / "three", 3, workers.restore_at_another_world_size, str(checkpoint)
    )


def test_the_layout_is_fsdps_own_at_any_world_size():
    """GroupLayout.join lays full parameters out as FSDP2's reduce-scatter copy-in does (odd first dims)."""
    layout = GroupLayout(((37, 13), (37,), (5, 37), (5,), (1, 3)), world_size=2)
    params = [
        torch.randn(shape, generator=torch.Generator().manual_seed(n))
        for n, shape in enumerate(layout.shapes)
    ]
    for world in (2, 3, 4):
        out = torch.empty(layout.resized(world).numel)
        torch.ops.fsdp.chunk_cat(params, dim=0, num_chunks=world, out=out.view(world, -1))
        assert torch.equal(layout.resized(world).join(params), out), world
        back = layout.resized(world).split(out)
        assert all(torch.equal(a, b) for a, b in zip(back, params, strict=True)), world


def test_hsdp_residuals_are_refused_at_another_world_size_by_name():
    state = {"traffic": {}, "feedback": Residual(worker=torch.ones(4)).state_dict(), "layout": None}
    states = [{"reductions": {"": state}, "gathers": {}}] * 2
    with pytest.raises(FSDPReshardError, match="HSDP keeps it for one shard position"):
        fastcomm.fsdp.FSDPCompression.merge_state_dicts(states, 4, rank=0)
    same, _ = fastcomm.fsdp.FSDPCompression.merge_state_dicts(states, 2, rank=1)
    assert same is states[1]


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_survivor_raises_when_peer_fails(tmp_path, fault):
    report = workers.run_with_fault(tmp_path, fault, TIMEOUT_S, LIMIT_S)
    assert report["step"] == workers.FAULT_STEP, f"raised at another step than the fault: {report}"
    assert report["phase"] == "backward", report
    assert report["seconds"] < TIMEOUT_S + SLACK_S, report
    assert report["type"] == "PeerCollectiveError", report
    assert "fastcomm.fsdp reduce-scatter" in report["message"], report
