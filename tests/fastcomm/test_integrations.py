"""fastcomm hooks under Accelerate and Lightning, with the real packages on 2 gloo CPU ranks.

What works (the helpers, ``fastcomm.register`` on the prepared model, the Lightning callback) is shown by the
hook's own counters after real training steps; what silently does nothing
(``DistributedDataParallelKwargs(comm_hook=...)``, ``DDPStrategy(ddp_comm_hook=...)`` on CPU) is shown by the
DDP model carrying no hook and the state never being called. Every framework's scenarios run in one launch
(a module-scoped fixture); a missing package skips its tests.
"""

import importlib
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _integrations_workers as workers  # noqa: E402


def _has(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not any(_has(package) for package in ("accelerate", "lightning", "pytorch_lightning")):
        pytest.skip("none of accelerate, lightning, pytorch_lightning is installed")
    return workers.launch(tmp_path_factory.mktemp("integrations"))


@pytest.fixture(scope="module")
def accelerate_ranks(ranks):
    pytest.importorskip("accelerate")
    return [rank["accelerate"] for rank in ranks]


@pytest.fixture(scope="module")
def lightning_ranks(ranks):
    return ranks


def _compressed_every_step(stats: dict, steps: int = 3) -> None:
    assert stats["steps"] == steps, stats
    assert stats["compressed_buckets"] == steps and stats["dense_buckets"] == 0, stats
    assert stats["sent_bytes"] < stats["dense_bytes"], stats


# ------------------------------------------------------------------------------------------------ Accelerate
@pytest.mark.distributed
def test_accelerate_runs_multi_cpu_over_gloo(accelerate_ranks):
    for rank in accelerate_ranks:
        assert rank["distributed_type"] == "DistributedType.MULTI_CPU"
        assert rank["backend"] == "gloo"


@pytest.mark.distributed
def test_accelerate_ddp_kwargs_comm_hook_registers_nothing(accelerate_ranks):
    for rank in accelerate_ranks:
        assert rank["kwargs_model_type"] == "DistributedDataParallel"
        assert rank["kwargs_hooks"] == []
        assert rank["kwargs_state"] == "None"


@pytest.mark.distributed
def test_register_accelerate_compresses_and_names_the_ignored_kwargs(accelerate_ranks):
    for rank in accelerate_ranks:
        _compressed_every_step(rank["helper_stats"])
        assert rank["helper_state_found"]
        assert any("comm_hook=topk_hook) is ignored by Accelerate" in w for w in rank["helper_warnings"])


@pytest.mark.distributed
def test_register_on_the_prepared_model_compresses(accelerate_ranks):
    for rank in accelerate_ranks:
        _compressed_every_step(rank["register_stats"])


@pytest.mark.distributed
def test_register_accelerate_refuses_a_second_hook_naming_the_first(accelerate_ranks):
    for rank in accelerate_ranks:
        assert "already has a comm hook registered (topk_hook)" in rank["second_hook_error"]


@pytest.mark.distributed
def test_register_accelerate_refuses_an_unprepared_model_in_a_multi_process_run(accelerate_ranks):
    for rank in accelerate_ranks:
        assert "got Sequential in a 2-process run" in rank["unwrapped_error"]


@pytest.mark.distributed
def test_find_ddp_looks_through_torch_compile(accelerate_ranks):
    assert all(rank["found_under_compile"] for rank in accelerate_ranks)


@pytest.mark.distributed
def test_register_accelerate_refuses_a_one_process_accelerator_over_several_ranks(accelerate_ranks):
    # a plain Accelerator() on CPU under a 2-rank launch: one process, no DDP, each rank on its own
    for rank in accelerate_ranks:
        assert rank["plain_processes"] == 1 and rank["plain_model_type"] != "DistributedDataParallel", rank
        assert rank["plain_error"] is not None, "register_accelerate let 2 ranks train unsynchronized"
        assert "2 ranks" in rank["plain_error"] and "Accelerator(cpu=True)" in rank["plain_error"]


def test_register_accelerate_one_process_warns_and_registers_nothing():
    pytest.importorskip("accelerate")
    import torch
    from accelerate import Accelerator

    from fastcomm.integrations import register_accelerate

    accelerator = Accelerator(cpu=True)  # no launcher environment: one process, no DDP wrapper
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="one process"):
        assert register_accelerate(accelerator, model, "topk") is None


# ------------------------------------------------------------------------------------------------- Lightning
@pytest.mark.distributed
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_callback_compresses_every_step(lightning_ranks, package):
    pytest.importorskip(package)
    for rank in lightning_ranks:
        _compressed_every_step(rank[package]["callback_stats"])


@pytest.mark.distributed
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_callback_registers_again_on_a_second_fit(lightning_ranks, package):
    pytest.importorskip(package)
    for rank in lightning_ranks:
        _compressed_every_step(rank[package]["refit_stats"], steps=6)


# What the callback refuses, each seen as the error message on every rank.
_CALLBACK_ERRORS = {
    "a_second_module": ("other_module_error", "already registered on another model"),
    "a_hook_that_did_not_run": ("not_run_error", "did not run during the first backward"),
    "a_model_rewrapped_after_fit_start": ("rewrapped_error", "not the DDP model the hook was registered on"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
@pytest.mark.parametrize("case", sorted(_CALLBACK_ERRORS))
def test_lightning_callback_refuses(lightning_ranks, package, case):
    pytest.importorskip(package)
    key, message = _CALLBACK_ERRORS[case]
    for rank in lightning_ranks:
        assert message in (rank[package][key] or "no error"), rank[package][key]


@pytest.mark.distributed
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_ddp_strategy_comm_hook_registers_nothing_on_cpu(lightning_ranks, package):
    pytest.importorskip(package)
    for rank in lightning_ranks:
        seen = rank[package]
        assert seen["strategy_model_type"] == "DistributedDataParallel"
        assert seen["strategy_hooks"] == []
        assert seen["strategy_stats"]["compressed_buckets"] + seen["strategy_stats"]["dense_buckets"] == 0


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_callback_rejects_a_bad_hook_at_construction(package):
    pytest.importorskip(package)
    integration = importlib.import_module(f"fastcomm.integrations.{package}")
    with pytest.raises(ValueError, match="unknown hook 'nope'"):
        integration.CommHook("nope")
    with pytest.raises(ValueError, match="ratio"):
        integration.CommHook("topk", ratio=2.0)


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_callback_one_process_warns_and_registers_nothing(package):
    pytest.importorskip(package)
    integration = importlib.import_module(f"fastcomm.integrations.{package}")
    callback = integration.CommHook("sign")
    with pytest.warns(UserWarning, match="one process"):
        workers.lightning_fit(package, "auto", [callback], devices=1, steps=1)
    assert callback.state is None


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_integration_without_its_package_names_it(package, monkeypatch):
    import_name = "lightning.pytorch" if package == "lightning" else "pytorch_lightning"
    monkeypatch.setitem(sys.modules, import_name, None)  # makes `import` of it fail
    monkeypatch.delitem(sys.modules, f"fastcomm.integrations.{package}", raising=False)
    with warnings.catch_warnings(), pytest.raises(ImportError, match=f"needs the '{package}' package"):
        importlib.import_module(f"fastcomm.integrations.{package}")
