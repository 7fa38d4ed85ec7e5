"""fastcomm.Checkpointer: atomic, checksummed checkpoints with fallback, pruning and world-size merges."""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fastcomm
from fastcomm.checkpoint import merge_optimizer_states, verify_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
import _checkpoint_workers as ckpt_workers  # noqa: E402
import _hooks_workers as workers  # noqa: E402

Counter = ckpt_workers.Position  # a minimal stateful object, as a user's own class would be


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 13)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return _trained(seed=99)


def _assert_same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_save_and_restore_round_trip_objects_rng_and_extra(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=0)
    counter = Counter()
    counter.value = 17
    ckpt = fastcomm.Checkpointer(tmp_path, every=5, model=model, optimizer=optimizer, counter=counter)
    assert ckpt.restore() == 0 and ckpt.restored_from is None
    torch.manual_seed(1234)
    random.seed(5)
    np.random.seed(6)
    assert ckpt.maybe_save(4) is None
    path = ckpt.maybe_save(5, extra={"losses": [1.5, 1.25]})
    assert path == tmp_path / "step-000000005"
    expected = (torch.rand(3), random.random(), np.random.rand())

    model2, optimizer2 = _fresh()
    counter2 = Counter()
    ckpt2 = fastcomm.Checkpointer(tmp_path, model=model2, optimizer=optimizer2, counter=counter2)
    assert ckpt2.restore() == 5
    assert ckpt2.extra == {"losses": [1.5, 1.25]} and ckpt2.restored_from == path
    _assert_same_model(model, model2)
    assert counter2.value == 17
    assert optimizer2.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]  # the RNG streams continue


def test_keep_prunes_old_checkpoints_and_the_manifest_lists_checksums(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=0)
    ckpt = fastcomm.Checkpointer(tmp_path, every=2, keep=2, model=model, optimizer=optimizer)
    for step in range(1, 10):
        ckpt.maybe_save(step)
    assert ckpt.steps() == [8, 6]
    manifest = verify_checkpoint(tmp_path / "step-000000008")
    assert manifest["step"] == 8 and manifest["world_size"] == 1
    entry = manifest["files"]["rank0.pt"]
    assert entry["bytes"] == (tmp_path / "step-000000008" / "rank0.pt").stat().st_size
    assert len(entry["sha256"]) == 64


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest", "missing"])
def test_a_damaged_newest_checkpoint_is_logged_renamed_and_the_previous_used(
    damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = _trained(seed=0)
    ckpt = fastcomm.Checkpointer(tmp_path, every=1, keep=3, model=model, optimizer=optimizer)
    ckpt.save(1)
    at_one = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(2, 13)).sum().backward()
    optimizer.step()
    ckpt.save(2)
    newest = tmp_path / "step-000000002"
    victim = newest / "rank0.pt"
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[len(data) // 3] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
    elif damage == "manifest":
        (newest / "manifest.json").write_text("{not json")
    else:
        victim.unlink()
    model2, optimizer2 = _fresh()
    with caplog.at_level(logging.INFO, logger="fastcomm.checkpoint"):
        step = fastcomm.Checkpointer(tmp_path, model=model2, optimizer=optimizer2).restore()
    assert step == 1
    reason = {
        "flip": "SHA-256 mismatch",
        "truncate": "truncated",
        "manifest": "unreadable",
        "missing": "is missing",
    }[damage]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "step-000000002 is unusable" in message and reason in message, message
    assert "trying step-000000001" in message
    assert any("resumed at step 1" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "step-000000002.corrupt").is_dir() and not newest.exists()
    for name, value in model2.state_dict().items():
        assert torch.equal(value, at_one[name]), name


def test_a_partial_checkpoint_is_never_read_and_is_cleaned_up(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=0)
    ckpt = fastcomm.Checkpointer(tmp_path, model=model, optimizer=optimizer)
    ckpt.save(3)
    partial = tmp_path / ".step-000000004.partial"
    partial.mkdir()
    (partial / "rank0.pt").write_bytes(b"half a file")
    assert ckpt.steps() == [3]
    model2, optimizer2 = _fresh()
    assert fastcomm.Checkpointer(tmp_path, model=model2, optimizer=optimizer2).restore() == 3
    assert not partial.exists()


def test_every_checkpoint_damaged_starts_from_zero(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=0)
    ckpt = fastcomm.Checkpointer(tmp_path, model=model, optimizer=optimizer)
    ckpt.save(1)
    (tmp_path / "step-000000001" / "rank0.pt").write_bytes(b"garbage")
    lines: list[str] = []
    model2, optimizer2 = _fresh()
    assert (
        fastcomm.Checkpointer(tmp_path, model=model2, optimizer=optimizer2, log=lines.append).restore() == 0
    )
    assert "starting from step 0" in lines[0]


def test_an_explicit_damaged_path_raises_instead_of_falling_back(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=0)
    ckpt = fastcomm.Checkpointer(tmp_path, model=model, optimizer=optimizer)
    ckpt.save(1)
    ckpt.save(2)
    (tmp_path / "step-000000002" / "rank0.pt").write_bytes(b"garbage")
    with pytest.raises(fastcomm.CheckpointError, match="step-000000002 is unusable: .*has 7 bytes"):
        ckpt.restore(tmp_path / "step-000000002")


def test_a_checkpoint_of_another_run_or_without_an_object_is_refused(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=0)
    fastcomm.Checkpointer(tmp_path, run={"method": "topk", "ratio": 0.01}, model=model).save(1)
    with pytest.raises(fastcomm.CheckpointError, match="another run: ratio: saved 0.01, this run 0.1"):
        fastcomm.Checkpointer(tmp_path, run={"method": "topk", "ratio": 0.1}, model=model).restore()
    with pytest.raises(fastcomm.CheckpointError, match=r"has no state for \['optimizer'\]"):
        fastcomm.Checkpointer(
            tmp_path, run={"method": "topk", "ratio": 0.01}, model=model, optimizer=optimizer
        ).restore()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every": -1}, ValueError, "every must be an int >= 0"),
        ({"keep": 0}, ValueError, "keep must be an int >= 1"),
        ({"thing": object()}, TypeError, "'thing' \\(object\\) has no state_dict"),
        ({"run": {"x": object()}}, TypeError, "run must hold JSON values"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict, error: type, match: str, tmp_path: Path) -> None:
    objects = {} if "thing" in kwargs else {"counter": Counter()}
    with pytest.raises(error, match=match):
        fastcomm.Checkpointer(tmp_path, **objects, **kwargs)


def test_no_objects_and_a_bad_step_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="name at least one object"):
        fastcomm.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        fastcomm.Checkpointer(tmp_path, counter=Counter()).save(-3)


def test_merge_optimizer_states_averages_only_what_differs() -> None:
    _, optimizer = _trained(seed=0)
    a = optimizer.state_dict()
    # b: a copy of a with one parameter's momentum changed, as a second rank's would be
    b = {
        "state": {
            pid: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
            for pid, s in a["state"].items()
        },
        "param_groups": a["param_groups"],
    }
    b["state"][0]["exp_avg"] = b["state"][0]["exp_avg"] + torch.randn_like(b["state"][0]["exp_avg"])
    merged, why = merge_optimizer_states([a, b])
    expected = (a["state"][0]["exp_avg"] + b["state"][0]["exp_avg"]) / 2
    torch.testing.assert_close(merged["state"][0]["exp_avg"], expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(merged["state"][1]["exp_avg"], a["state"][1]["exp_avg"])
    assert "1 of" in why and "mean" in why
    same, why_same = merge_optimizer_states([a, a])
    assert "the same on all 2 old ranks" in why_same
    b["state"][0]["step"] = b["state"][0]["step"] + 1
    with pytest.raises(fastcomm.CheckpointError, match="optimizer state 0/step"):
        merge_optimizer_states([a, b])


@pytest.mark.distributed
def test_two_ranks_save_and_restore_bit_identically(tmp_path: Path) -> None:
    workers.spawn(tmp_path / "a", 2, ckpt_workers.save_worker, str(tmp_path / "ckpt"))
    workers.spawn(tmp_path / "b", 2, ckpt_workers.restore_same_world_worker, str(tmp_path / "ckpt"))


@pytest.mark.distributed
def test_restore_on_three_ranks_merges_per_object_and_reseeds(tmp_path: Path) -> None:
    workers.spawn(tmp_path / "a", 2, ckpt_workers.save_worker, str(tmp_path / "ckpt"))
    workers.spawn(tmp_path / "b", 3, ckpt_workers.restore_other_world_worker, str(tmp_path / "ckpt"))


@pytest.mark.distributed
def test_ranks_agree_to_fall_back_when_one_rank_file_is_corrupt(tmp_path: Path) -> None:
    workers.spawn(tmp_path / "a", 2, ckpt_workers.save_worker, str(tmp_path / "ckpt"))
    victim = tmp_path / "ckpt" / "step-000000004" / "rank1.pt"
    data = bytearray(victim.read_bytes())
    data[-50] ^= 0x10
    victim.write_bytes(bytes(data))
    workers.spawn(tmp_path / "b", 2, ckpt_workers.restore_agrees_worker, str(tmp_path / "ckpt"))
