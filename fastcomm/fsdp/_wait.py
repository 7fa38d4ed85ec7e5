"""Waiting for a compressed collective: a failure on the wire raises :class:`~fastcomm.PeerCollectiveError`.

A collective of :mod:`fastcomm.collectives` finishes in a future's callback; torch re-raises a callback's
error as a plain ``RuntimeError`` (the type does not cross the future). FSDP calls its comms from autograd,
where a plain error would read as a bug of the model: so the FSDP comms issue their collective with
``async_op=True`` (argument errors raise there, as they are) and wait here, where whatever fails is the
exchange with the other ranks.
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
    except PeerCollectiveError:
        raise
    except RuntimeError as error:
        raise PeerCollectiveError(where, None, error) from error
