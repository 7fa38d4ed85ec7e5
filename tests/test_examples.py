"""examples/train_lm.py runs on 2 gloo ranks (DDP and FSDP2), checkpoints, and resumes at the right step.

The FSDP2 run is the example as the README runs it, a script under ``torchrun``. The other runs' ranks are
forked from one process that imported the example (``_fault_runs.ForkedRanks``), in torchrun's worker
environment: what they test is the example's training and checkpoints, and a launch whose ranks import torch
costs ten times their steps. The example under ``torchrun``, killed and restarted, is in ``test_fault_*.py``.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import fastcomm
from benchmarks.lm_methods import EXAMPLE, load_example

sys.path.insert(0, str(Path(__file__).parent))
import _fault_runs as fr  # noqa: E402

forked = fr.forked  # the module-scoped fixture of the forked runs

TINY = ["--d-model", "32", "--n-layer", "1", "--n-head", "2", "--max-files", "40", "--batch-size", "4",
        "--val-rows", "8", "--log-every", "2"]


def _arguments(tmp_path: Path, *args: str) -> list[str]:
    return [*TINY, "--data-dir", str(tmp_path / "data"), "--checkpoint-dir", str(tmp_path / "ckpt"), *args]


@pytest.mark.slow
@pytest.mark.distributed
# PowerSGD (its warm-start Q's); top-k's resume: bit for bit after a SIGKILL, in test_fault_tolerance.py.
@pytest.mark.parametrize("hook", ["powersgd"])
def test_train_lm_resumes_at_the_checkpointed_step_with_the_same_losses(
    tmp_path: Path, hook: str, forked: fr.ForkedRanks
) -> None:
    # Run A stops after step 6 as if killed; its last checkpoint is step 4. Run B resumes there and must
    # repeat A's steps 5 and 6 exactly (model, optimizer, schedule, hook residuals and PowerSGD's
    # warm-start Q's, loader position, RNG).
    common = ["--hook", hook, "--steps", "8", "--eval-every", "4", "--checkpoint-every", "4"]
    a_json, b_json = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    forked.run(_arguments(tmp_path, *common, "--stop-after", "6", "--json", a_json), tmp_path)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000000004"]
    resumed = forked.run(_arguments(tmp_path, *common, "--resume", "--json", b_json), tmp_path)
    first, second = (json.loads((tmp_path / name).read_text()) for name in ("a.json", "b.json"))

    assert f"resumed {hook} (adamw) at step 4" in resumed
    assert first["start_step"] == 0 and len(first["train_losses"]) == 6
    assert second["start_step"] == 4 and len(second["train_losses"]) == 4
    losses = first["train_losses"] + second["train_losses"] + second["val_losses"]
    assert all(math.isfinite(x) for x in losses)
    assert second["train_losses"][:2] == first["train_losses"][4:6]
    assert second["val_steps"] == [4, 8]  # step 4's validation came with the checkpoint
    assert second["val_losses"][0] == first["val_losses"][0]
    # The newest two are kept (--checkpoint-keep's default): the newest, and one to fall back on.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000000004", "step-000000008"]


def test_resume_refuses_a_checkpoint_of_another_method(tmp_path: Path) -> None:
    train_lm = load_example()
    paths = train_lm.prepare_data(tmp_path / "data", max_files=40)
    tiny = train_lm.ModelConfig(d_model=16, n_layer=1, n_head=2)
    common = {"steps": 2, "batch_size": 2, "val_rows": 2, "log_every": 0, "model": tiny}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        train_lm.train(train_lm.TrainConfig(checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, **common),
                       paths)
        another_run = "is of another run: hook: saved 'none', this run 'quantize'"
        q8 = train_lm.TrainConfig(hook="quantize", options={"bits": 8}, resume=tmp_path / "ckpt", **common)
        with pytest.raises(fastcomm.CheckpointError, match=another_run):
            train_lm.train(q8, paths)
    finally:
        dist.destroy_process_group()


def test_data_split_holds_out_every_twentieth_file_and_is_reused(tmp_path: Path) -> None:
    train_lm = load_example()
    paths = train_lm.prepare_data(tmp_path, max_files=40)
    assert (paths.train_files, paths.val_files) == (38, 2)
    assert paths.train_bytes > 0 and paths.val_bytes > 0
    again = train_lm.prepare_data(tmp_path, max_files=40)
    assert again == paths
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("stdlib-")]) == 1


def test_model_has_the_documented_parameter_count() -> None:
    train_lm = load_example()
    model = train_lm.GPT(train_lm.ModelConfig())
    assert sum(p.numel() for p in model.parameters()) == 1_457_856


@pytest.mark.parametrize(
    "bad", [{"d_model": 30, "n_head": 4}, {"n_layer": 0}, {"context": 1.5}, {"context": 129}]
)
def test_model_config_names_the_bad_value(bad: dict) -> None:
    train_lm = load_example()
    with pytest.raises(ValueError, match="d_model|n_layer|context"):
        train_lm.ModelConfig(**bad)


@pytest.mark.slow
@pytest.mark.distributed
def test_train_lm_trains_under_fsdp2_with_a_compressed_reduce_scatter(tmp_path: Path) -> None:
    # The example as the README runs it: a script under torchrun, its ranks importing everything themselves
    # (every other run of it in the tests has its ranks forked from a process that imported it once).
    args = ["--fsdp", "--hook", "quantize", "--opt", "bits=8", "--steps", "4", "--eval-every", "4"]
    argv = _arguments(tmp_path, *args, "--json", str(tmp_path / "fsdp.json"))
    output = fr.run(fr.torchrun(2, str(EXAMPLE), *argv), tmp_path, fr.run_env()).stderr
    run = json.loads((tmp_path / "fsdp.json").read_text())
    assert "quantize (adamw) under FSDP2" in output
    assert len(run["train_losses"]) == 4 and all(math.isfinite(x) for x in run["train_losses"])
    assert run["hook_stats"]["steps"] == 4 and run["hook_stats"]["compression_ratio"] > 3


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"optimizer": "compressed_adam"}, "optimizer 'compressed_adam' has no FSDP2 form"),
     ({"hook": "topk"}, "hook 'topk' is not a compressor of fastcomm.fsdp"),
     ({"hook": "quantize", "checkpoint_dir": Path("c"), "checkpoint_every": 2},
      "checkpoints and final_state are DDP")],
)
def test_fsdp_refuses_what_it_cannot_run(fields: dict, message: str) -> None:
    train_lm = load_example()
    with pytest.raises(ValueError, match=message):
        train_lm.TrainConfig(fsdp=True, **fields)


def test_an_unknown_optimizer_is_named() -> None:
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        load_example().TrainConfig(optimizer="lamb")
