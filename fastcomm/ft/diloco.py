"""``fastcomm.DiLoCo`` on a ``torchft.Manager``: replicas leave and join between syncs, nothing restarts.

:class:`FaultTolerantDiLoCo` drives a :class:`fastcomm.DiLoCo` (any compressor, fragments, delay) and the
Manager's quorum at the DiLoCo's sync points only, where no exchange is in flight; between syncs the
replicas train apart with no communication, as DiLoCo does. At a sync point ``s``:

1. the exchanges due at ``s`` are waited for (``delay > 0``), and the inner step is counted
   (``DiLoCo.after_inner_step``: it applies them and issues the fragments whose turn it is) on the process
   group of the current quorum; a failed exchange (a peer died) is reported to the Manager, not raised;
2. ``manager.should_commit()``: ``True`` commits the interval (and the data read in it,
   :class:`~fastcomm.ft.ReplicaData`); ``False`` (an exchange failed) discards it: every fragment's local
   weights go back to its global weights, exchanges in flight and residuals are dropped, and the data
   since the last commit is read again;
3. ``manager.start_quorum()``: the dead leave, the new or restarted heal from a peer (the state that
   :func:`~fastcomm.ft.heal_state` registered), and the next sync runs on the new quorum's group.

With ``delay == 0`` the quorum is taken after step 1's exchange, so a replica that joins receives the
synced weights; with ``delay > 0`` the exchanges of ``s`` are issued after the quorum, on its group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from fastcomm.collectives import Residual
from fastcomm.diloco import DiLoCo
from fastcomm.ft.errors import AsyncQuorumError, CompressorMismatchError
from fastcomm.ft.exchange import ManagedExchange

__all__ = ["FaultTolerantDiLoCo"]


class _Skipped(Exception):
    """An earlier failure of this step was reported: the exchange is not issued."""


class FaultTolerantDiLoCo:
    """Run ``outer`` (a :class:`fastcomm.DiLoCo`) on ``manager``'s quorums: call :meth:`step` where
    ``outer.step()`` was.

    Args:
        manager: the replica's ``torchft.Manager``, built with ``use_async_quorum=False``.
        outer: the DiLoCo; its ``process_group`` is set to each quorum's group. ``delay`` must be at most
            ``sync_every / fragments`` (every exchange in flight is due at the next sync point).
        data: the :class:`~fastcomm.ft.ReplicaData` this replica reads, committed and rolled back with the
            syncs; ``None``: none.

    Raises:
        AsyncQuorumError: the Manager runs its quorum asynchronously.

    Example::

        outer = fastcomm.DiLoCo(model, inner, sync_every=10, compressor="quantize", bits=4)
        ft = fastcomm.ft.FaultTolerantDiLoCo(manager, outer, data=data)
        fastcomm.ft.heal_state(manager, model=model, inner=inner, outer=ft, data=data)
        ft.start()                                    # the first quorum (a restarted replica heals here)
        while ft.outer.inner_steps < steps:
            loss_of(model, data.next()).backward()
            ft.step()
            inner.zero_grad()
    """

    def __init__(self, manager: Any, outer: DiLoCo, data: Any = None) -> None:
        if getattr(manager, "_use_async_quorum", False):
            raise AsyncQuorumError(
                "fastcomm.ft.FaultTolerantDiLoCo needs torchft.Manager(..., use_async_quorum=False): an "
                "asynchronous quorum lets a replica still healing into the sync, and DiLoCo's sync needs "
                "every replica's pseudo-gradient (torchft's own DiLoCo asks the same)"
            )
        if getattr(outer, "eager", False):
            raise ValueError(
                "fastcomm.ft does not run DiLoCo's eager updates: a discarded sync would keep the estimate's "
                "outer step in the global weights; build the DiLoCo with eager=False"
            )
        period = outer.sync_every // len(outer.fragments)
        if outer.delay > period:
            raise ValueError(f"fastcomm.ft needs delay <= sync_every / fragments = {period}, got "
                             f"{outer.delay}: a quorum is taken where no exchange is in flight")  # fmt: skip
        self.manager, self.outer, self.data = manager, outer, data
        fingerprint = (f"DiLoCo sync_every={outer.sync_every} delay={outer.delay} "
                       f"fragments={[f.numel for f in outer.fragments]} {outer.compressor!r}")  # fmt: skip
        device = outer.fragments[0].global_weights.device
        self.exchange = ManagedExchange(manager, fingerprint=fingerprint, device=device)
        self.failed_syncs = 0
        self.last_error: Exception | None = None  # why the last discarded sync failed
        self.discarded_steps = 0
        self._committed_step = 0
        self._quorum_step = -1

    # ------------------------------------------------------------------------------------------ the loop
    def start(self) -> None:
        """Take the first quorum (a restarted replica heals from a peer here); call once, before the loop.

        A replica that healed into the quorum of a sync point with ``delay > 0`` (taken before that point's
        exchanges are issued) issues them with its peers now, so its next inner step is theirs.
        """
        self._quorum(self.outer.inner_steps)
        if self._quorum_step == self.outer.inner_steps + 1:
            self._guarded(self.outer.after_inner_step, self._quorum_step)

    def step(self) -> None:
        """``inner.step()``, then :meth:`after_inner_step`."""
        self.outer.inner.step()
        self.after_inner_step()

    def after_inner_step(self) -> None:
        """Count one inner step; at a sync point, exchange, commit or discard, and take the next quorum."""
        outer = self.outer
        step = outer.inner_steps + 1
        issues = any(step % outer.sync_every == fragment.offset for fragment in outer.fragments)
        applies = any(exchange.due <= step for exchange in outer.in_flight)
        if not (issues or applies):
            outer.after_inner_step()
            return
        if outer.delay == 0:
            self._guarded(outer.after_inner_step, step)
            self._commit(step)
            self._quorum(step)
            return
        self._guarded(lambda: [exchange.settle() for exchange in outer.in_flight if exchange.due <= step],
                      step - 1)  # fmt: skip
        self._commit(step)
        self._quorum(step)
        self._guarded(outer.after_inner_step, step)

    def _guarded(self, fn: Callable[[], Any], step: int) -> None:
        """Run ``fn`` (it issues or waits for exchanges) on the quorum's group; a failure is reported to the
        Manager, not raised, and leaves the DiLoCo at inner step ``step`` with nothing in flight."""
        manager = self.manager
        try:
            if manager.errored():
                raise _Skipped
            group = self.exchange.group()
            self.exchange.check(group)
            self.outer.process_group = group
            with warnings.catch_warnings():
                # a torchft quorum's group has no twin for a second collective: wait() issues phase 2
                warnings.filterwarnings("ignore", message="fastcomm: no second process group")
                fn()
        except CompressorMismatchError:
            raise
        except Exception as error:  # noqa: BLE001 - torchft's contract: report, never raise mid-step
            if not isinstance(error, _Skipped):
                manager.report_error(error)
                self.exchange.failures += 1
            self.outer.in_flight = []
            self.outer.inner_steps = step

    def _commit(self, step: int) -> None:
        if self.manager.should_commit():
            self._committed_step = step
            if self.data is not None:
                self.data.commit()
            return
        self.failed_syncs += 1
        self.last_error = self.manager.errored()
        self.discarded_steps += step - self._committed_step
        self._committed_step = step
        outer = self.outer
        outer.in_flight = []
        for fragment in outer.fragments:
            fragment.write_local(fragment.global_weights)
            fragment.residual = Residual(outer.residual_dtype)
        if self.data is not None:
            self.data.rollback()

    def _quorum(self, step: int) -> None:
        self._quorum_step = step
        self.manager.start_quorum()
        if self.data is not None:
            self.data.split(self.manager)

    # ------------------------------------------------------------------------------------------ heal
    def state_dict(self) -> dict[str, Any]:
        """The DiLoCo's state (no exchange is in flight at a quorum) and this wrapper's counters."""
        return {"outer": self.outer.state_dict(), "committed_step": self._committed_step,
                "quorum_step": self._quorum_step}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Heal from a peer's :meth:`state_dict`: its global weights, momentum and step, and local weights
        equal to the global ones, so this replica's next pseudo-gradient holds its own steps only (never a
        copy of its peer's); its residuals start empty (a copy of the peer's debt would be sent twice)."""
        outer = self.outer
        outer.load_state_dict(state_dict["outer"])
        for fragment in outer.fragments:
            fragment.write_local(fragment.global_weights)
            fragment.residual = Residual(outer.residual_dtype)
        for exchange in outer.in_flight:
            if exchange.sent_local is not None:
                exchange.sent_local = outer.fragments[exchange.fragment].global_weights.clone()
        self._committed_step = int(state_dict["committed_step"])
        self._quorum_step = int(state_dict["quorum_step"])
