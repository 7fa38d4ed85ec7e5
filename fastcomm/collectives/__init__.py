"""Compressed collectives over flat tensors: the exchanges the DDP hooks, FSDP and DiLoCo are built on.

==================  ==========================================================================
function            what travels (per rank)
==================  ==========================================================================
``all_reduce``      blockwise compressors: a compressed all-to-all then a compressed all-gather
                    (about twice the compressed tensor); others: every payload all-gathered;
                    ``AllreduceCompressor`` (PowerSGD): two fp32 allreduces of its factors
``reduce_scatter``  one compressed all-to-all (``(W - 1) / W`` of the compressed tensor)
``all_gather``      one all-gather of the compressed input
==================  ==========================================================================

Error feedback is the caller's: a :class:`Residual` per tensor, passed to every call. Failures raise
:class:`~fastcomm.PeerCollectiveError`. Modules: :mod:`.two_phase`, :mod:`.gather` and :mod:`.rounds`
hold the exchanges (used as they are by :mod:`fastcomm.hooks`), :mod:`._layout` how tensors are cut,
:mod:`._lane` where a second collective is issued, :mod:`._threads` the callbacks' bookkeeping.

Example::

    import fastcomm
    compressor = fastcomm.compress.QuantCompressor(bits=8)
    residual = fastcomm.collectives.Residual()
    fastcomm.collectives.all_reduce(tensor, compressor, residual=residual)
"""

from fastcomm.collectives.api import CompressedWork, Residual, all_gather, all_reduce, reduce_scatter
from fastcomm.collectives.errors import PeerCollectiveError

__all__ = ["CompressedWork", "PeerCollectiveError", "Residual", "all_gather", "all_reduce", "reduce_scatter"]
