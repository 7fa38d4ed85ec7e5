"""The named errors of :mod:`fastcomm.ft`: each says what was wrong and what to do.

Example::

    try:
        manager = fastcomm.ft.connect(lighthouse="http://127.0.0.1:29510", replica_id="r0")
    except fastcomm.ft.LighthouseUnreachableError as error:
        print(error)            # names the address and how to start a Lighthouse
"""

from __future__ import annotations

import importlib
import types

__all__ = [
    "require_torchft",
    "AsyncQuorumError",
    "CompressorMismatchError",
    "FaultToleranceError",
    "LighthouseUnreachableError",
    "NoProcessGroupError",
    "RebuildingBucketsError",
]


def require_torchft() -> types.ModuleType:
    """torchft, or an ``ImportError`` that says how to install it (the ``ft`` extra)."""
    try:
        return importlib.import_module("torchft")
    except ImportError as error:
        raise ImportError(
            f"fastcomm.ft needs torchft ({error}): pip install --no-deps torchft==0.2.0, then "
            f"pip install 'fastcomm[ft]' (its opentelemetry pins); `make install` does both"
        ) from error


class FaultToleranceError(RuntimeError):
    """The base of :mod:`fastcomm.ft`'s named errors."""


class NoProcessGroupError(FaultToleranceError, TypeError):
    """The ``torchft.Manager`` holds no torchft process group: its exchanges would have nowhere to go."""


class AsyncQuorumError(FaultToleranceError, ValueError):
    """DiLoCo (or :class:`~fastcomm.ft.ReplicaData`) on a Manager built with ``use_async_quorum=True``.

    An asynchronous quorum lets a replica that is still healing into the step; DiLoCo's syncs and the data
    split both need every replica of the quorum healed before it reads or sends.
    """


class CompressorMismatchError(FaultToleranceError, ValueError):
    """The replicas of one quorum exchange through different compressors or settings (found at its first
    exchange): their payloads would be decoded as something they are not."""


class LighthouseUnreachableError(FaultToleranceError, ConnectionError):
    """No torchft Lighthouse answers at the address given: nothing could form a quorum."""


class RebuildingBucketsError(FaultToleranceError, ValueError):
    """A DDP model whose buckets are rebuilt after its first step: a restarted replica's first step would be
    bucketed otherwise than its peers', and their exchanges would not match."""
