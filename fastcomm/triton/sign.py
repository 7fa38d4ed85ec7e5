"""Triton kernels for 1-bit sign compression with error feedback, the twins of ``reference.sign_compress``.

One program handles ``rows`` whole chunks laid out as ``[rows, bytes, 8]``: the chunk's mean magnitude is a
float64 sum over the last two axes (rounded to fp32 once, as the reference does), and the sign bits of one
byte are summed along the last axis. The residual update is one fp32 subtraction rounded to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastcomm.triton import _common
from fastcomm.triton._common import (
    decoder_tile,
    load_accumulated,
    load_codes,
    round_to,
    row_tile,
    store_bytes,
    tile_index,
    to_float32,
)

__all__ = ["sign_compress", "sign_decompress", "sign_decompress_into"]


@triton.jit
def _magnitude_sum(acc):
    """Per-row sum of ``|acc|`` over a ``[rows, bytes, 8]`` tile, in float64 (each value widened exactly)."""
    return tl.sum(tl.sum(tl.abs(to_float32(acc).to(tl.float64)), axis=2), axis=1)


@triton.jit
def _encode(acc, scale, index, mask, lane, target_ptr):
    """Stores the residual of a ``[rows, bytes, 8]`` tile (if any); returns its ``[rows, bytes]`` bytes."""
    acc32 = to_float32(acc)
    positive = acc32 >= 0.0
    if target_ptr is not None:
        sent = tl.where(positive, scale[:, None, None], -scale[:, None, None])
        tl.store(target_ptr + index, round_to(acc32 - sent, target_ptr.dtype.element_ty), mask=mask)
    bit = (positive & mask).to(tl.int32)
    return tl.sum(bit << lane[None, None, :], axis=2).to(tl.uint8)


@triton.jit(do_not_specialize=["nchunks"])  # n stays specialised so that masks vectorise (see _common)
def _sign_compress_kernel(
    x_ptr,
    source_ptr,
    target_ptr,
    out_ptr,
    scales_ptr,
    n,
    chunk,
    chunk_bytes,
    nchunks,
    PER_BYTE: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    LOOPS: tl.constexpr,
):
    rows, first, byte_col, lane, col = row_tile(chunk, ROWS, COLUMNS, PER_BYTE)
    count = tl.maximum(tl.minimum(n - first, chunk), 1).to(tl.float64)

    # Pass 1: each chunk's magnitude sum, over the whole chunk in registers or walked in column tiles.
    if LOOPS:
        total = tl.zeros([ROWS], tl.float64)
        for start in range(0, chunk, COLUMNS):
            index, mask = tile_index(first[:, None, None], start + col, n, chunk)
            total += _magnitude_sum(load_accumulated(x_ptr, source_ptr, index, mask))
    else:
        index, mask = tile_index(first[:, None, None], col, n, chunk)
        acc = load_accumulated(x_ptr, source_ptr, index, mask)
        total = _magnitude_sum(acc)

    scale = (total / count).to(tl.float32)
    tl.store(scales_ptr + rows, scale, mask=rows < nchunks)

    # Pass 2: encode, update the residual and store the bits.
    if LOOPS:
        # This pass reads the source before it overwrites it (when that is the residual): each element is
        # written once, after.
        for start in range(0, chunk, COLUMNS):
            index, mask = tile_index(first[:, None, None], start + col, n, chunk)
            acc = load_accumulated(x_ptr, source_ptr, index, mask)
            packed = _encode(acc, scale, index, mask, lane, target_ptr)
            store_bytes(out_ptr, packed, rows, first, byte_col, start, n, chunk, chunk_bytes, PER_BYTE)
    else:
        packed = _encode(acc, scale, index, mask, lane, target_ptr)
        store_bytes(out_ptr, packed, rows, first, byte_col, 0, n, chunk, chunk_bytes, PER_BYTE)


@triton.jit(do_not_specialize=["nchunks"])
def _sign_decompress_kernel(
    packed_ptr,
    scales_ptr,
    out_ptr,
    n,
    chunk,
    nchunks,
    BITS: tl.constexpr,
    LANES: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    rows, first, scale = decoder_tile(scales_ptr, chunk, nchunks, ROWS)
    for start in range(0, chunk, COLUMNS):
        bit, index, mask = load_codes(packed_ptr, first, start, n, chunk, BITS, LANES, COLUMNS)
        value = tl.where(bit != 0, scale, -scale)
        tl.store(out_ptr + index, round_to(value, out_ptr.dtype.element_ty), mask=mask)


def sign_compress(
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    chunk: int = 2048,
    residual_source: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`fastcomm.reference.sign_compress`; ``residual`` is updated in place.

    1. One program per ``rows`` chunks: ``acc = x + residual`` in ``x``'s dtype, ``scale = mean |acc|``
       (float64 sum, one rounding to fp32).
    2. The same program packs the bits ``acc >= 0`` and writes ``residual = acc - (±scale)``. When ``chunk``
       is not a multiple of 8 a byte straddles two chunks, so bits go one per byte and a second kernel packs.

    3. ``residual_source``, when given, is read in place of ``residual`` (which is only written): the bits
       of ``residual.copy_(residual_source)`` and the in-place call, in the same single pass.

    ``x`` and ``residual`` may have any strides (a strided residual is updated through a contiguous copy).
    The outputs are on ``x``'s device.

    Raises:
        ValueError: ``residual_source`` is given without ``residual``.

    Example::

        >>> g = torch.randn(5000, device="cuda"); r = torch.zeros_like(g)
        >>> packed, scales = sign_compress(g, r)
    """
    operands = _common.residual_operands(residual, residual_source)
    flat = x.reshape(-1).contiguous()
    packed, scales = _common.launch_encoder(
        _sign_compress_kernel, (flat, operands.source, operands.target), flat, 1, chunk
    )
    operands.finish()
    return packed, scales


def sign_decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    chunk: int = 2048,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Triton twin of :func:`fastcomm.reference.sign_decompress`: ``+scale`` for bit 1, ``-scale`` for 0.

    One program per ``rows`` chunks; the fp32 scale is rounded to ``dtype`` to nearest even. The output is on
    ``packed``'s device.

    Raises:
        ValueError: ``scales`` is on another device than ``packed``.

    Example::

        >>> out = sign_decompress(*sign_compress(g), numel=g.numel())
    """
    return _common.launch_decoder(_sign_decompress_kernel, "packed", packed, scales, numel, chunk, dtype, 1)


def sign_decompress_into(
    out: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    chunk: int = 2048,
    accumulate: bool = False,
) -> None:
    """Triton twin of :func:`fastcomm.reference.sign_decompress_into`, composed from the kernel above.

    Only the first ``ceil(out.numel() / 8)`` bytes and ``ceil(out.numel() / chunk)`` scales are read,
    through :func:`~fastcomm.triton._common.decode_into`.

    Example::

        >>> sign_decompress_into(grad, *sign_compress(g), accumulate=True)
    """

    def decode(packed: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return sign_decompress(packed, scales, numel, chunk, dtype)

    _common.decode_into(out, decode, packed, scales, 1, chunk, accumulate)
