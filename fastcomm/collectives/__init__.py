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

Error feedback is the caller's: a :class:`Residual` per tensor, passed to every call; the DDP hooks, FSDP
and DiLoCo keep theirs in it too (:mod:`.residual`: what a rank owes, ``residual_dtype``, re-sharding).
Failures raise :class:`~fastcomm.PeerCollectiveError`. Modules: :mod:`.two_phase`, :mod:`.gather` and
:mod:`.rounds` hold the exchanges (used as they are by :mod:`fastcomm.hooks`).

What the hooks, FSDP and DiLoCo build on besides the three calls is public here too, one place each:

======================================  ================================================================
name                                    what it is
======================================  ================================================================
``DEFAULT_CHUNK_BYTES``                 the payload of one piece of a chunked exchange
``block_unit``, ``segment_layout``      how a blockwise exchange cuts a tensor into ranks' segments
``all_gather_flat``                     ``torch.distributed``'s flat all-gather, whatever this torch names it
``completed``                           a future that already holds a tensor
``Residual``, ``mean_over_ranks``      the error-feedback store every mode keeps, and how it re-shards
``Traffic``, ``ring_bytes``             the byte counter every mode reports (``sent_bytes``, ``dense_bytes``),
                                        and what a dense ring all-reduce sends
``exchange_seed``, ``piece_seed``,      the one seed formula of every mode, and each mode's stream
``bucket_stream``, ``group_stream``     (:mod:`.seeds`)
``Timer``                               the wall time of the ``with`` blocks it guards
``then``, ``when_done``                 future callbacks that a clean interpreter exit waits for
``OrderedWorker``                       a thread that runs jobs in submission order
``SecondCollective``, ``lane_for``,     the lane: where an exchange's second collective is issued
``finish_on_lane``, ``timeout_of``,
``release_lane``
``wait_for_peers``                      what runs before a group is made at first use: a dead peer fails
                                        it at once, not after the timeout
======================================  ================================================================

Example::

    import fastcomm
    compressor = fastcomm.compress.QuantCompressor(bits=8)
    residual = fastcomm.collectives.Residual()
    fastcomm.collectives.all_reduce(tensor, compressor, residual=residual)
"""

from fastcomm.collectives._lane import (
    SecondCollective,
    finish_on_lane,
    lane_for,
    release_lane,
    timeout_of,
    wait_for_peers,
)
from fastcomm.collectives._layout import (
    DEFAULT_CHUNK_BYTES,
    Timer,
    all_gather_flat,
    block_unit,
    completed,
    segment_layout,
)
from fastcomm.collectives._threads import OrderedWorker, then, when_done
from fastcomm.collectives.api import CompressedWork, all_gather, all_reduce, reduce_scatter
from fastcomm.collectives.errors import PeerCollectiveError
from fastcomm.collectives.residual import Residual, mean_over_ranks
from fastcomm.collectives.seeds import bucket_stream, exchange_seed, group_stream, piece_seed
from fastcomm.collectives.traffic import Traffic, ring_bytes

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "CompressedWork",
    "OrderedWorker",
    "PeerCollectiveError",
    "Residual",
    "SecondCollective",
    "Timer",
    "Traffic",
    "all_gather",
    "all_gather_flat",
    "all_reduce",
    "block_unit",
    "bucket_stream",
    "completed",
    "exchange_seed",
    "finish_on_lane",
    "group_stream",
    "lane_for",
    "mean_over_ranks",
    "piece_seed",
    "reduce_scatter",
    "release_lane",
    "ring_bytes",
    "segment_layout",
    "then",
    "timeout_of",
    "wait_for_peers",
    "when_done",
]
