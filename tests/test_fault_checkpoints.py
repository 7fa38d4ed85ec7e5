"""Checkpoints that fail under a run of examples/train_lm.py, and the runs that share their references.

On 2 gloo ranks of a tiny GPT (see ``_fault_runs.py``): under ``torchrun``, a SIGKILL in the middle of a
checkpoint write and a SIGKILL of a rank at a random step under sign; corrupt newest checkpoints (a flipped
byte, a truncated file: both in one resumed run, which falls back past the two). Each must end with the
model and optimizer state of an uninterrupted run, bit for bit. The checkpoint-write kill runs q8: it is
q8's SIGKILL-and-restart test (a rank killed, torchrun restarting the group, the run resumed from a
checkpoint and ending as the uninterrupted one did), so q8 needs no random-step run of its own.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _fault_runs as fr  # noqa: E402

data_dir, forked, reference = fr.data_dir, fr.forked, fr.reference  # the module-scoped fixtures here

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
KILLING = Path(__file__).parent / "_killing_train_lm.py"  # the example, with a rank killed in a write


def test_sigkill_of_a_rank_restarts_and_ends_bit_identical(
    data_dir: Path, tmp_path: Path, reference, forked: fr.ForkedRanks
) -> None:
    fr.sigkill_restart("sign", data_dir, tmp_path, reference, forked)


def test_sigkill_during_a_checkpoint_write_uses_the_previous_one(
    data_dir: Path, tmp_path: Path, reference, forked: fr.ForkedRanks
) -> None:
    # Rank 1 writes half of its file of checkpoint 20, then SIGKILLs itself; the restart must ignore the
    # partial checkpoint, resume from step 10, and still end bit-identical to an uninterrupted run.
    args = ["--hook", "quantize", "--opt", "bits=8", "--steps", "30", "--checkpoint-every", "10"]
    command = fr.command(2, data_dir, tmp_path / "killed", *args, script=KILLING)
    result = fr.run(command, tmp_path / "killed", forked.torchrun_env(KILL_AT="20:1"))
    assert "resumed quantize (adamw) at step 10" in result.stderr, result.stderr[-3000:]
    fr.assert_bit_identical(fr.final_state(reference(args)), fr.final_state(tmp_path / "killed"))


DAMAGED = {"flip": (30, 0), "truncate": (20, 1)}  # damage -> (step, rank) of the file it hits


@pytest.fixture(scope="module")
def damaged_resume(
    data_dir: Path, tmp_path_factory: pytest.TempPathFactory, reference, forked: fr.ForkedRanks
) -> tuple[str, Path, Path]:
    """The sign reference's checkpoints (steps 10, 20, 30) with the two newest damaged, a flipped byte in
    rank 0's file of step 30 and rank 1's file of step 20 cut short, resumed once (in forked ranks: no
    restart is involved): (its ranks' output, its work directory, the reference's). Each damage test reads
    its own lines."""
    args = fr.method_args("sign", 30)
    uninterrupted = reference(args)
    work = tmp_path_factory.mktemp("damaged")
    shutil.copytree(uninterrupted / "ckpt", work / "ckpt")
    for damage, (step, rank) in DAMAGED.items():
        victim = work / "ckpt" / f"step-{step:09d}" / f"rank{rank}.pt"
        data = bytearray(victim.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x40
        else:
            del data[len(data) * 2 // 3 :]
        victim.write_bytes(bytes(data))
    return forked.run(fr.example_args(data_dir, work, *args), work), work, uninterrupted


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(
    damage: str, damaged_resume: tuple[str, Path, Path]
) -> None:
    stderr, work, uninterrupted = damaged_resume
    step = DAMAGED[damage][0]
    reason = "SHA-256 mismatch" if damage == "flip" else "truncated"
    said = [line for line in stderr.splitlines() if f"step-{step:09d} is unusable" in line]
    assert said and reason in said[0], stderr[-3000:]
    assert (work / "ckpt" / f"step-{step:09d}.corrupt").is_dir()
    assert "resumed sign (adamw) at step 10" in stderr, stderr[-3000:]
    fr.assert_bit_identical(fr.final_state(uninterrupted), fr.final_state(work))
