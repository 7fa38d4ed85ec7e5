"""Compressed gradient reduction for FSDP2 (``torch.distributed.fsdp.fully_shard``) and HSDP.

==============================  =====================================================================
what                            how
==============================  =====================================================================
``compress(model, name, ...)``  every FSDP module's reduce-scatter compressed
                                (:class:`CompressedReduceScatter`: one all-to-all of codes)
``replicate_group=``            HSDP: the in-node reduce-scatter dense, the cross-replica all-reduce of
                                the shard compressed (:class:`CompressedReplicaAllReduce`)
``quantized_all_gather=True``   weights unsharded from 8-bit codes (:class:`QuantizedAllGather`, qwZ)
==============================  =====================================================================

All of them run the exchanges of :mod:`fastcomm.collectives`; a failed peer raises
:class:`~fastcomm.PeerCollectiveError`. See ``docs/fsdp.md``.

Example::

    import fastcomm.fsdp
    fully_shard(model)
    compression = fastcomm.fsdp.compress(model, "quantize", bits=8, stochastic=False)
    ...
    print(compression.stats())
"""

from fastcomm.fsdp.all_gather import QuantizedAllGather
from fastcomm.fsdp.compression import FSDPCompression, compress
from fastcomm.fsdp.reduce_scatter import CompressedReduceScatter
from fastcomm.fsdp.replicate import CompressedReplicaAllReduce

__all__ = [
    "CompressedReduceScatter",
    "CompressedReplicaAllReduce",
    "FSDPCompression",
    "QuantizedAllGather",
    "compress",
]
