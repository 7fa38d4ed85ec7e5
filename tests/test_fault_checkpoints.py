"""Checkpoints that fail under a run of examples/train_lm.py, and the runs that share their references.

Under ``torchrun`` on 2 gloo ranks of a tiny GPT (see ``_fault_runs.py``): a SIGKILL in the middle of a
checkpoint write, a corrupt newest checkpoint (a flipped byte, a truncated file), and a SIGKILL of a rank
at a random step under sign. Each must end with the model and optimizer state of an uninterrupted run, bit
for bit. The checkpoint-write kill runs q8: it is q8's SIGKILL-and-restart test (a rank killed, torchrun
restarting the group, the run resumed from a checkpoint and ending as the uninterrupted one did), so q8
needs no random-step run of its own.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _fault_runs as fr  # noqa: E402

data_dir, reference = fr.data_dir, fr.reference  # the module-scoped fixtures of these tests

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
KILLING = Path(__file__).parent / "_killing_train_lm.py"  # the example, with a rank killed in a write


def test_sigkill_of_a_rank_restarts_and_ends_bit_identical(data_dir: Path, tmp_path: Path, reference) -> None:
    fr.sigkill_restart("sign", data_dir, tmp_path, reference)


def test_sigkill_during_a_checkpoint_write_uses_the_previous_one(
    data_dir: Path, tmp_path: Path, reference
) -> None:
    # Rank 1 writes half of its file of checkpoint 20, then SIGKILLs itself; the restart must ignore the
    # partial checkpoint, resume from step 10, and still end bit-identical to an uninterrupted run.
    args = ["--hook", "quantize", "--opt", "bits=8", "--steps", "30", "--checkpoint-every", "10"]
    command = fr.command(2, data_dir, tmp_path / "killed", *args, script=KILLING)
    result = fr.run(command, tmp_path / "killed", env=fr.run_env(KILL_AT="20:1"))
    assert "resumed quantize (adamw) at step 10" in result.stderr, result.stderr[-3000:]
    fr.assert_bit_identical(fr.final_state(reference(args)), fr.final_state(tmp_path / "killed"))


CORRUPT_ARGS = ["--hook", "sign", "--steps", "30", "--checkpoint-every", "10"]


@pytest.fixture(scope="module")
def stopped_at_20(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The work directory of a sign run stopped at step 20 (checkpoints 10 and 20 kept), run once: each
    damage test copies it."""
    work = tmp_path_factory.mktemp("stopped")
    args = [*CORRUPT_ARGS, "--checkpoint-keep", "3", "--stop-after", "20"]
    fr.run(fr.command(2, data_dir, work, *args), work)
    return work


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(
    damage: str, data_dir: Path, tmp_path: Path, reference, stopped_at_20: Path
) -> None:
    args = list(CORRUPT_ARGS)
    uninterrupted = reference(args)
    args += ["--checkpoint-keep", "3"]
    work = tmp_path / "damaged"
    shutil.copytree(stopped_at_20, work)
    victim = work / "ckpt" / "step-000000020" / "rank0.pt"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        del data[len(data) * 2 // 3 :]
    victim.write_bytes(bytes(data))
    result = fr.run(fr.command(2, data_dir, work, *args), work)
    reason = "SHA-256 mismatch" if damage == "flip" else "truncated"
    assert "step-000000020 is unusable" in result.stderr and reason in result.stderr, result.stderr[-3000:]
    assert "resumed sign (adamw) at step 10" in result.stderr
    assert (work / "ckpt" / "step-000000020.corrupt").is_dir()
    fr.assert_bit_identical(fr.final_state(uninterrupted), fr.final_state(work))
