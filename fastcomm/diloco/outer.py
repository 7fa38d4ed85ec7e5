"""DiLoCo and streaming DiLoCo: ranks train apart for ``sync_every`` steps, then average pseudo-gradients.

DiLoCo (Douillard et al., 2023): every rank takes ``H`` inner optimizer steps on its own data with no
communication; then the ranks average the pseudo-gradient ``global weights - local weights`` and an outer
SGD with Nesterov momentum applies it to the global weights, which are copied back into the model.
Streaming DiLoCo (Douillard et al., 2025) cuts the parameters into ``F`` fragments synced on a staggered
schedule (one every ``H / F`` steps), overlaps each fragment's exchange with the next inner steps and
applies it up to one fragment period later, and sends low-bit pseudo-gradients.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastcomm.collectives import Residual, Traffic
from fastcomm.collectives.residual import check_residual_dtype
from fastcomm.compress.protocol import AllreduceCompressor, Compressor
from fastcomm.compress.registry import compressor_of
from fastcomm.diloco.fragments import Exchange, Fragment, split_parameters
from fastcomm.diloco.schedule import InnerLRFollower, check_outer_lr, outer_lr_ramp

__all__ = ["DiLoCo", "outer_lr_ramp"]

_FORMAT = 1


DEFAULT_OUTER_MOMENTUM = 0.5


def _outer_defaults(
    compressor: object, outer_lr: Any, outer_momentum: float | None
) -> tuple[float | Callable[[int], float] | InnerLRFollower, float]:
    """The outer lr and momentum where the caller left them unset (an explicit setting always wins): the
    compressor's own outer step if it names one (SparseLoCo's: lr 1, no momentum, its error feedback in
    place of the momentum), else an :class:`InnerLRFollower` and Nesterov momentum 0.5 (docs/diloco.md)."""
    own = getattr(compressor, "outer_step", None)
    if isinstance(own, Mapping):
        lr = own["outer_lr"] if outer_lr is None else outer_lr
        return lr, float(own["outer_momentum"]) if outer_momentum is None else outer_momentum
    lr = InnerLRFollower() if outer_lr is None else outer_lr
    return lr, DEFAULT_OUTER_MOMENTUM if outer_momentum is None else outer_momentum


class DiLoCo:
    """The outer loop of DiLoCo around any inner optimizer: call :meth:`step` where ``optimizer.step()`` was.

    Why an optimizer wrapper (not a context manager): the outer step is a step that happens after some inner
    steps, so it belongs where the training loop already steps; the loop keeps its shape (``zero_grad``,
    ``backward``, ``step``), the inner optimizer and its LR schedule stay the user's, and a checkpoint
    names it like any optimizer.

    Each call of :meth:`step` (or :meth:`after_inner_step`, after an inner step taken by the caller):

    1. Counts one inner step ``s`` (steps count from 1, on every rank alike).
    2. Applies each exchange due at ``s``: waits for its all-reduce (the ranks' mean pseudo-gradient
       ``delta``; with a sparse compressor's ``rescale``, as ``"sparseloco"``'s, divided by the mean number
       of ranks that sent an entry instead of all of them), then the outer Nesterov SGD on the
       fragment's global weights (fp32)::

           momentum = outer_momentum * momentum + delta
           global  -= outer_lr * (delta + outer_momentum * momentum)      # nesterov=False: momentum

       and writes them into the model. An exchange applied ``d`` steps after it was issued keeps the
       ``d`` local steps taken meanwhile: ``local = global + (local now - local at the send)`` (with
       ``d = 0``, ``local = global``); with ``mixing=alpha``, the paper's merge
       ``local = alpha * local now + (1 - alpha) * global`` instead.
    3. Issues the exchange of every fragment ``f`` whose turn it is (``s % sync_every ==
       (f + 1) * sync_every / fragments % sync_every``): the pseudo-gradient ``global - local`` is averaged
       by :func:`fastcomm.collectives.all_reduce` through the compressor with error feedback (one
       :class:`~fastcomm.collectives.Residual` per fragment, kept across syncs), or by a plain fp32
       ``dist.all_reduce`` (``compressor=None``); it is applied ``delay`` steps later (0: at once).

    No DDP wrapper: each rank trains on its own data between syncs. Give each rank a disjoint stream, e.g.
    ``fastio.StreamLoader(path, rank=rank, world_size=world, ...)``, which splits every epoch's order
    over the ranks. The models must start equal on every rank (seed them alike): the first global weights
    are the model's weights when this is built. With AMP, the sync is on weights, not gradients: step the
    inner optimizer through the ``GradScaler`` and call :meth:`after_inner_step` every iteration, also when
    the scaler skipped the step (the ranks must meet at the same syncs).

    A checkpoint (:meth:`state_dict`) waits for the exchanges in flight and saves their means, so it never
    holds one in flight: restored at the same world size, a run continues bit for bit, mid-interval too.

    Args:
        model: the module whose parameters (those that require grad) are synced.
        inner_optimizer: the optimizer of those parameters (AdamW in the paper); its state is never reset.
        sync_every: ``H``, inner steps between two syncs of a fragment.
        outer_lr: the outer SGD's learning rate: a number (0.7 in the paper; 1.0 with ``outer_momentum=0`` is
            plain averaging), a function of the inner step at which an exchange is applied (e.g.
            :func:`outer_lr_ramp`), or a :class:`~fastcomm.diloco.schedule.InnerLRFollower`. Unset: the
            compressor's own outer step if it has one (``"sparseloco"``: 1.0), else
            ``InnerLRFollower(0.5, 1.0)``: 0.5 until the inner LR (of the first parameter group) has
            peaked, then rising to 1.0 as it decays (docs/diloco.md, "Defaults").
        outer_momentum: the outer momentum; unset: the compressor's (``"sparseloco"``: 0, its error
            feedback takes its place), else 0.5 (the paper's 0.9 overshoots at small ``H``: docs/diloco.md).
        nesterov: Nesterov momentum (the paper's) or heavy ball.
        compressor: ``None`` or ``"none"`` (plain fp32 all-reduce), a name of
            :func:`fastcomm.compressor` (``"quantize"``, ``"sign"``, ``"cast"``, one you added), or a
            compressor instance.
        fragments: ``F``, how many fragments are synced in turn (streaming DiLoCo); divides ``sync_every``.
        delay: steps between the issue of an exchange and its application, ``0 <= delay <= sync_every``
            (default: 0 with one fragment, ``sync_every / fragments`` with several: overlapped).
        mixing: how an exchange applied late meets the local weights: ``None`` (default) keeps the local
            steps taken meanwhile; ``alpha`` in ``[0, 1)``: ``alpha * local + (1 - alpha) * global``
            (streaming DiLoCo's merge; 0.5 there).
        eager: with ``delay >= 1``, eager updates (2025): at the issue, the outer step is taken at once
            with this rank's own pseudo-gradient standing in for the ranks' mean, and the inner steps
            meanwhile start from there; when the exchange lands the global weights are the exact ones (the
            same on every rank) and the local steps taken meanwhile are kept on top.
        keep_unsent: after a sync each replica restarts from the global weights minus ``decay`` times
            what its compressor has not sent, and the residual starts from zero (the local weights carry
            it); needs an all-gathered compressor (``block == 0``). Unset: the compressor's own choice
            (``"sparseloco"``: on; docs/diloco.md, "SparseLoCo"), else off.
        process_group: the group of the replicas (default: the default group).
        chunk_bytes: the compressed all-reduce's piece size (default: the collectives' own).
        residual_dtype: keep each fragment's error-feedback residual in this dtype between syncs
            (``torch.bfloat16``: half the memory of fp32), widened for each exchange; ``None``: fp32. Needs
            a compressor (a plain all-reduce keeps no residual); the same option as the DDP hooks' and
            :func:`fastcomm.fsdp.compress`'s.
        **compressor_options: options of the named compressor (``bits=4``, ``block=...``).

    Example::

        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        outer = fastcomm.DiLoCo(model, inner, sync_every=10, compressor="quantize", bits=4)
        for batch in loader:                        # this rank's own batches
            inner.zero_grad()
            model(batch).backward()
            outer.step()                            # inner.step(); every 10 steps, the sync
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int = 50,
        outer_lr: float | Callable[[int], float] | InnerLRFollower | None = None,
        outer_momentum: float | None = None,
        nesterov: bool = True,
        compressor: str | Compressor | AllreduceCompressor | None = None,
        fragments: int = 1,
        delay: int | None = None,
        mixing: float | None = None,
        eager: bool = False,
        keep_unsent: bool | None = None,
        process_group: dist.ProcessGroup | None = None,
        chunk_bytes: int | None = None,
        residual_dtype: torch.dtype | None = None,
        **compressor_options: Any,
    ) -> None:
        for name, value in (("sync_every", sync_every), ("fragments", fragments)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if sync_every % fragments:
            raise ValueError(f"fragments ({fragments}) must divide sync_every ({sync_every})")
        period = sync_every // fragments
        delay = (0 if fragments == 1 else period) if delay is None else delay
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= sync_every:
            raise ValueError(f"delay must be an int in [0, sync_every={sync_every}], got {delay!r}")
        if mixing is not None and not 0 <= mixing < 1:
            raise ValueError(f"mixing must be None or in [0, 1), got {mixing!r}")
        if eager and (delay == 0 or mixing is not None):
            raise ValueError(f"eager needs delay >= 1 and mixing=None (an estimate stands in for an exchange "
                             f"in flight), got delay={delay}, mixing={mixing!r}")
        if outer_lr is not None and not callable(outer_lr):
            check_outer_lr(outer_lr)
        if outer_momentum is not None and not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no parameter that requires grad")
        held = {id(p) for group in inner_optimizer.param_groups for p in group["params"]}
        missing = sum(id(p) not in held for p in params)
        if missing:
            raise ValueError(f"{missing} of the model's {len(params)} parameters are not in inner_optimizer")
        if compressor is None or compressor == "none":
            if compressor_options:
                raise TypeError(f"compressor None takes no options, got {sorted(compressor_options)}")
            self.compressor: Compressor | AllreduceCompressor | None = None
        elif isinstance(compressor, str):
            self.compressor = compressor_of(compressor, compressor_options)
        else:
            self.compressor = compressor
        self.residual_dtype = check_residual_dtype(residual_dtype)
        if residual_dtype is not None and self.compressor is None:
            raise ValueError(
                "residual_dtype needs a compressor: a plain all-reduce (compressor=None) keeps no residual"
            )
        self.inner = inner_optimizer
        self.sync_every, self.delay, self.mixing, self.eager = sync_every, delay, mixing, bool(eager)
        own = getattr(self.compressor, "outer_step", None)
        if keep_unsent is None:
            keep_unsent = bool(own.get("keep_unsent", False)) if isinstance(own, Mapping) else False
        if keep_unsent and getattr(self.compressor, "block", None) != 0:
            raise ValueError("keep_unsent needs a compressor whose payloads are all-gathered (block == 0, as "
                             f"'sparseloco' or 'topk'), got {self.compressor!r}")
        self.keep_unsent = bool(keep_unsent)
        outer_lr, outer_momentum = _outer_defaults(self.compressor, outer_lr, outer_momentum)
        self.outer_lr = outer_lr if callable(outer_lr) else float(outer_lr)
        self.outer_momentum, self.nesterov = float(outer_momentum), nesterov
        self.process_group, self.chunk_bytes = process_group, chunk_bytes
        self.fragments = [
            Fragment.of(index, group, (index + 1) * period % sync_every, self.residual_dtype)
            for index, group in enumerate(split_parameters(params, fragments))
        ]
        self.inner_steps = 0
        self.in_flight: list[Exchange] = []
        self.syncs = 0
        self.traffic = Traffic()
        self.blocked_s = 0.0

    # -------------------------------------------------------------------------------------------- loop
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups."""
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """``inner_optimizer.step(closure)``, then :meth:`after_inner_step`; returns the closure's loss."""
        loss = self.inner.step() if closure is None else self.inner.step(closure)
        self.after_inner_step()
        return loss

    def after_inner_step(self) -> None:
        """Count one inner step, apply the exchanges due now, and issue the fragments whose turn it is.

        Every rank calls it once per iteration (also when a ``GradScaler`` skipped the inner step).
        """
        self.inner_steps += 1
        step = self.inner_steps
        for exchange in [e for e in self.in_flight if e.due <= step]:
            self.in_flight.remove(exchange)
            self._apply(exchange)
        for fragment in self.fragments:
            if step % self.sync_every != fragment.offset:
                continue
            local_delta = fragment.global_weights - fragment.local_weights() if self.eager else None
            exchange = Exchange.start(fragment, step=step, due=step + self.delay, compressor=self.compressor,
                                      group=self.process_group, chunk_bytes=self.chunk_bytes,
                                      traffic=self.traffic)  # fmt: skip
            if local_delta is not None:
                exchange.sent_local = self._eager_step(fragment, local_delta)
            if self.delay == 0:
                self._apply(exchange)
            else:
                self.in_flight.append(exchange)

    def finish(self) -> None:
        """Wait for every exchange in flight and apply it now (before evaluating or saving the model)."""
        while self.in_flight:
            self._apply(self.in_flight.pop(0))

    def _outer_update(self, fragment: Fragment, delta: Tensor, commit: bool) -> tuple[Tensor, float]:
        """The outer step's update of ``delta`` and the outer lr (the momentum kept only if ``commit``)."""
        momentum = fragment.momentum.mul(self.outer_momentum).add_(delta)
        if commit:
            fragment.momentum.copy_(momentum)
        update = delta.add(momentum, alpha=self.outer_momentum) if self.nesterov else momentum
        lr = self.outer_lr
        if isinstance(lr, InnerLRFollower):
            lr = lr(float(self.inner.param_groups[0]["lr"]))
        elif callable(lr):
            lr = check_outer_lr(lr(self.inner_steps), f" (outer_lr({self.inner_steps}))")
        return update, lr

    def _eager_step(self, fragment: Fragment, local_delta: Tensor) -> Tensor:
        """Eager update: the outer step taken at once with this rank's own pseudo-gradient standing in for
        the ranks' mean (the momentum left as it is); the local weights continue from there. Returns them
        (the exchange's ``sent_local``)."""
        update, lr = self._outer_update(fragment, local_delta, commit=False)
        start = fragment.global_weights.add(update, alpha=-lr)
        fragment.write_local(start)
        return start

    def _apply(self, exchange: Exchange) -> None:
        exchange.settle()
        self.blocked_s += exchange.blocked_s
        fragment = self.fragments[exchange.fragment]
        fragment.residual.keep()  # in residual_dtype until the fragment's next exchange
        update, lr = self._outer_update(fragment, exchange.mean, commit=True)
        fragment.global_weights.add_(update, alpha=-lr)
        if exchange.sent_local is None:
            fragment.write_local(fragment.global_weights)
        elif self.mixing is not None:
            fragment.write_local(torch.lerp(fragment.global_weights, fragment.local_weights(), self.mixing))
        else:
            fragment.write_local(fragment.global_weights + (fragment.local_weights() - exchange.sent_local))
        if self.keep_unsent:
            self._keep_unsent(fragment)
        self.syncs += 1

    def _keep_unsent(self, fragment: Fragment) -> None:
        """Move what this rank still owes from the error-feedback residual into its local weights
        (``local -= decay * owed``): the next pseudo-gradient holds it, so the residual starts from zero."""
        owed = fragment.residual.owed()
        if owed is None:
            return
        decay = float(getattr(self.compressor, "decay", 1.0))
        fragment.write_local(fragment.local_weights().sub_(owed, alpha=decay))
        fragment.residual.take("worker", owed, owed.numel()).zero_()

    def stats(self) -> dict[str, float]:
        """Inner steps, syncs applied, traffic and seconds spent waiting.

        The traffic as every mode reports it (:meth:`fastcomm.collectives.Traffic.stats`): ``sent_bytes``
        (what this rank's all-reduces sent, counted by them once sent), ``dense_bytes`` (a plain fp32 ring
        all-reduce's) and ``compression_ratio``; ``bytes_sent`` is ``sent_bytes`` under the name of earlier
        releases.

        Example::

            print(outer.stats()["sent_bytes"] / outer.stats()["inner_steps"], "bytes per step")
        """
        traffic = self.traffic.stats()
        return {"inner_steps": self.inner_steps, "syncs": self.syncs, **traffic,
                "bytes_sent": traffic["sent_bytes"], "blocked_s": self.blocked_s}  # fmt: skip

    # ---------------------------------------------------------------------------------------- checkpoint
    def _config(self) -> dict[str, Any]:
        return {"sync_every": self.sync_every, "delay": self.delay,
                "numels": [fragment.numel for fragment in self.fragments]}

    def state_dict(self) -> dict[str, Any]:
        """The step counter, each fragment's global weights, outer momentum and residual, and the exchanges
        in flight, waited for (their means). The inner optimizer's state is the inner optimizer's own.

        Example::

            torch.save({"model": model.state_dict(), "inner": inner.state_dict(),
                        "outer": outer.state_dict()}, path)
        """
        return {
            "format": _FORMAT, "config": self._config(), "inner_steps": self.inner_steps,
            "syncs": self.syncs, "bytes_sent": self.traffic.sent_bytes, "traffic": self.traffic.state_dict(),
            "fragments": [{"global_weights": f.global_weights.clone(), "momentum": f.momentum.clone(),
                           "residual": f.residual.state_dict()}
                          for f in self.fragments],
            "in_flight": [exchange.state_dict() for exchange in self.in_flight],
            "outer_lr": self.outer_lr.state_dict() if isinstance(self.outer_lr, InnerLRFollower) else None,
        }  # fmt: skip

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``ValueError`` if it is of another configuration)."""
        if state_dict.get("format") != _FORMAT or state_dict.get("config") != self._config():
            raise ValueError(f"DiLoCo state of another configuration: saved {state_dict.get('config')}, "
                             f"this one {self._config()}")
        for fragment in self.in_flight:
            fragment.settle()
        for fragment, saved in zip(self.fragments, state_dict["fragments"], strict=True):
            fragment.global_weights.copy_(saved["global_weights"])
            fragment.momentum.copy_(saved["momentum"])
            fragment.residual = Residual(self.residual_dtype)
            fragment.residual.load_state_dict(saved["residual"])
        self.in_flight = [Exchange.from_state_dict(e) for e in state_dict["in_flight"]]
        self.inner_steps, self.syncs = int(state_dict["inner_steps"]), int(state_dict["syncs"])
        if isinstance(self.outer_lr, InnerLRFollower) and state_dict.get("outer_lr") is not None:
            self.outer_lr.load_state_dict(state_dict["outer_lr"])
        # a checkpoint without "traffic" (older) holds the sent bytes alone
        self.traffic.load_state_dict(state_dict.get("traffic", {"sent_bytes": state_dict["bytes_sent"]}))

    @classmethod
    def merge_state_dicts(
        cls, states: Sequence[Mapping[str, Any]], world_size: int, rank: int
    ) -> tuple[dict[str, Any], str]:
        """One state for a restart at another world size (used by :class:`fastcomm.Checkpointer`).

        1. The global weights, momentum, step and the exchanges' means are the same on every old rank: rank
           0's are kept (with its local weights at a send, as the checkpointer keeps rank 0's model).
        2. Each fragment's error-feedback residual is re-sharded by the rule every mode shares
           (:meth:`fastcomm.collectives.Residual.merge_state_dicts`, as the DDP hooks re-shard theirs):
           every new rank owes the mean over the old ranks of what each owed (a two-phase all-reduce's
           segment residual folded in), so the mean over ranks still owed, what error feedback has yet to
           send, is unchanged: no pseudo-gradient is lost or sent twice. At the same world size each rank
           keeps its own.

        Example::

            state, why = DiLoCo.merge_state_dicts(old_states, world_size=4, rank=0)
        """
        merged = copy.deepcopy(dict(states[0]))
        for index, fragment in enumerate(merged["fragments"]):
            residuals = [state["fragments"][index]["residual"] for state in states]
            fragment["residual"] = Residual.merge_state_dicts(residuals, world_size, rank)[0]
        why = (f"rank 0's global weights, momentum and step (the same on all {len(states)} old ranks); "
               f"error-feedback residuals re-sharded to world size {world_size}: every rank owes the mean "
               f"over the {len(states)} old ranks of what each owed, so the mean still owed is unchanged")
        return merged, why
