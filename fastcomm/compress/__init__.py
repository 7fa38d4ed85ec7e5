"""Gradient compressors: the :class:`Compressor` protocol, its implementations and the table of their names.

Every compressor has one name (:mod:`fastcomm.compress.registry`), the same for DDP hooks, FSDP, DiLoCo and
the collectives; ``fastcomm.compressor(name, **options)`` builds one:

============  ======================  ===================================  =================================
name          class                   options (defaults)                   payload
============  ======================  ===================================  =================================
``topk``      ``TopKCompressor``      ``k`` (required), ``exact=False``    k int32 indices + k values
``quantize``  ``QuantCompressor``     ``bits=8`` (8, 4 or 2),              bits-wide codes + one fp32 absmax
                                      ``block=256``, ``stochastic=True``   per block (blockwise)
``sign``      ``SignCompressor``      ``chunk=2048``                       1 bit per element + one fp32 mean
                                                                           magnitude per chunk (blockwise)
``cast``      ``CastCompressor``      ``dtype=torch.bfloat16``             2 bytes per element (blockwise,
                                      (or ``torch.float16``)               block 1)
``powersgd``  ``PowerSGDCompressor``  ``rank=4``, ``warm_start=True``,     rank-r factors P, Q of each
                                      ``orthogonalization="qr"``           matrix (two allreduces, summed)
============  ======================  ===================================  =================================

``sparseloco`` (``SparseLoCoCompressor``; ``k=120``, ``chunk=4096``, ``decay=1.0``) sends, per chunk, the
k largest entries as 16-bit positions and 2-bit values with one fp32 scale, with (decaying) error feedback:
SparseLoCo's compressor for DiLoCo's pseudo-gradients (:mod:`fastcomm.compress.sparseloco`).

Renamed names still resolve for one release with a ``DeprecationWarning`` naming the new one: ``"cast16"``
is ``"cast"``. ``"auto"``, ``"compressor"`` and ``"none"`` are reserved (the hooks and DiLoCo give them other
meanings).

``PowerSGDCompressor`` is an :class:`AllreduceCompressor`: its payloads are summed over ranks, not decoded
per rank, so it has its own protocol (two allreduces per bucket, sizes from the parameter shapes).

A new compressor is one file here implementing :class:`Compressor` and one row in
:data:`~fastcomm.compress.registry.BUILT_IN` (or, from user code, a call to :func:`add_compressor`); the
hooks' bucket store gives it error feedback, rebuild inheritance, skipped-step staging and checkpoints.

Example::

    q = fastcomm.compressor("quantize", bits=8, block=256)
    payload = torch.empty(q.wire_bytes(x.numel(), x.dtype), dtype=torch.uint8)
    q.compress_into(payload, x, residual, residual, seed=0)
"""

from fastcomm.compress.cast import CastCompressor
from fastcomm.compress.powersgd import PowerSGDCompressor, orthogonalize_
from fastcomm.compress.protocol import AllreduceCompressor, Compressor, all_finite, scale_all_finite_
from fastcomm.compress.quantize import QuantCompressor
from fastcomm.compress.registry import add_compressor, compressor, compressor_of, label
from fastcomm.compress.sign import SignCompressor
from fastcomm.compress.sparseloco import SparseLoCoCompressor
from fastcomm.compress.topk import TopKCompressor, fit_to_k

__all__ = [
    "AllreduceCompressor",
    "CastCompressor",
    "Compressor",
    "PowerSGDCompressor",
    "QuantCompressor",
    "SignCompressor",
    "SparseLoCoCompressor",
    "TopKCompressor",
    "add_compressor",
    "all_finite",
    "compressor",
    "compressor_of",
    "label",
    "scale_all_finite_",
    "fit_to_k",
    "orthogonalize_",
]
