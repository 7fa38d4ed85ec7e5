"""Triton kernels for blockwise absmax quantization, bit for bit ``reference.quantize_blockwise``.

One program quantizes ``rows`` whole blocks, laid out as a ``[rows, bytes, codes_per_byte]`` tile, so the
block's absmax is a reduction over the last two axes and the codes of one byte are summed into it along the
last axis. Every float operation is the reference's single fp32 operation in the same order; launches pass
``enable_fp_fusion=False`` so ``x * inv + (qmax + u)`` is never contracted into an FMA (the sm_90 PTX holds
``mul.rn.f32``/``add.rn.f32``), and divisions use ``tl.math.div_rn`` (``div.rn.f32``) rather than ``/``,
whose fp32 lowering is not promised to round correctly.
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

__all__ = ["dequantize_blockwise", "dequantize_blockwise_into", "quantize_blockwise"]

_MASK32 = 0xFFFFFFFF


@triton.jit
def _uniform_hash(index, seed32):
    """``(fmix32((index * 0x9E3779B1 mod 2**32) ^ seed32) >> 8) * 2**-24``: ``reference.uniform_hash``."""
    h = (index.to(tl.uint32) * 0x9E3779B1) ^ seed32
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _row_absmax(x):
    """Per-row max |x| of a ``[rows, bytes, per_byte]`` tile, and whether the row holds inf or NaN."""
    a = tl.abs(x)
    nonfinite = ((a != a) | (a == float("inf"))).to(tl.int32)
    return tl.max(tl.max(a, axis=2), axis=1), tl.max(tl.max(nonfinite, axis=2), axis=1)


@triton.jit
def _encode(x, inv, usable, index, seed32, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The codes ``1 .. 2*QMAX+1`` of a ``[rows, bytes, per_byte]`` fp32 tile (garbage where masked)."""
    v = tl.where(usable[:, None, None], x * inv[:, None, None], 0.0)
    if STOCHASTIC:
        w = v + (QMAX + _uniform_hash(index, seed32))
    else:
        w = v + (QMAX + 0.5)
    w = tl.minimum(tl.maximum(w, 0.0), 2.0 * QMAX)
    return w.to(tl.int32) + 1


@triton.jit
def _encode_and_store(
    acc, inv, usable, scale, index, mask, lane, seed32, target_ptr,
    QMAX: tl.constexpr, BITS: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """Stores the tile's new residual (if any); returns its ``[rows, bytes]`` packed bytes.

    The residual is ``acc - (code - QMAX - 1) * scale``: the reference's dequantized fp32 value, subtracted
    in fp32 and rounded once to the residual's dtype.
    """
    acc32 = to_float32(acc)
    code = _encode(acc32, inv, usable, index, seed32, QMAX, STOCHASTIC)
    if target_ptr is not None:
        sent = (code - (QMAX + 1)).to(tl.float32) * scale[:, None, None]
        tl.store(target_ptr + index, round_to(acc32 - sent, target_ptr.dtype.element_ty), mask=mask)
    code = tl.where(mask, code, 0)
    return tl.sum(code << (lane * BITS)[None, None, :], axis=2).to(tl.uint8)


# The seed is not specialised (a new compile for the value 1 buys nothing); block is, since block % 16 == 0
# lets loads vectorise, and so is n (see _common).
@triton.jit(do_not_specialize=["nblocks", "seed"])
def _quantize_kernel(
    x_ptr,
    source_ptr,
    target_ptr,
    out_ptr,
    scales_ptr,
    n,
    block,
    block_bytes,
    nblocks,
    seed,
    QMAX: tl.constexpr,
    BITS: tl.constexpr,
    PER_BYTE: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    LOOPS: tl.constexpr,
):
    rows, first, byte_col, lane, col = row_tile(block, ROWS, COLUMNS, PER_BYTE)
    seed32 = seed.to(tl.uint32)
    qmax = tl.full([ROWS], QMAX, tl.float32)

    # Pass 1: each row's absmax of acc = x + source, over the whole row in registers or in column tiles.
    if LOOPS:
        absmax = tl.zeros([ROWS], tl.float32)
        bad = tl.zeros([ROWS], tl.int32)
        for start in range(0, block, COLUMNS):
            index, mask = tile_index(first[:, None, None], start + col, n, block)
            tile_absmax, tile_bad = _row_absmax(to_float32(load_accumulated(x_ptr, source_ptr, index, mask)))
            absmax = tl.maximum(absmax, tile_absmax)
            bad = tl.maximum(bad, tile_bad)
    else:
        index, mask = tile_index(first[:, None, None], col, n, block)
        acc = load_accumulated(x_ptr, source_ptr, index, mask)
        absmax, bad = _row_absmax(to_float32(acc))

    usable = (bad == 0) & (absmax > 0.0)
    absmax = tl.where(bad != 0, float("nan"), absmax)
    scale = tl.math.div_rn(absmax, qmax)
    tl.store(scales_ptr + rows, scale, mask=rows < nblocks)
    inv = tl.where(usable, tl.math.div_rn(qmax, tl.where(usable, absmax, 1.0)), 0.0)
    usable = usable & (inv != float("inf"))  # a subnormal absmax overflows qmax / absmax
    inv = tl.where(usable, inv, 0.0)

    # Pass 2: encode, update the residual and store, from the registers of pass 1 or reading each column
    # tile again (before this pass overwrites it, when the source is the residual itself).
    if LOOPS:
        for start in range(0, block, COLUMNS):
            index, mask = tile_index(first[:, None, None], start + col, n, block)
            acc = load_accumulated(x_ptr, source_ptr, index, mask)
            packed = _encode_and_store(
                acc, inv, usable, scale, index, mask, lane, seed32, target_ptr, QMAX, BITS, STOCHASTIC
            )
            store_bytes(out_ptr, packed, rows, first, byte_col, start, n, block, block_bytes, PER_BYTE)
    else:
        packed = _encode_and_store(
            acc, inv, usable, scale, index, mask, lane, seed32, target_ptr, QMAX, BITS, STOCHASTIC
        )
        store_bytes(out_ptr, packed, rows, first, byte_col, 0, n, block, block_bytes, PER_BYTE)


@triton.jit(do_not_specialize=["nblocks"])
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    n,
    block,
    nblocks,
    QMAX: tl.constexpr,
    BITS: tl.constexpr,
    LANES: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    rows, first, scale = decoder_tile(scales_ptr, block, nblocks, ROWS)
    for start in range(0, block, COLUMNS):
        code, index, mask = load_codes(codes_ptr, first, start, n, block, BITS, LANES, COLUMNS)
        value = (code - (QMAX + 1)).to(tl.float32) * scale
        tl.store(out_ptr + index, round_to(value, out_ptr.dtype.element_ty), mask=mask)


def quantize_blockwise(
    x: torch.Tensor,
    bits: int = 8,
    block: int = 256,
    stochastic: bool = False,
    seed: int = 0,
    residual: torch.Tensor | None = None,
    residual_source: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`fastcomm.reference.quantize_blockwise` (same arguments, same bits out).

    1. One program per ``rows`` blocks: the block's absmax (NaN if it holds inf/NaN), ``scale`` and ``inv``.
    2. The same program encodes and packs its codes. When ``block`` is not a multiple of the codes per
       byte, a byte straddles two blocks: codes are then written one per byte and packed by a second kernel.

    3. With ``residual`` (error feedback) the same pass reads ``acc = x + residual`` (or ``x +
       residual_source``) and writes ``residual = acc - dequantized`` (fp32, rounded once): the gradient and
       the residual are read once, the codes, scales and residual written once.

    ``x`` and ``residual`` may have any strides (they are flattened; a strided residual is updated through a
    contiguous copy); ``seed`` is folded to 32 bits as ``(seed ^ (seed >> 32)) & 0xFFFFFFFF``. The outputs
    are on ``x``'s device.

    Raises:
        ValueError: ``residual_source`` is given without ``residual``.

    Example::

        >>> codes, scales = quantize_blockwise(torch.randn(1000, device="cuda"), bits=4)
    """
    operands = _common.residual_operands(residual, residual_source)
    flat = x.reshape(-1).contiguous()
    codes, scales = _common.launch_encoder(
        _quantize_kernel,
        (flat, operands.source, operands.target),
        flat,
        bits,
        block,
        scalars=((seed ^ (seed >> 32)) & _MASK32,),
        QMAX=2 ** (bits - 1) - 1,
        BITS=bits,
        STOCHASTIC=bool(stochastic),
    )
    operands.finish()
    return codes, scales


def dequantize_blockwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int = 8,
    block: int = 256,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Triton twin of :func:`fastcomm.reference.dequantize_blockwise`: ``(code - qmax - 1) * scale`` in fp32.

    One program per ``rows`` blocks, each byte loaded once when blocks hold whole bytes; the fp32 value is
    rounded to ``dtype`` to nearest even. The output is on ``codes``' device.

    Raises:
        ValueError: ``scales`` is on another device than ``codes``.

    Example::

        >>> out = dequantize_blockwise(*quantize_blockwise(g), numel=g.numel())
    """
    return _common.launch_decoder(
        _dequantize_kernel,
        "codes",
        codes,
        scales,
        numel,
        block,
        dtype,
        bits,
        QMAX=2 ** (bits - 1) - 1,
    )


def dequantize_blockwise_into(
    out: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int = 8,
    block: int = 256,
    accumulate: bool = False,
) -> None:
    """Triton twin of :func:`fastcomm.reference.dequantize_blockwise_into`, composed from the kernel above.

    Only the first ``ceil(out.numel() * bits / 8)`` codes and ``ceil(out.numel() / block)`` scales are
    read, through :func:`~fastcomm.triton._common.decode_into`.

    Example::

        >>> dequantize_blockwise_into(grad, *quantize_blockwise(g), accumulate=True)
    """

    def decode(codes: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blockwise(codes, scales, numel, bits, block, dtype)

    _common.decode_into(out, decode, codes, scales, bits, block, accumulate)
