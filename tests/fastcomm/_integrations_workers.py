"""Rank processes for the Accelerate and Lightning tests: each run is launched the way the framework expects.

``launch`` starts two copies of this file with the environment a launcher sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so Accelerate builds a real multi-CPU state and Lightning's
``DDPStrategy`` sees externally created processes, as under ``torchrun``. Each rank runs every scenario of
every installed framework in a row (process start-up and the frameworks' imports cost seconds), Accelerate
first, and writes what it saw to ``rank<r>.json``; the tests assert on that. A missing package is written as
skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import free_port, rank_env

LAUNCH_TIMEOUT_S = 150


def launch(workdir: Path) -> list[dict[str, Any]]:
    """Run every installed framework's scenarios on 2 gloo ranks; return each rank's results by package.

    A package that is not installed has the value ``"skipped"``; a failed rank raises with both logs.
    """
    port = free_port()
    as_launched = {"NODE_RANK": "0", "GLOO_SOCKET_IFNAME": "lo"}
    envs = [rank_env(rank, 2, port, LOCAL_RANK=str(rank), **as_launched) for rank in range(2)]
    logs = [workdir / f"rank{rank}.log" for rank in range(2)]
    # No early stop on a failed rank: both logs are wanted whole.
    ranks = common.launch([[sys.executable, __file__, str(workdir)]] * 2, envs, logs, LAUNCH_TIMEOUT_S,
                          fail_grace_s=LAUNCH_TIMEOUT_S, cwd=workdir)
    if not ranks.ok:
        text = "\n".join(f"--- rank {r} (exit {code})\n{logs[r].read_text()[-4000:]}"
                         for r, code in enumerate(ranks.returncodes))
        raise AssertionError(f"integration ranks failed:\n{text}")
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(2)]


def _model() -> Any:
    """4,192 parameters in one DDP bucket: above the hooks' default ``min_compress_numel`` of 1,024."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def _batches(rank: int, count: int) -> list[tuple[Any, Any]]:
    import torch

    generator = torch.Generator().manual_seed(zlib.crc32(f"integrations rank {rank}".encode()))
    return [(torch.randn(8, 32, generator=generator), torch.randn(8, 32, generator=generator))
            for _ in range(count)]


def _error(call: Any, kind: type[BaseException]) -> str | None:
    """``call()``'s error message if it raised ``kind``, else ``None``."""
    try:
        call()
    except kind as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------------------------- Accelerate
def _accelerate(rank: int) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator, DistributedDataParallelKwargs

    import fastcomm
    from fastcomm.integrations import comm_hook_state, find_ddp, register_accelerate, registered_comm_hooks

    result: dict[str, Any] = {}
    torch.manual_seed(0)
    ignored_kwargs = DistributedDataParallelKwargs(comm_hook=fastcomm.topk_hook)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[ignored_kwargs])
    result["distributed_type"] = str(accelerator.distributed_type)
    result["backend"] = torch.distributed.get_backend()

    def train(model: Any, steps: int = 3) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for inputs, targets in _batches(rank, steps):
            optimizer.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()

    # The DDP kwargs way: Accelerate wraps the model in DDP and registers no hook.
    prepared = accelerator.prepare(_model())
    result["kwargs_model_type"] = type(prepared).__name__
    result["kwargs_hooks"] = [hook.__name__ for hook, _ in registered_comm_hooks(prepared)]
    result["kwargs_state"] = repr(comm_hook_state(prepared))

    # The helper, on that same prepared model: it warns that the kwargs hook was ignored, then registers.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = register_accelerate(accelerator, prepared, "topk", ratio=0.05)
    result["helper_warnings"] = [str(w.message) for w in caught]
    train(prepared)
    result["helper_stats"] = state.stats()
    result["helper_state_found"] = comm_hook_state(prepared) is state
    result["second_hook_error"] = _error(
        lambda: register_accelerate(accelerator, prepared, "sign"), ValueError)
    result["unwrapped_error"] = _error(lambda: register_accelerate(accelerator, _model(), "topk"), TypeError)

    # fastcomm.register directly on what prepare returned.
    direct = accelerator.prepare(_model())
    direct_state = fastcomm.register(direct, "sign")
    train(direct)
    result["register_stats"] = direct_state.stats()
    result["found_under_compile"] = find_ddp(torch.compile(direct)) is direct
    accelerator.wait_for_everyone()
    result.update(_plain_accelerator_on_cpu())
    return result


def _plain_accelerator_on_cpu() -> dict[str, Any]:
    """What a user gets from ``Accelerator()`` (no ``cpu=True``) on these 2 CPU ranks, and the helper's error.

    Accelerate keeps one process-wide state; it is set aside for a fresh ``Accelerator()`` and put back after.
    """
    from accelerate.state import AcceleratorState, PartialState

    from fastcomm.integrations import register_accelerate

    saved = dict(PartialState._shared_state), dict(AcceleratorState._shared_state)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        from accelerate import Accelerator

        plain = Accelerator()
        prepared = plain.prepare(_model())
        return {
            "plain_processes": plain.num_processes,
            "plain_model_type": type(prepared).__name__,
            "plain_error": _error(lambda: register_accelerate(plain, prepared, "topk"), RuntimeError),
        }
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._shared_state.update(saved[0])
        AcceleratorState._shared_state.update(saved[1])


# ---------------------------------------------------------------------------------------------- Lightning
def lightning_fit(
    package: str, strategy: Any, callbacks: list[Any], devices: int = 2, steps: int = 3, module: Any = None
) -> Any:
    """Fit ``module`` (default: a new small regression) with ``package``'s Trainer on CPU; return it.

    ``devices`` processes, ``steps`` optimizer steps.
    """
    import torch

    pl = importlib.import_module("lightning.pytorch" if package == "lightning" else "pytorch_lightning")

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            inputs, targets = batch
            return torch.nn.functional.mse_loss(self.net(inputs), targets)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    inputs = torch.cat([x for x, _ in _batches(0, 4)])
    targets = torch.cat([y for _, y in _batches(0, 4)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=1, strategy=strategy, max_steps=steps,
        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Regression() if module is None else module
    trainer.fit(module, loader)
    return module


def _hook_probe(package: str) -> Any:
    """A callback that records the hooks registered on the strategy's DDP model at the first step."""
    from fastcomm.integrations import registered_comm_hooks

    pl = importlib.import_module("lightning.pytorch" if package == "lightning" else "pytorch_lightning")

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.hooks: list[str] | None = None
            self.model_type = ""

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.hooks is None:
                self.model_type = type(trainer.strategy.model).__name__
                self.hooks = [hook.__name__ for hook, _ in registered_comm_hooks(trainer.strategy.model)]

    return Probe()


def _callback_checks(integration: Any) -> dict[str, Any]:
    """The callback's first-step check, on real DDP models, with a stand-in for the Trainer."""
    from types import SimpleNamespace

    from torch.nn.parallel import DistributedDataParallel

    seen: dict[str, Any] = {}
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=DistributedDataParallel(_model())), world_size=2)
    callback = integration.CommHook("topk", ratio=0.1)
    callback.on_fit_start(trainer, None)
    first_step = callback.on_before_optimizer_step
    seen["not_run_error"] = _error(lambda: first_step(trainer, None, None), RuntimeError)

    module = _model()
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=DistributedDataParallel(module)), world_size=2)
    callback = integration.CommHook("topk", ratio=0.1)
    callback.on_fit_start(trainer, None)
    trainer.strategy.model = DistributedDataParallel(module)  # re-wrapped after fit start: no hook on it
    first_step = callback.on_before_optimizer_step
    seen["rewrapped_error"] = _error(lambda: first_step(trainer, None, None), RuntimeError)
    return seen


def _lightning(rank: int) -> dict[str, Any]:
    import fastcomm

    result: dict[str, Any] = {}
    for package in ("lightning", "pytorch_lightning"):
        if importlib.util.find_spec(package) is None:
            result[package] = "skipped"
            continue
        integration = importlib.import_module(f"fastcomm.integrations.{package}")
        strategies = importlib.import_module(
            "lightning.pytorch.strategies" if package == "lightning" else "pytorch_lightning.strategies")
        seen: dict[str, Any] = {}
        callback = integration.CommHook("topk", ratio=0.1)
        module = lightning_fit(package, "ddp", [callback])
        seen["callback_stats"] = callback.state.stats()
        lightning_fit(package, "ddp", [callback], module=module)  # a new DDP wrapper, the same state
        seen["other_module_error"] = _error(
            lambda package=package, callback=callback: lightning_fit(package, "ddp", [callback]), ValueError)
        seen["refit_stats"] = callback.state.stats()

        # The strategy's own setting: on CPU it registers nothing and the state is never called.
        ignored = fastcomm.TopKState(ratio=0.1)
        probe = _hook_probe(package)
        strategy = strategies.DDPStrategy(ddp_comm_state=ignored, ddp_comm_hook=fastcomm.topk_hook)
        lightning_fit(package, strategy, [probe])
        seen["strategy_model_type"] = probe.model_type
        seen["strategy_hooks"] = probe.hooks
        seen["strategy_stats"] = ignored.stats()
        seen.update(_callback_checks(integration))
        result[package] = seen
    return result


def main() -> None:
    workdir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    import torch

    torch.set_num_threads(1)
    result: dict[str, Any] = {"accelerate": "skipped"}
    if importlib.util.find_spec("accelerate") is not None:
        result["accelerate"] = _accelerate(rank)
    result.update(_lightning(rank))  # Lightning reuses the process group Accelerate made
    (workdir / f"rank{rank}.json").write_text(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
