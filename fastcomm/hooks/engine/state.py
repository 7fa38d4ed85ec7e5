""":class:`HookState`, the base of every hook state: options, the model it serves, iterations, checkpoints.

Parameters get an integer key each, in the order the state first sees them (the same in a fresh process
for the same model and DDP configuration); a bucket layout is named by its parameters' keys. A state
remembers the parameters it serves; handing it to a second model is an error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from fastcomm.collectives import completed, ring_bytes, then
from fastcomm.collectives.errors import collective_value
from fastcomm.compress.protocol import all_finite, scale_all_finite_
from fastcomm.hooks.engine.accounting import COUNTERS, StepAccounting
from fastcomm.hooks.engine.options import OptionTypeError
from fastcomm.hooks.engine.reshard import describe, keep_if_same_world, merge_counters
from fastcomm.hooks.engine.util import BucketKey

__all__ = ["HookState"]

_log = logging.getLogger("fastcomm.hooks")


class HookState:
    """Base of every hook state: process group, the served model, step accounting, statistics, pickling.

    Subclasses list their user-facing options in ``_OPTIONS`` (constructor keyword names); those, not the
    process group, are what pickling keeps. Hooks use :attr:`accounting` and the methods without a leading
    underscore; subclasses that keep per-step tensors override :meth:`_end_iteration`.

    Args:
        process_group: the group to reduce over; ``None`` for the default group.

    Example::

        state = fastcomm.CastState(torch.bfloat16)
        restored = pickle.loads(pickle.dumps(state))  # same options and counters, default process group
    """

    _OPTIONS: tuple[str, ...] = ()

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise OptionTypeError(
                f"process_group must be None or a torch.distributed.ProcessGroup, got {process_group!r} "
                f"({type(process_group).__name__})"
            )
        self.process_group = process_group
        self._log_every = 0
        self._reset_internal()

    def _reset_internal(self) -> None:
        # parameters: identity -> integer key (module order once bound, else first-seen); the bound model
        self._param_keys: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._next_param_key = 0
        self._bound_params: WeakIdKeyDictionary | None = None
        self.accounting = StepAccounting()

    # ------------------------------------------------------------------------------------------ options
    def options(self) -> dict[str, Any]:
        """The constructor options this state was made with (without the process group)."""
        return {name: getattr(self, name) for name in self._OPTIONS}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({fields})"

    # ------------------------------------------------------------------------------------------ binding
    def bind(self, module: torch.nn.Module) -> None:
        """Tie this state to the parameters of ``module`` (``register()`` does this).

        Raises:
            ValueError: the state already serves another model.
        """
        params = [p for p in module.parameters() if p.requires_grad]
        if self._bound_params is not None:
            if all(p in self._bound_params for p in params):
                return
            raise ValueError(
                f"this {type(self).__name__} is already registered on another model; a state holds "
                f"per-bucket residuals and a step counter for one model, so create one state per DDP model"
            )
        if len(self._param_keys) and not all(p in self._param_keys for p in params):
            raise ValueError(f"this {type(self).__name__} has already served another model's buckets")
        self._bound_params = WeakIdKeyDictionary({p: True for p in params})
        if not len(self._param_keys):
            # keys in module order: the same in every process for the same model whichever bucket layout
            # the state first sees (CompressedAdam's compressor first sees buckets after warm-up, under
            # DDP's rebuilt layout, a resumed run's under the initial one), so checkpoints map back
            for param in params:
                self._param_keys[param] = self._next_param_key
                self._next_param_key += 1

    def param_key(self, param: Tensor) -> int | None:
        """The integer key of ``param``, or ``None`` if this state has not seen it."""
        return self._param_keys.get(param)

    def _bucket_key(self, bucket: dist.GradBucket) -> BucketKey:
        keys = []
        for param in bucket.parameters():
            key = self._param_keys.get(param)
            if key is None:
                foreign = (self._bound_params is not None and param not in self._bound_params) or (
                    self._bound_params is None and self.accounting.iterations_seen > 1
                )
                if foreign:
                    raise ValueError(
                        f"{type(self).__name__} got a bucket with parameters of another model: a state is "
                        f"registered on two models. Create one state per DDP model."
                    )
                key = self._next_param_key
                self._param_keys[param] = key
                self._next_param_key += 1
            keys.append(key)
        return tuple(keys)

    # --------------------------------------------------------------------------------------- iterations
    def begin_bucket(self, bucket: dist.GradBucket) -> BucketKey:
        """Start of a hook call: a new iteration at bucket 0, then the bucket's parameter key."""
        if bucket.index() == 0:
            self._finish_iteration()
            self.accounting.open_iteration()
        else:
            self.accounting.note_call()
        return self._bucket_key(bucket)

    def _finish_iteration(self) -> None:
        """Close the open iteration, if any, and let the subclass commit or drop what it staged."""
        finite = self.accounting.close_iteration()
        if finite is not None:
            self._end_iteration(finite)
            every = self._log_every
            if every and (self.accounting.iterations_seen % every == 0):
                _log.info("%s", self.summary())

    def _end_iteration(self, finite: bool) -> None:
        """An iteration closed: a step (``finite``) or a skipped one. Subclasses commit or drop here."""

    def dense_allreduce(self, buffer: Tensor, world_size: int, bucket: int) -> torch.futures.Future[Tensor]:
        """Mean over ranks by one async allreduce.

        fp32: the sum is divided by the world size when it arrives, in the same pass that checks it for
        non-finite values (:func:`~fastcomm.compress.protocol.scale_all_finite_`, off the backward's
        thread): one pass where dividing first and checking after took two. fp16 and bf16 are divided
        first, so the sum cannot overflow. ``bucket`` (the DDP bucket index) names the bucket in the error
        a failed allreduce raises.
        """
        after = buffer.dtype == torch.float32
        tensor = buffer if after else buffer.div_(world_size)
        work = dist.all_reduce(tensor, group=self.process_group, async_op=True)
        dense = ring_bytes(tensor.numel(), tensor.element_size(), world_size)
        self.accounting.count(dense, dense, 0.0, compressed=False)

        def finish(future: torch.futures.Future[list[Tensor]]) -> Tensor:
            result = collective_value(future, f"{type(self).__name__} dense allreduce", bucket)[0]
            finite = scale_all_finite_(result, 1.0 / world_size) if after else all_finite(result)
            self.accounting.note_output(finite)
            return result

        return then(work.get_future(), finish)

    def local(self, buffer: Tensor) -> torch.futures.Future[Tensor]:
        """World size 1: the gradient is already the mean; only the step accounting runs."""
        self.accounting.note_output(all_finite(buffer))
        self.accounting.count(0, 0, 0.0, compressed=False)
        return completed(buffer)

    # ------------------------------------------------------------------------------------------- public
    def log_every(self, iterations: int) -> None:
        """Log :meth:`summary` at INFO on the ``fastcomm.hooks`` logger every ``iterations`` (0: never).

        Example::

            logging.basicConfig(level=logging.INFO)
            state.log_every(100)
        """
        if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 0:
            raise ValueError(f"iterations must be a non-negative int, got {iterations!r}")
        self._log_every = iterations

    def summary(self) -> str:
        """One line: the step time, the communication it shows and its share, the bytes sent, the link rate.

        Example::

            print(state.summary())  # "SignState step 200: 412.0 ms/step, communication shown 35.1 ms ..."
        """
        stats = self.accounting.stats()
        iterations = max(1, int(stats["steps"]) + int(stats["skipped_steps"]))
        return (
            f"{type(self).__name__} step {stats['steps']}: {stats['step_seconds'] * 1e3:.1f} ms/step, "
            f"communication shown {stats['exposed_comm_seconds'] * 1e3:.1f} ms ({stats['comm_share']:.0%}), "
            f"{stats['sent_bytes'] / iterations / 1e6:.2f} MB sent/step "
            f"({stats['compression_ratio']:.1f}x less than dense), "
            f"link {stats['link_bytes_per_second'] / 1e6:.1f} MB/s"
        )

    @property
    def steps(self) -> int:
        """Optimizer steps really taken (iterations whose reduced gradients were all finite)."""
        self._finish_iteration()
        return self.accounting.steps

    def stats(self) -> dict[str, float | int]:
        """Counters since construction (or since the checkpoint they were restored from).

        Returns:
            A dict with ``steps`` (finite iterations), ``skipped_steps`` (iterations with inf/NaN, which
            GradScaler skips), ``sent_bytes`` (bytes this rank put on the wire: ``(W-1)/W`` of an
            all-to-all's send buffer, ``W-1`` times an all-gather's payload, a ring allreduce's
            ``2(W-1)/W``; FSDP and DiLoCo report theirs under the same name, through
            :class:`fastcomm.collectives.Traffic`), ``bytes_sent`` (the same number, the name of earlier
            releases), ``dense_bytes`` (what a ring allreduce of the same buckets in their own dtype
            would have sent), ``compression_ratio`` (``dense_bytes / sent_bytes``, 1.0 when nothing was
            sent), ``compress_seconds`` (time in compression and decompression, not in collectives),
            ``compressed_buckets`` and ``dense_buckets`` (hook calls of each kind); where the step's
            time goes, measured on this rank (:class:`~fastcomm.hooks.engine.accounting.StepTimes`):
            ``step_seconds``, ``exposed_comm_seconds`` (what the optimizer waits for after the backward),
            ``comm_share`` (their ratio), ``comm_window_seconds`` and ``link_bytes_per_second``.

        Example::

            stats = state.stats()
            print(f"{stats['compression_ratio']:.1f}x less traffic, {stats['skipped_steps']} steps skipped")
        """
        self._finish_iteration()
        return self.accounting.stats()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically, without the process group.

        Parameters are identified by the order in which this state first saw them, which is the same in a
        fresh process for the same model and DDP configuration.

        Returns:
            A dict of plain Python values and CPU-clonable tensors, for ``torch.save``.

        Example::

            torch.save({"model": model.state_dict(), "comm": state.state_dict()}, path)
            ...
            state = fastcomm.register(ddp, "topk", ratio=0.01)
            state.load_state_dict(torch.load(path)["comm"])
        """
        self._finish_iteration()
        return {"type": type(self).__name__, "options": self.options(), **self.accounting.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (counters and per-bucket tensors; options stay as built).

        Raises:
            ValueError: the dict comes from another kind of state, or lacks a counter.
        """
        if state_dict.get("type") != type(self).__name__:
            raise ValueError(f"state_dict is for {state_dict.get('type')!r}, not {type(self).__name__}")
        missing = [name for name in COUNTERS if name not in state_dict]
        if missing:
            raise ValueError(f"state_dict lacks the counters {missing}")
        self._finish_iteration()
        self.accounting.load_state_dict(state_dict)

    @classmethod
    def merge_state_dicts(
        cls, states: Sequence[dict[str, Any]], world_size: int, rank: int
    ) -> tuple[dict[str, Any], str]:
        """The state_dict that rank ``rank`` of a ``world_size``-rank group loads, from every old rank's.

        For a restart at another world size (an elastic restart). This base serves states without
        per-rank tensors (:class:`~fastcomm.CastState`): the merged state is old rank 0's type, options and
        counters (steps and skipped steps agree on every rank; traffic counters are rank 0's). Subclasses
        with per-rank tensors extend it (:meth:`CompressionState.merge_state_dicts`); the rule per kind
        of state is in :mod:`fastcomm.hooks.engine.reshard`.

        1. Check that ``states`` are all of this class, with one set of options, at one step.
        2. Same world size (``len(states) == world_size``): ``states[rank]`` itself, unchanged, so the
           resume stays bit-identical.
        3. Otherwise old rank 0's counters.

        Args:
            states: every old rank's :meth:`state_dict`, indexed by old rank (``len`` = old world size).
            world_size: the new group's size.
            rank: this process's rank in the new group.

        Returns:
            ``(state_dict, why)``: the dict to :meth:`load_state_dict` and one log line saying what was
            done and why.

        Raises:
            ValueError: no states, a rank outside the new group, or states of another type, with other
                options or at another step than old rank 0's.

        Example::

            states = [torch.load(f"ckpt/comm_{r}.pt") for r in range(2)]  # saved by 2 ranks, now 3
            merged, why = fastcomm.CastState.merge_state_dicts(states, world_size=3, rank=dist.get_rank())
            state.load_state_dict(merged)
            logging.info(why)
        """
        unchanged = keep_if_same_world(cls.__name__, states, world_size, rank)
        if unchanged is not None:
            return unchanged
        return merge_counters(states), describe(
            cls.__name__, len(states), world_size, ["no per-rank tensors; counters: old rank 0's"]
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options(), "state_dict": self.state_dict()}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self.__init__(**pickled["options"])  # type: ignore[misc]
        self.load_state_dict(pickled["state_dict"])
