"""Gradient compressors usable outside a hook: the :class:`Compressor` protocol and its implementations.

=====================  ==========================================================  =========
compressor             payload                                                     blockwise
=====================  ==========================================================  =========
``SignCompressor``     1 bit per element + one fp32 mean magnitude per chunk       yes
``QuantCompressor``    8/4/2-bit codes + one fp32 absmax per block                 yes
``TopKCompressor``     k int32 indices + k values                                  no
``PowerSGDCompressor`` rank-r factors P, Q of each matrix (two allreduces)         no
``CastCompressor``     values as bf16/fp16 (2 bytes each)                          yes (block 1)
=====================  ==========================================================  =========

``PowerSGDCompressor`` is an :class:`AllreduceCompressor`: its payloads are summed over ranks, not decoded
per rank, so it has its own protocol (two allreduces per bucket, sizes from the parameter shapes).

A new compressor is one file here implementing :class:`Compressor` and one row in
``fastcomm.hooks.HOOKS`` (or a call to ``fastcomm.hooks.add_compressor``); the hooks'
bucket store gives it error feedback, rebuild inheritance, skipped-step staging and checkpoints.

Example::

    from fastcomm.compress import QuantCompressor
    q = QuantCompressor(bits=8, block=256)
    payload = torch.empty(q.wire_bytes(x.numel(), x.dtype), dtype=torch.uint8)
    q.compress_into(payload, x, residual, residual, seed=0)
"""

from fastcomm.compress.cast import CastCompressor
from fastcomm.compress.powersgd import PowerSGDCompressor, orthogonalize_
from fastcomm.compress.protocol import AllreduceCompressor, Compressor, all_finite, scale_all_finite_
from fastcomm.compress.quantize import QuantCompressor
from fastcomm.compress.sign import SignCompressor
from fastcomm.compress.topk import TopKCompressor, fit_to_k

__all__ = [
    "AllreduceCompressor",
    "CastCompressor",
    "Compressor",
    "PowerSGDCompressor",
    "QuantCompressor",
    "SignCompressor",
    "TopKCompressor",
    "all_finite",
    "scale_all_finite_",
    "fit_to_k",
    "orthogonalize_",
]
