"""Waiting for a compressed collective: a failure on the wire raises :class:`~fastcomm.PeerCollectiveError`
naming the FSDP comm and its parameter group.

FSDP calls its comms from autograd, where an error must say which exchange failed: so the FSDP comms issue
their collective with ``async_op=True`` (argument errors raise there, as they are) and wait here, where
whatever fails is the exchange with the other ranks. The collective's own :class:`PeerCollectiveError`
(or a plain ``RuntimeError`` from the wire) is raised again under the comm's name, with the original cause.
"""

from __future__ import annotations

from fastcomm.collectives import CompressedWork, PeerCollectiveError

__all__ = ["wait_named"]


def wait_named(work: CompressedWork | None, where: str) -> None:
    """Wait for ``work``; its failure raises :class:`PeerCollectiveError` naming ``where``.

    Example::

        wait_named(reduce_scatter(out, grad, compressor, async_op=True), "fastcomm.fsdp reduce-scatter")
    """
    if work is None:
        return
    try:
        work.wait()
    except PeerCollectiveError as error:
        raise PeerCollectiveError(where, None, error.reason) from error
    except RuntimeError as error:
        raise PeerCollectiveError(where, None, error) from error
