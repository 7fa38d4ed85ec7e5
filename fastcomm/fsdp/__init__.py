"""Compressed gradient reduction for FSDP2 (``torch.distributed.fsdp.fully_shard``) and HSDP.

==============================  =====================================================================
what                            how
==============================  =====================================================================
``compress(model, name, ...)``  FSDP (a 1-D mesh): every FSDP module's reduce-scatter compressed
                                (:class:`CompressedReduceScatter`: one all-to-all of codes)
the same, 2-D mesh              HSDP, the model on a ``("replicate", "shard")`` mesh: the in-node
                                reduce-scatter dense, the cross-replica all-reduce of the shard
                                compressed (:class:`CompressedReplicaAllReduce`, :mod:`fastcomm.fsdp.mesh`)
``replicate_group=``            the same HSDP for a model sharded on ``mesh["shard"]``
``quantized_all_gather=True``   weights unsharded from 8-bit codes (:class:`QuantizedAllGather`, qwZ)
another world size              ``FSDPCompression.merge_state_dicts``: residuals re-sharded (FSDP; not HSDP,
                                :class:`FSDPReshardError`), :mod:`fastcomm.fsdp.reshard`
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
from fastcomm.fsdp.mesh import HSDPMeshError
from fastcomm.fsdp.reduce_scatter import CompressedReduceScatter
from fastcomm.fsdp.replicate import CompressedReplicaAllReduce
from fastcomm.fsdp.reshard import FSDPReshardError

__all__ = [
    "CompressedReduceScatter",
    "CompressedReplicaAllReduce",
    "FSDPCompression",
    "FSDPReshardError",
    "HSDPMeshError",
    "QuantizedAllGather",
    "compress",
]
