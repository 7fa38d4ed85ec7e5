"""Checkpoints an interrupted run restarts from: atomic, checksummed, per rank, any world size.

A training script names what it checkpoints once and calls two methods::

    ckpt = fastcomm.Checkpointer("ckpt", every=100, keep=3,
                                 model=ddp.module, optimizer=opt, scheduler=sched, hook=state, loader=loader)
    start = ckpt.restore()                      # 0 when there is none; every rank calls it
    for step in range(start + 1, steps + 1):
        ...
        ckpt.maybe_save(step)                   # every `every` steps; every rank calls it

What is saved: every named object's ``state_dict()`` (anything with ``state_dict``/``load_state_dict``: a
module, an optimizer, an LR scheduler, a fastcomm hook state, a ``fastio.StreamLoader``, a GradScaler), the
RNG states (torch, CUDA, ``random``, NumPy), the step, and ``extra`` (a picklable dict of the script's own).

Layout of ``directory``:

* ``step-000000100/`` one checkpoint: ``rank0.pt`` ... ``rank{W-1}.pt`` (``torch.save`` of each rank's
  states) and ``manifest.json`` (step, world size, and each file's size and SHA-256).
* ``.step-000000100.partial/`` a checkpoint being written. Only a complete one is renamed to its final
  name, so a run killed mid-write leaves a partial directory that is never read (and is removed by the next
  :meth:`Checkpointer.restore`).
* ``step-000000100.corrupt/`` a checkpoint that failed its checksum, kept for inspection, never read again.

Saving (a collective: every rank calls it at the same step):

1. Each rank writes its file into the partial directory, hashing the bytes as they are written, then
   flushes and fsyncs it.
2. The ranks' sizes and hashes are gathered; rank 0 writes ``manifest.json`` (temporary name, fsync,
   rename), renames the directory to its final name, fsyncs ``directory``, and deletes all but the newest
   ``keep`` checkpoints.

Restoring (a collective):

1. Checkpoints are tried newest first. Each rank checks the manifest and the SHA-256 of every file it will
   read; the ranks agree (a checkpoint is used only if it is valid on every rank). An invalid one (a
   flipped byte, a truncated file, a missing manifest) is logged with the reason, renamed ``.corrupt``, and
   the previous one is tried.
2. Same world size: each rank loads its own file, so the run continues bit-identically.
3. Another world size (an elastic restart): each rank reads every old rank's file and merges per object:
   an object whose class has ``merge_state_dicts(states, world_size, rank)`` (fastcomm's hook states:
   residuals re-partitioned; ``fastcomm.DiLoCo``: rank 0's global weights, outer momentum and step, the
   residuals re-partitioned too) uses it; an optimizer takes rank 0's state with every state tensor that
   differs across the old ranks (per-rank momentum) replaced by their mean; anything else takes rank 0's
   state (DDP replicates models, schedules and the loader's position: ``fastio.StreamLoader`` then splits the
   rest of the epoch over the new ranks itself). The RNGs are re-seeded per rank from the checkpoint (old
   streams cannot be split without repeating draws). Each decision is logged once.

Why ``torch.save`` per rank rather than ``torch.distributed.checkpoint``: under DDP every rank holds the whole
model, while error-feedback residuals, compressed-Adam momentum, RNG streams and (for other world sizes) the
loader position are per rank. One file per rank keeps those exact, makes the checksum one hash per file, and
needs no resharding planner. DCP is for sharded models (FSDP, tensor parallel), where no rank holds the whole
state; it deduplicates tensors saved under the same key on several ranks, which would keep one rank's
residuals and silently drop the others'.

The directory must be shared by all ranks (one filesystem), or at least hold every rank's file on every node
that restores (another world size reads every old rank's file).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fastcomm._checkpoint_files import (
    FORMAT,
    STEP_DIR,
    VERSION,
    CheckpointError,
    fsync_dir,
    rank_file,
    step_name,
    verify_checkpoint,
    write_manifest,
    write_rank_file,
)

__all__ = ["CheckpointError", "Checkpointer", "verify_checkpoint"]

logger = logging.getLogger("fastcomm.checkpoint")

def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _reseed(states: Sequence[Mapping[str, Any]], step: int, world_size: int, rank: int) -> None:
    """Seed this rank's RNGs from the old ranks' states, the step and (world size, rank): distinct per rank,
    the same on a rerun of the same restart."""
    entropy = [int(b) for b in hashlib.sha256(
        b"".join(s["torch"].numpy().tobytes() for s in states)
    ).digest()[:16]]
    seq = np.random.SeedSequence(entropy, spawn_key=(int(step), int(world_size), int(rank)))
    words = seq.generate_state(4, dtype=np.uint32)
    torch.manual_seed(int(words[0]) << 32 | int(words[1]))
    random.seed(int(words[2]))
    np.random.seed(int(words[3]))


def _same(a: Any, b: Any) -> bool:
    """Structural equality of two state dicts (tensors compared by value, NaN-aware)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a.nan_to_num(0.0) if a.is_floating_point() else a,
                                                       b.nan_to_num(0.0) if b.is_floating_point() else b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # an object without a usable == (compare what we can; this is a heuristic)
        return a is b


def merge_optimizer_states(states: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], str]:
    """One optimizer ``state_dict`` from every old rank's: rank 0's, with each state tensor that differs
    across ranks replaced by the ranks' mean.

    Under DDP an optimizer that sees averaged gradients (SGD, AdamW) has the same state on every rank, and
    this returns rank 0's unchanged (so does ``fastcomm.CompressedAdam``, whose ranks each adopt the mean
    momentum the hook returns). One that keeps per-rank state (a local-SGD or DiLoCo-style optimizer's own
    momentum) differs: the mean is the state of the ranks' average.

    Raises:
        CheckpointError: a scalar or integer tensor (a step count) or a non-tensor value differs across ranks.

    Example::

        merged, why = merge_optimizer_states([torch.load(p)["objects"]["optimizer"] for p in files])
        optimizer.load_state_dict(merged)
    """
    merged = copy.deepcopy(dict(states[0]))
    averaged = total = 0
    for pid, param_state in merged.get("state", {}).items():
        for key, value in param_state.items():
            others = [s["state"][pid][key] for s in states[1:]]
            if isinstance(value, torch.Tensor):
                total += 1
                if all(_same(value, other) for other in others):
                    continue
                if not value.is_floating_point() or value.dim() == 0:  # a step count, not per-element state
                    raise CheckpointError(f"optimizer state {pid}/{key} ({value.dtype}, shape "
                                          f"{tuple(value.shape)}) differs across ranks; it cannot be "
                                          "averaged")
                param_state[key] = torch.stack([value] + list(others)).mean(0).to(value.dtype)
                averaged += 1
            elif not all(_same(value, other) for other in others):
                raise CheckpointError(
                    f"optimizer state {pid}/{key} differs across ranks: {value!r} vs {others!r}")
    if averaged:
        why = (f"{averaged} of {total} state tensors differed across the {len(states)} old ranks (per-rank "
               "momentum); every new rank starts from their mean")
    else:
        why = f"the same on all {len(states)} old ranks; rank 0's state"
    return merged, why


class Checkpointer:
    """Save and restore a DDP run's state every N steps: atomic, checksummed, with fallback and resharding.

    See the module docstring for the layout and guarantees. Both :meth:`save` and :meth:`restore` are
    collectives: every rank of ``process_group`` calls them at the same point.

    Args:
        directory: where checkpoints live (created; shared by all ranks).
        every: :meth:`maybe_save` saves when ``step % every == 0`` (``0``: never).
        keep: how many complete checkpoints to keep (at least 1; 2 or more leaves a fallback).
        process_group: the group whose ranks save and agree (default: the default group; without an
            initialized process group, a single process).
        run: what identifies the run (JSON values: a method, its options), written in each manifest;
            :meth:`restore` refuses a checkpoint of another ``run`` with a :class:`CheckpointError` that
            names the difference (it is not corrupt, so there is no fallback).
        log: where rank 0 writes its decisions (fallbacks, merges, resumes), e.g. ``print``; default: the
            ``fastcomm.checkpoint`` logger (fallbacks and merges as warnings, resumes as info).
        **objects: name -> object with ``state_dict()`` and ``load_state_dict()``.

    Example::

        ckpt = Checkpointer("ckpt", every=100, keep=3, model=ddp.module, optimizer=opt, loader=loader)
        start = ckpt.restore()
        for step in range(start + 1, 1001):
            train_step()
            ckpt.maybe_save(step)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int = 0,
        keep: int = 2,
        process_group: dist.ProcessGroup | None = None,
        run: Mapping[str, Any] | None = None,
        log: Callable[[str], None] | None = None,
        **objects: Any,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"every must be an int >= 0 (0: never), got {every!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if not objects:
            raise ValueError("name at least one object to checkpoint, e.g. Checkpointer(dir, model=model)")
        for name, obj in objects.items():
            if not all(callable(getattr(obj, method, None)) for method in ("state_dict", "load_state_dict")):
                raise TypeError(f"checkpoint object {name!r} ({type(obj).__name__}) has no state_dict() and "
                                "load_state_dict()")
        self.directory = Path(directory)
        self.every, self.keep = every, keep
        self.process_group = process_group
        self.objects = dict(objects)
        try:
            self.run = json.loads(json.dumps(dict(run or {})))
        except (TypeError, ValueError) as error:
            raise TypeError(f"run must hold JSON values (str, number, bool, list, dict): {error}") from None
        self.extra: dict[str, Any] = {}
        self.restored_from: Path | None = None
        self._log = log

    # ----------------------------------------------------------------------------------------- helpers
    def _world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        return 1, 0

    def _say(self, message: str, warn: bool = False) -> None:
        if self._log is not None:
            self._log(message)
        else:
            (logger.warning if warn else logger.info)(message)

    def _gather(self, value: Any) -> list[Any]:
        world, _ = self._world()
        if world == 1:
            return [value]
        out: list[Any] = [None] * world
        dist.all_gather_object(out, value, group=self.process_group)
        return out

    def _barrier(self) -> None:
        if self._world()[0] > 1:
            dist.barrier(group=self.process_group)

    def steps(self) -> list[int]:
        """The steps of the complete-looking checkpoints in ``directory``, newest first (not verified).

        Example::

            Checkpointer("ckpt", model=model).steps()   # e.g. [300, 200]
        """
        if not self.directory.is_dir():
            return []
        found = [int(m.group(1)) for p in self.directory.iterdir() if (m := STEP_DIR.match(p.name))]
        return sorted(found, reverse=True)

    def path_of(self, step: int) -> Path:
        """The directory of step ``step``'s checkpoint."""
        return self.directory / step_name(step)

    # ------------------------------------------------------------------------------------------- save
    def maybe_save(self, step: int, extra: Mapping[str, Any] | None = None) -> Path | None:
        """:meth:`save` when ``every`` divides ``step``; else nothing. Every rank calls it every step."""
        if self.every and step % self.every == 0:
            return self.save(step, extra)
        return None

    def write_file(self, path: Path, payload: Mapping[str, Any]) -> tuple[int, str]:
        """Write this rank's file of a checkpoint, fsynced; return its size in bytes and its SHA-256 (hex).

        :meth:`save` calls it once per rank and step, inside the checkpoint's temporary directory, before
        the manifest is written; the payload's ``"step"`` and ``"rank"`` say which file it is. Meant to be
        overridden: to write somewhere else, or to fail in the middle of a write (the fault-tolerance
        tests kill a rank here). An override returns what is on disk, as :meth:`restore` checks it.

        Example::

            class Counting(Checkpointer):
                def write_file(self, path, payload):
                    print(f"rank {payload['rank']} writes step {payload['step']}")
                    return super().write_file(path, payload)
        """
        return write_rank_file(path, payload)

    def save(self, step: int, extra: Mapping[str, Any] | None = None) -> Path:
        """Write checkpoint ``step`` (every rank calls it) and return its directory.

        Args:
            step: the number of completed steps (what :meth:`restore` returns).
            extra: a picklable dict saved with it (default: ``self.extra``), restored into ``self.extra``.

        Example::

            ckpt.save(500, extra={"val_losses": losses})
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        world, rank = self._world()
        final = self.path_of(step)
        partial = self.directory / f".{final.name}.partial"
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        self._barrier()
        if extra is not None:
            self.extra = dict(extra)
        payload = {
            "format": FORMAT, "version": VERSION, "step": step, "world_size": world, "rank": rank,
            "objects": {name: obj.state_dict() for name, obj in self.objects.items()},
            "rng": _rng_state(), "extra": self.extra,
        }
        size, digest = self.write_file(partial / rank_file(rank), payload)
        files = self._gather((rank_file(rank), size, digest))
        if rank == 0:
            manifest = {
                "format": FORMAT, "version": VERSION, "step": step, "world_size": world,
                "objects": sorted(self.objects), "run": self.run, "created": time.time(),
                "files": {name: {"bytes": size, "sha256": digest} for name, size, digest in files},
            }
            write_manifest(partial, manifest)
            fsync_dir(partial)
            if final.exists():  # a checkpoint of this step from before a fallback: replace it
                stale = self.directory / f".{final.name}.stale-{os.getpid()}"
                os.rename(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(partial, final)
            fsync_dir(self.directory)
            for old in self.steps()[self.keep:]:
                shutil.rmtree(self.path_of(old), ignore_errors=True)
        self._barrier()
        return final

    # ---------------------------------------------------------------------------------------- restore
    def restore(self, path: str | os.PathLike[str] | None = None) -> int:
        """Load the newest valid checkpoint into the objects; return its step (``0`` if there is none).

        Every rank calls it. Sets ``self.extra`` (the saved ``extra``) and ``self.restored_from``.

        Args:
            path: restore this ``step-*`` directory only (no fallback) instead of the newest valid one.

        Raises:
            CheckpointError: ``path`` is invalid, or a checkpoint lacks one of the objects.

        Example::

            start = ckpt.restore()
            print(f"resuming after step {start}" if start else "starting fresh")
        """
        world, rank = self._world()
        if rank == 0 and self.directory.is_dir():
            for stale in self.directory.glob(".step-*"):  # partial writes of a run that was killed
                shutil.rmtree(stale, ignore_errors=True)
        candidates = [Path(path)] if path is not None else [self.path_of(s) for s in self.steps()]
        self._barrier()  # rank 0's cleanup happens before anyone reads
        for candidate in candidates:
            try:
                manifest = verify_checkpoint(candidate, ranks=())  # the manifest alone
                old_world = int(manifest["world_size"])
                verify_checkpoint(candidate, [rank] if old_world == world else None)
                problem = None
            except (CheckpointError, OSError, ValueError, KeyError, TypeError) as error:
                problem = str(error)
            problems = [p for p in self._gather(problem) if p is not None]
            if problems:
                if path is not None:
                    raise CheckpointError(f"checkpoint {candidate} is unusable: {problems[0]}")
                older = [c for c in candidates if c.name < candidate.name]
                then = f"trying {older[0].name}" if older else "starting from step 0"
                if rank == 0:
                    reasons = "; ".join(sorted(set(problems)))
                    self._say(f"fastcomm.checkpoint: {candidate} is unusable ({reasons}); renamed to "
                              f"{candidate.name}.corrupt; {then}", warn=True)
                    target = candidate.with_name(candidate.name + ".corrupt")
                    shutil.rmtree(target, ignore_errors=True)
                    os.rename(candidate, target)
                self._barrier()
                continue
            saved_run = manifest.get("run", {})
            if saved_run != self.run:
                keys = set(saved_run) | set(self.run)
                differ = sorted(k for k in keys if saved_run.get(k) != self.run.get(k))
                raise CheckpointError(
                    f"checkpoint {candidate} is of another run: " + "; ".join(
                        f"{k}: saved {saved_run.get(k)!r}, this run {self.run.get(k)!r}" for k in differ)
                    + f". Use another directory than {self.directory}, or remove it to start afresh.")
            step = self._load(candidate, manifest, world, rank)
            self.restored_from = candidate
            return step
        self.extra, self.restored_from = {}, None
        return 0

    def _load(self, path: Path, manifest: Mapping[str, Any], world: int, rank: int) -> int:
        old_world = int(manifest["world_size"])
        if old_world == world:
            payloads = [torch.load(path / rank_file(rank), map_location="cpu", weights_only=False)]
        else:
            payloads = [torch.load(path / rank_file(r), map_location="cpu", weights_only=False)
                        for r in range(old_world)]
        missing = sorted(set(self.objects) - set(payloads[0]["objects"]))
        if missing:
            raise CheckpointError(f"checkpoint {path} has no state for {missing} (it holds "
                                  f"{sorted(payloads[0]['objects'])})")
        step = int(payloads[0]["step"])
        if old_world == world:
            for name, obj in self.objects.items():
                obj.load_state_dict(payloads[0]["objects"][name])
            _set_rng_state(payloads[0]["rng"])
            self.extra = dict(payloads[0]["extra"])
            if rank == 0:
                self._say(f"fastcomm.checkpoint: resumed at step {step} from {path}")
            return step
        decisions = []
        for name, obj in self.objects.items():
            states = [p["objects"][name] for p in payloads]
            merge = getattr(type(obj), "merge_state_dicts", None)
            if merge is not None:
                state, why = merge(states, world, rank)
            elif isinstance(obj, torch.optim.Optimizer):
                state, why = merge_optimizer_states(states)
            else:
                same = all(_same(states[0], s) for s in states[1:])
                state = states[0]
                why = ("the same on every old rank; rank 0's state" if same
                       else "differs across the old ranks; rank 0's state is used")
            obj.load_state_dict(state)
            decisions.append(f"{name}: {why}")
        _reseed([p["rng"] for p in payloads], step, world, rank)
        decisions.append("RNG: re-seeded per rank (old per-rank streams cannot be split across another world "
                         "size without repeating draws)")
        self.extra = dict(payloads[0]["extra"])
        if rank == 0:
            self._say(f"fastcomm.checkpoint: resumed at step {step} from {path}, saved by {old_world} ranks, "
                      f"now {world}: " + "; ".join(decisions), warn=True)
        return step
