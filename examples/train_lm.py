"""Train a small byte-level GPT on the Python standard library's own source, with a fastcomm hook.

A user's script, and the one training loop that ``benchmarks/bench_convergence.py`` runs (the benchmarks
name their methods in ``benchmarks/lm_methods.py`` and pass them here as ``--optimizer``, ``--hook`` and
``--opt``). What it does:

1. Data (``lm_data.py``): the running Python's stdlib ``.py`` files as fastio shards of 129-byte windows,
   every 20th file held out; ``fastio.StreamLoader(shuffle=True, seed=seed)`` gives each rank a disjoint
   share of one global order.
2. Model (``lm_model.py``): a GPT of 1,457,856 parameters (d_model 192, 3 layers, 4 heads, context 128).
3. Training: DDP over gloo (or, with ``--fsdp``, FSDP2: ``fully_shard`` on every block and the root, the
   hook's compressor through ``fastcomm.fsdp.compress``), the optimizer (AdamW lr 2e-3, betas (0.9, 0.95),
   weight decay 0.1; SGD lr 0.1; ``fastcomm.CompressedAdam``; or ``fastcomm.DiLoCo`` with AdamW inner
   steps and no DDP), a linear warm-up of 30 steps then cosine decay to 0 at ``--steps``, batch 16 x 128
   tokens per rank, and the communication hook (``--hook``: a :func:`fastcomm.register` name, torch's
   ``torch_fp16``, ``noop`` for no communication at all, or ``none`` for dense allreduce).
4. Every ``--eval-every`` steps and at the end: validation loss on ``--val-rows`` held-out rows per rank
   (the same rows for every run), averaged over ranks.
5. Every ``--checkpoint-every`` steps: ``fastcomm.Checkpointer`` writes one file per rank (model,
   optimizer, LR schedule, hook state, loader state, RNG, step) atomically; ``--resume`` continues.

Run::

    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --hook sign --steps 500
    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --hook quantize --opt bits=8 \
        --checkpoint-every 100 --resume
    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --optimizer diloco --opt sync_every=10
    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --fsdp --hook quantize --opt bits=8

Example::

    import sys; sys.path.insert(0, "examples")
    import train_lm
    paths = train_lm.prepare_data(train_lm.default_data_dir())
    # in each of 2 ranks, after dist.init_process_group("gloo"):
    result = train_lm.train(train_lm.TrainConfig(hook="quantize", options={"bits": 8}), paths)
    print(result.val_losses[-1])
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lm_data import VAL_SEED, DataPaths, EpochStream, default_data_dir, loader, prepare_data
from lm_model import GPT, ModelConfig
from lm_optim import (
    BASE_LR,
    BETAS,
    OPTIMIZERS,
    WEIGHT_DECAY,
    build_ddp,
    build_fsdp,
    diloco_arguments,
    fsdp_unavailable,
    lr_factor,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fastcomm
import fastcomm.fault
import fastio

__all__ = [
    "GPT",
    "OPTIMIZERS",
    "DataPaths",
    "ModelConfig",
    "TrainConfig",
    "TrainResult",
    "argument_parser",
    "default_data_dir",
    "diloco_arguments",
    "fsdp_unavailable",
    "main",
    "prepare_data",
    "train",
]


# ---------------------------------------------------------------------------------------------------------
# Checkpoints and sample ids


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class _SampleLog:
    """``--sample-log DIR``: each rank appends ``step epoch id id ...`` (the batch's sample ids) to
    ``DIR/rank{r}.log`` and writes its pid to ``DIR/rank{r}.pid``; a restart appends replayed steps again."""

    def __init__(self, directory: Path | None, rank: int) -> None:
        self.handle = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"rank{rank}.pid").write_text(str(os.getpid()))
            self.handle = open(directory / f"rank{rank}.log", "a", buffering=1)

    def write(self, step: int, epoch: int, ids: torch.Tensor) -> None:
        if self.handle is not None:
            self.handle.write(f"{step} {epoch} {' '.join(map(str, ids.tolist()))}\n")


# ---------------------------------------------------------------------------------------------------------
# Training


@dataclasses.dataclass
class TrainConfig:
    """One run: optimizer, hook and their options, length and schedule, data and model shape, checkpoints.

    ``optimizer``: one of :data:`OPTIMIZERS`; ``hook``: a :func:`fastcomm.register` name, ``"torch_fp16"``,
    ``"noop"`` (no communication: the compute floor) or ``"none"`` (dense allreduce); ``options`` go to
    ``fastcomm.register`` (or to ``CompressedAdam``, or ``DiLoCo`` through :func:`diloco_arguments`).
    """

    optimizer: str = "adamw"
    hook: str = "none"
    steps: int = 500
    seed: int = 0
    data_seed: int | None = None  # the training data order's seed (None: seed, which also sets the weights)
    batch_size: int = 16
    warmup_steps: int = 30
    lr: float | None = None  # None: the optimizer's BASE_LR
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    eval_every: int = 50  # 0: only at the end
    val_rows: int = 128  # validation rows per rank
    log_every: int = 10  # 0: no progress lines
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 2  # complete checkpoints kept (the newest, and one to fall back on)
    resume: Path | None = None  # a checkpoint_dir (its newest valid checkpoint, if any) or a step directory
    sample_log: Path | None = None  # where each rank logs its batches' sample ids (see _SampleLog)
    final_state: Path | None = None  # rank 0 saves the final model and optimizer state here
    stop_after: int | None = None  # end the run after this step (as if killed), for resume tests
    schedule_steps: int | None = None  # the cosine's length (default: steps)
    fsdp: bool = False  # FSDP2 (fully_shard on every block and the root) instead of DDP

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        for name in ("steps", "batch_size", "val_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "log_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        if self.checkpoint_keep < 1:
            raise ValueError(f"TrainConfig.checkpoint_keep must be >= 1, got {self.checkpoint_keep}")
        if self.fsdp:
            reason = fsdp_unavailable(self.optimizer, self.hook)
            if reason:
                raise ValueError(f"TrainConfig.fsdp: {reason}")
            if self.checkpoint_every or self.resume is not None or self.final_state is not None:
                raise ValueError("TrainConfig.fsdp: checkpoints and final_state are DDP-only here (FSDP2 "
                                 "saves through DCP, see docs/fsdp.md)")


@dataclasses.dataclass
class TrainResult:
    """What a run measured: validation loss by step; training loss, step time (slowest rank) and rank 0's
    backward and optimizer-step times by step."""

    optimizer: str
    hook: str
    options: dict[str, Any]
    parameters: int
    start_step: int
    val_steps: list[int]
    val_losses: list[float]
    train_losses: list[float]  # the mean over ranks, steps start_step + 1 ... steps
    step_seconds: list[float]  # the slowest rank's time of each of those steps
    backward_seconds: list[float]  # rank 0's backward (with the hook's communication) of each step
    optimizer_seconds: list[float]  # rank 0's optimizer.step() of each step
    hook_stats: dict[str, float | str] | None
    lrs: list[float] = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), default=str)


@torch.no_grad()
def _val_loss(model: GPT, loader: fastio.StreamLoader, rows: int) -> float:
    """Mean loss over the first ``rows`` validation windows of this rank (a fixed shuffled order), averaged
    over ranks."""
    total = torch.zeros(2, dtype=torch.float64)
    width = model.config.context + 1
    for batch in loader:
        tokens = batch["tokens"][: rows - int(total[1].item()), :width].long()
        total[0] += model(tokens[:, :-1], tokens[:, 1:]).item() * tokens.shape[0]
        total[1] += tokens.shape[0]
        if total[1] >= rows:
            break
    dist.all_reduce(total)
    if total[1] == 0:
        raise RuntimeError("the validation set has no rows: prepare more files (max_files)")
    return float(total[0] / total[1])


def train(
    config: TrainConfig,
    paths: DataPaths,
    log: Callable[[str], None] | None = None,
    checkpointer: Callable[..., fastcomm.Checkpointer] = fastcomm.Checkpointer,
) -> TrainResult:
    """Train on this rank of the initialised process group and return what the run measured.

    Every rank must call it with the same ``config``. Steps are numbered from 1; step ``s`` is done once
    ``s`` optimizer steps are. Validation runs after every ``eval_every``-th step and after the last.

    Args:
        config: the run.
        paths: the prepared data (:func:`prepare_data`).
        log: where rank 0 writes progress lines (default: none); ranks > 0 never log.
        checkpointer: makes the checkpointer (``fastcomm.Checkpointer``'s arguments), e.g. a subclass
            that writes elsewhere.

    Returns:
        A :class:`TrainResult` (the same on every rank; hook stats are this rank's).

    Example::

        dist.init_process_group("gloo")
        result = train(TrainConfig(hook="sign", steps=100), prepare_data(default_data_dir()))
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    options = dict(config.options)
    lr = config.lr if config.lr is not None else BASE_LR[config.optimizer]
    label = f"{config.hook} ({config.optimizer})"
    schedule_steps = config.schedule_steps or config.steps

    def say(line: str) -> None:
        if rank == 0 and log is not None:
            log(line)

    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed)
    model = GPT(config.model)
    parameters = sum(p.numel() for p in model.parameters())
    outer: fastcomm.DiLoCo | None = None
    if config.optimizer == "diloco":  # no DDP: each rank trains on its own batches between syncs
        net: nn.Module = model
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        outer = fastcomm.DiLoCo(model, optimizer, **diloco_arguments(options))
        hook_state: Any = outer
    elif config.fsdp:
        net = model
        optimizer, hook_state = build_fsdp(config.optimizer, config.hook, model, lr, options)
    else:
        net = DistributedDataParallel(model)
        optimizer, hook_state = build_ddp(config.optimizer, config.hook, net, lr, options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.warmup_steps, schedule_steps)
    )
    context = config.model.context
    data_seed = config.seed if config.data_seed is None else config.data_seed
    train_loader = loader(paths.train, config.batch_size, data_seed, rank, world)
    val_loader = loader(paths.val, config.batch_size, VAL_SEED, rank, world)
    stream = EpochStream(train_loader)

    start_step = 0
    val_steps: list[int] = []
    val_losses: list[float] = []
    ckpt = None
    if config.checkpoint_every or config.resume is not None:
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                   "loader": train_loader}
        if hook_state is not None:
            objects["hook"] = hook_state
        directory = config.checkpoint_dir or config.resume
        run = {"optimizer": config.optimizer, "hook": config.hook, "options": options}
        ckpt = checkpointer(directory, every=config.checkpoint_every, keep=config.checkpoint_keep, run=run,
                            log=say, **objects)
    if config.resume is not None:
        assert ckpt is not None
        directory = Path(config.resume)
        start_step = ckpt.restore(directory if (directory / "manifest.json").exists() else None)
        if start_step:
            val_steps, val_losses = ckpt.extra["val_steps"], ckpt.extra["val_losses"]
            say(f"[train_lm] resumed {label} at step {start_step} from {ckpt.restored_from}")
        else:
            say(f"[train_lm] no checkpoint in {directory}: starting at step 0")
    samples = _SampleLog(config.sample_log, rank)

    say(f"[train_lm] {label}{' under FSDP2' if config.fsdp else ''}; "
        f"options {options}; {parameters:,} parameters; "
        f"{world} ranks x {config.batch_size} x {context} tokens; lr {lr} (warm-up {config.warmup_steps}, "
        f"cosine to step {schedule_steps}); data {paths.train_files} train / {paths.val_files} val files")

    train_losses: list[float] = []
    step_seconds: list[float] = []
    backward_seconds: list[float] = []
    optimizer_seconds: list[float] = []
    lrs: list[float] = []
    last = config.steps if config.stop_after is None else min(config.steps, config.stop_after)
    window_start = time.perf_counter()
    for step in range(start_step + 1, last + 1):
        begin = time.perf_counter()
        batch = stream.next()
        samples.write(step, train_loader.epoch, batch["index"])
        tokens = batch["tokens"][:, : context + 1].long()
        optimizer.zero_grad(set_to_none=True)
        loss = net(tokens[:, :-1], tokens[:, 1:])
        backward_begin = time.perf_counter()
        loss.backward()
        optimizer_begin = time.perf_counter()
        (optimizer if outer is None else outer).step()
        if outer is not None and step == config.steps:
            outer.finish()  # the exchanges still in flight, before the last evaluation
        optimizer_end = time.perf_counter()
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.step()
        step_seconds.append(time.perf_counter() - begin)
        backward_seconds.append(optimizer_begin - backward_begin)
        optimizer_seconds.append(optimizer_end - optimizer_begin)
        train_losses.append(loss.item())
        if not math.isfinite(train_losses[-1]):
            raise FloatingPointError(f"{label}: training loss {train_losses[-1]} at step {step}")
        if config.log_every and step % config.log_every == 0:
            seconds = time.perf_counter() - window_start
            tokens_per_s = config.log_every * world * tokens.numel() / seconds
            say(f"[train_lm] step {step}/{config.steps} loss {train_losses[-1]:.4f} lr {lrs[-1]:.2e} "
                f"{seconds / config.log_every:.3f} s/step {tokens_per_s:,.0f} tokens/s")
            window_start = time.perf_counter()
        if (config.eval_every and step % config.eval_every == 0) or step == config.steps:
            val_steps.append(step)
            val_losses.append(_val_loss(model, val_loader, config.val_rows))
            say(f"[train_lm] step {step} val loss {val_losses[-1]:.4f}")
            window_start = time.perf_counter()
        if ckpt is not None and ckpt.maybe_save(step, {"val_steps": val_steps, "val_losses": val_losses}):
            say(f"[train_lm] checkpoint step {step} -> {ckpt.path_of(step)}")
            window_start = time.perf_counter()

    if config.final_state is not None and rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": last},
                   config.final_state)
    # One collective for the per-step numbers: the mean training loss and the slowest rank's time.
    losses = torch.tensor(train_losses, dtype=torch.float64)
    seconds = torch.tensor(step_seconds, dtype=torch.float64)
    dist.all_reduce(losses)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    stats = hook_state.stats() if hook_state is not None and hasattr(hook_state, "stats") else None
    return TrainResult(
        optimizer=config.optimizer, hook=config.hook, options=options, parameters=parameters,
        start_step=start_step, val_steps=val_steps, val_losses=val_losses,
        train_losses=(losses / world).tolist(), step_seconds=seconds.tolist(),
        backward_seconds=backward_seconds, optimizer_seconds=optimizer_seconds,
        hook_stats={k: float(v) if isinstance(v, (int, float)) else str(v) for k, v in stats.items()}
        if stats else None, lrs=lrs,
    )


# ---------------------------------------------------------------------------------------------------------
# Command line


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--opt wants key=value, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value  # a bare word: a string option (compressor=sign)


def argument_parser() -> argparse.ArgumentParser:
    """The command line of :func:`main` (``--optimizer``, ``--hook``, ``--opt key=value``, ...).

    Example::

        args = argument_parser().parse_args(["--hook", "quantize", "--opt", "bits=8"])
        dict(args.opt)  # {"bits": 8}
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument("--hook", default="none",
                        help="a fastcomm.register name (quantize, sign, topk, powersgd, cast, ...), "
                             "torch_fp16, noop (no communication) or none (dense allreduce)")
    parser.add_argument("--opt", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                        help="an option of the hook or optimizer (repeatable; a later one wins)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--lr", type=float, default=None, help="base learning rate (default by optimizer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16, help="rows of 128 tokens per rank")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--val-rows", type=int, default=128, help="validation rows per rank")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--data-dir", type=Path, default=None, help="shard cache (default: ~/.cache/...)")
    parser.add_argument("--max-files", type=int, default=None, help="use an evenly spaced subset of files")
    parser.add_argument("--d-model", type=int, default=ModelConfig.d_model)
    parser.add_argument("--n-layer", type=int, default=ModelConfig.n_layer)
    parser.add_argument("--n-head", type=int, default=ModelConfig.n_head)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints/train_lm"))
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: none)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None,
                        help="resume from the checkpoint dir's latest, or from the given step directory")
    parser.add_argument("--stop-after", type=int, default=None, help="end after this step (as if killed)")
    parser.add_argument("--schedule-steps", type=int, default=None, help="cosine length (default --steps)")
    parser.add_argument("--json", type=Path, default=None, help="rank 0 writes the TrainResult here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=None,
                        help="collective timeout in seconds: how long a rank waits for a silent peer "
                             "before it fails (default: FASTCOMM_TIMEOUT, else 300)")
    parser.add_argument("--checkpoint-keep", type=int, default=2, help="complete checkpoints kept")
    parser.add_argument("--sample-log", type=Path, default=None, help="log each batch's sample ids here")
    parser.add_argument("--final-state", type=Path, default=None,
                        help="rank 0 saves the final model and optimizer state_dicts here")
    parser.add_argument("--fsdp", action="store_true",
                        help="FSDP2 (fully_shard every block and the root; the hook's compressor through "
                             "fastcomm.fsdp.compress) instead of DDP")
    return parser


@fastcomm.fault.exit_on_peer_loss
def main(
    argv: Sequence[str] | None = None,
    checkpointer: Callable[..., fastcomm.Checkpointer] = fastcomm.Checkpointer,
) -> int:
    """The torchrun entry point: parse arguments, join the gloo group, prepare data, train, report.

    ``checkpointer`` is :func:`train`'s (the fault-tolerance tests pass one that fails on purpose).

    Example::

        main(["--hook", "quantize", "--opt", "bits=8", "--steps", "100"])  # in each torchrun rank
    """
    args = argument_parser().parse_args(argv)

    torch.set_num_threads(args.threads)
    fastcomm.fault.init_process_group("gloo", timeout=args.timeout)
    try:
        data_dir = args.data_dir or default_data_dir()
        if dist.get_rank() == 0:
            paths = prepare_data(data_dir, args.max_files)
        dist.barrier()
        if dist.get_rank() != 0:
            paths = prepare_data(data_dir, args.max_files)
        resume = None
        if args.resume is not None:
            resume = args.checkpoint_dir if args.resume == "latest" else Path(args.resume)
        config = TrainConfig(
            optimizer=args.optimizer, hook=args.hook, options=dict(args.opt), steps=args.steps,
            seed=args.seed, batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every,
            val_rows=args.val_rows, log_every=args.log_every,
            model=ModelConfig(d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head),
            checkpoint_dir=args.checkpoint_dir if args.checkpoint_every else None,
            checkpoint_every=args.checkpoint_every, checkpoint_keep=args.checkpoint_keep, resume=resume,
            stop_after=args.stop_after, sample_log=args.sample_log, final_state=args.final_state,
            schedule_steps=args.schedule_steps, fsdp=args.fsdp,
        )
        with fastcomm.fault.peer_guard():
            say = functools.partial(print, file=sys.stderr, flush=True)
            result = train(config, paths, log=say, checkpointer=checkpointer)
        if dist.get_rank() == 0:
            if result.val_losses:
                print(f"[train_lm] {args.hook}: val loss {result.val_losses[-1]:.4f} at step "
                      f"{result.val_steps[-1]}; median {np.median(result.step_seconds):.3f} s/step",
                      file=sys.stderr, flush=True)
            if args.json is not None:
                _atomic_write_text(result.to_json(), args.json)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
