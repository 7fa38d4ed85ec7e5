"""Live recovery on torchft's engine: a dead replica leaves, the others go on, a new one heals from a peer.

fastcomm's compressed exchanges through a ``torchft.Manager`` (its quorum, its Lighthouse, its heal over
HTTP), with nothing lost across a leave and a rejoin (docs/ft.md):

==================================  ===================================================================
name                                what it is
==================================  ===================================================================
:func:`connect`                     a ``torchft.Manager`` for this replica (synchronous quorum; the
                                    Lighthouse checked first: :class:`LighthouseUnreachableError`)
:class:`ManagedExchange`            a compressed all-reduce on the current quorum that reports a dead
                                    peer to the Manager instead of raising (``Manager.allreduce``'s way)
:func:`register`                    a DDP comm hook (quantize, sign, topk, cast, powersgd) through it
:class:`FaultTolerantDiLoCo`        ``fastcomm.DiLoCo`` (compressor, fragments, delay) on the quorums
:class:`ReplicaData`                each replica's share of one sample order, split again per quorum
:func:`heal_state`                  what a joining replica receives from a peer
==================================  ===================================================================

Needs torchft: ``pip install 'fastcomm[ft]'`` (torchft 0.2.0 and its opentelemetry pins; see docs/ft.md).
Without it the package imports, and :func:`connect` or :class:`ManagedExchange` raise an ``ImportError``
that says how to install it.

Example::

    manager = fastcomm.ft.connect("replica0", lighthouse="http://127.0.0.1:29510")
    outer = fastcomm.ft.FaultTolerantDiLoCo(manager, fastcomm.DiLoCo(model, inner, sync_every=10,
                                                                     compressor="quantize", bits=4))
    fastcomm.ft.heal_state(manager, model=model, inner=inner, outer=outer)
    outer.start()
"""

from fastcomm.ft.data import ReplicaData
from fastcomm.ft.ddp import ManagedHookState, managed_hook, register
from fastcomm.ft.diloco import FaultTolerantDiLoCo
from fastcomm.ft.errors import (
    AsyncQuorumError,
    CompressorMismatchError,
    FaultToleranceError,
    LighthouseUnreachableError,
    NoProcessGroupError,
    RebuildingBucketsError,
)
from fastcomm.ft.exchange import ManagedExchange, process_group_of
from fastcomm.ft.start import connect
from fastcomm.ft.state import heal_state

__all__ = [
    "AsyncQuorumError",
    "CompressorMismatchError",
    "FaultToleranceError",
    "FaultTolerantDiLoCo",
    "LighthouseUnreachableError",
    "ManagedExchange",
    "ManagedHookState",
    "NoProcessGroupError",
    "RebuildingBucketsError",
    "ReplicaData",
    "connect",
    "heal_state",
    "managed_hook",
    "process_group_of",
    "register",
]
