"""A DDP comm hook whose buckets are exchanged through a ``torchft.Manager`` (:func:`register`).

The same compressors as :func:`fastcomm.register`'s hooks (``fastcomm.compress``, by name), the same
exchanges (:func:`fastcomm.collectives.all_reduce`), and one error-feedback residual per bucket; each
bucket goes through :class:`~fastcomm.ft.ManagedExchange`, so a peer killed inside the exchange makes the
step fail on the survivors (``manager.should_commit()`` is ``False``) instead of crashing or hanging them.
``"auto"`` picks each bucket's method again at every quorum, alike on its replicas (:mod:`fastcomm.ft.auto`).
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real types.
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fastcomm.collectives import Residual, bucket_stream, completed
from fastcomm.compress.protocol import AllreduceCompressor, Compressor
from fastcomm.compress.registry import compressor_of
from fastcomm.ft.auto import OPTIONS, QuorumAuto
from fastcomm.ft.errors import RebuildingBucketsError
from fastcomm.ft.exchange import ManagedExchange

__all__ = ["METHODS", "ManagedHookState", "managed_hook", "register"]

# the methods of fastcomm.register that a quorum of changing size can run (auto decides at each quorum)
METHODS = ("quantize", "sign", "topk", "cast", "powersgd", "auto", "none")


@dataclass
class ManagedHookState:
    """What :func:`managed_hook` keeps: the exchange, the method and its options, residuals per bucket.

    The residuals are this replica's own debt and never travel: :meth:`state_dict` holds the method and
    options only, and :meth:`load_state_dict` (a heal from a peer) empties them, so a healed replica owes
    nothing rather than a copy of its peer's debt (which would then be sent twice).

    Example::

        state = fastcomm.ft.register(ddp, manager, "quantize", bits=8)
        print(state.stats())
    """

    exchange: ManagedExchange
    method: str
    options: dict[str, Any]
    residuals: dict[int, Residual] = field(default_factory=dict)
    compressors: dict[int, Compressor | AllreduceCompressor | None] = field(default_factory=dict)
    failed_steps: int = 0
    auto: QuorumAuto | None = None  # "auto": the current quorum's choices

    def compressor_for(self, numel: int) -> Compressor | AllreduceCompressor | None:
        """The compressor of a bucket of ``numel`` elements (top-k's ``k`` follows from ``ratio``; auto's is
        the current quorum's choice)."""
        if self.auto is not None:
            return self.auto.compressor(numel)
        if numel not in self.compressors:
            if self.method == "none":
                self.compressors[numel] = None
            elif self.method == "topk":
                options = {k: v for k, v in self.options.items() if k != "ratio"}
                k = max(1, int(numel * float(self.options.get("ratio", 0.01))))
                self.compressors[numel] = compressor_of("topk", {"k": k, **options})
            else:
                self.compressors[numel] = compressor_of(self.method, self.options)
        return self.compressors[numel]

    def stats(self) -> dict[str, float]:
        """The traffic (``sent_bytes``, ``dense_bytes``, ``compression_ratio``) and the failed exchanges;
        under ``"auto"``, how many bucket sizes the current quorum gave each method
        (``auto_<method>_buckets``, the sizes in ``state.auto.choices``) and its size
        (``auto_quorum_size``)."""
        stats = {**self.exchange.traffic.stats(), "failed_exchanges": self.exchange.failures}
        if self.auto is not None:
            for method in ("dense", *self.auto.candidates):
                stats[f"auto_{method}_buckets"] = sum(1 for c in self.auto.choices.values() if c == method)
            stats["auto_quorum_size"] = self.auto.world_size
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"method": self.method, "options": dict(self.options)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("method") != self.method or state_dict.get("options") != self.options:
            saved = (state_dict.get("method"), state_dict.get("options"))
            raise ValueError(f"a hook state of method {saved[0]!r} {saved[1]}, this one {self.method!r} "
                             f"{self.options}: start every replica with the same method")  # fmt: skip
        self.residuals.clear()


def managed_hook(state: ManagedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the quorum through ``state``'s exchange; never raises on a failed peer.

    A failed exchange is reported to the Manager and leaves the bucket as it is (the step is skipped by
    ``should_commit()``); that bucket's residual is dropped (what it owed is lost, at most one compression
    error of one bucket).
    """
    buffer = bucket.buffer()
    index = bucket.index()
    if state.auto is not None and state.exchange.begin(state.auto.decide) is None:
        state.residuals.pop(index, None)  # the quorum, its check or auto's decision failed: step skipped
        return completed(buffer)
    compressor = state.compressor_for(buffer.numel())
    if compressor is None and index in state.residuals and state.exchange.manager.is_participating():
        owed = state.residuals.pop(index).owed()  # auto went dense: what the bucket owes goes with it
        if owed is not None:
            buffer.add_(owed.to(buffer.dtype))
    residual = None if compressor is None else state.residuals.setdefault(index, Residual())
    shapes = [p.shape for p in bucket.parameters()] if isinstance(compressor, AllreduceCompressor) else None
    seed = bucket_stream(0, state.exchange.manager.current_step(), index)
    if not state.exchange.all_reduce(buffer, compressor, residual=residual, seed=seed, shapes=shapes):
        state.residuals.pop(index, None)
    return completed(buffer)


def register(ddp: DistributedDataParallel, manager: Any, method: str = "quantize",
             **options: Any) -> ManagedHookState:  # fmt: skip
    """Install a compressing comm hook on ``ddp`` whose exchanges go through ``manager``'s quorum.

    1. ``method`` names a compressor of :func:`fastcomm.compressor` (``"quantize"`` with ``bits``,
       ``"sign"``, ``"topk"`` with ``ratio``, ``"cast"``, ``"powersgd"``), ``"auto"`` (with
       ``candidates``, ``margin``, ``link``: each bucket's method picked again at every quorum, for its
       size, alike on its replicas; :class:`~fastcomm.ft.auto.QuorumAuto`) or ``"none"`` (fp32 sum).
    2. Each bucket is averaged over the replicas of the current quorum (:class:`ManagedExchange`): it waits
       for the quorum, sends zeros from a replica that sits the step out, divides by those taking part, and
       reports a failure to the Manager instead of raising.
    3. The replicas' settings are compared at the first exchange of every quorum
       (:class:`~fastcomm.ft.CompressorMismatchError`).

    Args:
        ddp: a ``DistributedDataParallel`` over this replica group's ranks, built with
            ``find_unused_parameters=True`` (its buckets are then never rebuilt, so a restarted replica's
            first step is bucketed as its peers'); a one-process replica group passes any one-rank group.
        manager: the replica's ``torchft.Manager``.
        method: the compressor's name, or ``"none"``.
        **options: the compressor's options (``bits=8``; ``ratio=0.01`` for top-k).

    Raises:
        RebuildingBucketsError: ``ddp`` rebuilds its buckets after the first step.
        ValueError: an unknown name, or an option ``"auto"`` does not take under torchft (its warm-up,
            timed trial and recheck: a quorum's world can change under them).

    Example::

        ddp = DistributedDataParallel(model, process_group=one_rank_group, find_unused_parameters=True)
        state = fastcomm.ft.register(ddp, manager, "quantize", bits=8)
    """
    if method not in METHODS:
        raise ValueError(f"fastcomm.ft.register takes {METHODS}, got {method!r}")
    refused = sorted(set(options) - set(OPTIONS)) if method == "auto" else []
    if refused:
        raise ValueError(
            f'fastcomm.ft.register(..., "auto") takes {OPTIONS}, got {refused}: '
            f"under torchft auto picks from the advisor's model at each quorum's first exchange, with no "
            f"warm-up, timed trial or recheck (a quorum's world can change under them)"
        )
    if not ddp.find_unused_parameters:
        raise RebuildingBucketsError(
            "build the DistributedDataParallel with find_unused_parameters=True: otherwise it rebuilds its "
            "buckets after the first step, and a restarted replica's first step would send buckets of other "
            "sizes than its peers' (as torchft's own DDP wrapper does)"
        )
    parameters = list(ddp.module.parameters())
    state = ManagedHookState(ManagedExchange(manager, device=parameters[0].device), method, dict(options))
    if method == "auto":
        largest = sum(p.numel() for p in parameters)  # the kernels are timed at the largest bucket's size
        state.auto = QuorumAuto(parameters[0].device.type, largest, **options)
        settings = state.auto.settings()
    else:
        settings = repr(state.compressor_for(1 << 16)) if method != "topk" else repr(sorted(options.items()))
    state.exchange.fingerprint = f"{method} {settings}"
    ddp.register_comm_hook(state, managed_hook)
    return state
