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
from fastcomm.triton._common import decoder_tile, round_to, row_tile, store_bytes, tile_index, to_float32

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
def _encode(
    x,
    inv,
    usable,
    index,
    mask,
    lane,
    seed32,
    QMAX: tl.constexpr,
    BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Codes of a ``[rows, bytes, per_byte]`` fp32 tile, summed into its ``[rows, bytes]`` packed bytes."""
    v = tl.where(usable[:, None, None], x * inv[:, None, None], 0.0)
    if STOCHASTIC:
        w = v + (QMAX + _uniform_hash(index, seed32))
    else:
        w = v + (QMAX + 0.5)
    w = tl.minimum(tl.maximum(w, 0.0), 2.0 * QMAX)
    code = tl.where(mask, w.to(tl.int32) + 1, 0)
    return tl.sum(code << (lane * BITS)[None, None, :], axis=2).to(tl.uint8)


# Lengths and the seed are not specialised (a new compile per divisibility class, or for the value 1, buys
# nothing: they only bound masks); block is, since block % 16 == 0 lets loads vectorise.
@triton.jit(do_not_specialize=["n", "nblocks", "seed"])
def _quantize_kernel(
    x_ptr,
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

    # Pass 1: each row's absmax, over the whole row in registers or walked in column tiles.
    if LOOPS:
        absmax = tl.zeros([ROWS], tl.float32)
        bad = tl.zeros([ROWS], tl.int32)
        for start in range(0, block, COLUMNS):
            index, mask = tile_index(first[:, None, None], start + col, n, block)
            tile_absmax, tile_bad = _row_absmax(to_float32(tl.load(x_ptr + index, mask=mask, other=0.0)))
            absmax = tl.maximum(absmax, tile_absmax)
            bad = tl.maximum(bad, tile_bad)
    else:
        index, mask = tile_index(first[:, None, None], col, n, block)
        x = to_float32(tl.load(x_ptr + index, mask=mask, other=0.0))
        absmax, bad = _row_absmax(x)

    usable = (bad == 0) & (absmax > 0.0)
    absmax = tl.where(bad != 0, float("nan"), absmax)
    tl.store(scales_ptr + rows, tl.math.div_rn(absmax, qmax), mask=rows < nblocks)
    inv = tl.where(usable, tl.math.div_rn(qmax, tl.where(usable, absmax, 1.0)), 0.0)
    usable = usable & (inv != float("inf"))  # a subnormal absmax overflows qmax / absmax
    inv = tl.where(usable, inv, 0.0)

    # Pass 2: encode and store, from the registers of pass 1 or reading each column tile again.
    if LOOPS:
        for start in range(0, block, COLUMNS):
            index, mask = tile_index(first[:, None, None], start + col, n, block)
            x = to_float32(tl.load(x_ptr + index, mask=mask, other=0.0))
            packed = _encode(x, inv, usable, index, mask, lane, seed32, QMAX, BITS, STOCHASTIC)
            store_bytes(out_ptr, packed, rows, first, byte_col, start, n, block, block_bytes, PER_BYTE)
    else:
        packed = _encode(x, inv, usable, index, mask, lane, seed32, QMAX, BITS, STOCHASTIC)
        store_bytes(out_ptr, packed, rows, first, byte_col, 0, n, block, block_bytes, PER_BYTE)


@triton.jit(do_not_specialize=["n", "nblocks"])
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    n,
    block,
    nblocks,
    QMAX: tl.constexpr,
    BITS: tl.constexpr,
    PER_BYTE: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    scale, first, col = decoder_tile(scales_ptr, block, nblocks, ROWS, COLUMNS)
    for start in range(0, block, COLUMNS):
        index, mask = tile_index(first, start + col, n, block)
        byte = tl.load(codes_ptr + index // PER_BYTE, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((index % PER_BYTE) * BITS).to(tl.int32)) & ((1 << BITS) - 1)
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

    3. ``x`` may have any strides (it is flattened, and converted to fp32 in the kernel); ``seed`` is folded
       to 32 bits as ``(seed ^ (seed >> 32)) & 0xFFFFFFFF``. With ``residual``, ``x + residual`` is
       quantized and ``residual`` becomes ``acc - dequantized`` with torch ops around the kernel (not fused
       yet); ``residual_source`` is composed as ``residual.copy_(residual_source)`` then the in-place path.

    The outputs are on ``x``'s device.

    Example::

        >>> codes, scales = quantize_blockwise(torch.randn(1000, device="cuda"), bits=4)
    """
    _common.adopt_residual_source(residual, residual_source)
    if residual is not None:
        acc = x.reshape(-1) + residual.reshape(-1)
        codes, scales = quantize_blockwise(acc, bits, block, stochastic, seed)
        sent = dequantize_blockwise(codes, scales, acc.numel(), bits, block, torch.float32)
        residual.copy_((acc.float() - sent).to(x.dtype).view_as(residual))
        return codes, scales
    flat = x.reshape(-1).contiguous()
    return _common.launch_encoder(
        _quantize_kernel,
        (flat,),
        flat,
        bits,
        block,
        scalars=((seed ^ (seed >> 32)) & _MASK32,),
        QMAX=2 ** (bits - 1) - 1,
        BITS=bits,
        STOCHASTIC=bool(stochastic),
    )


def dequantize_blockwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int = 8,
    block: int = 256,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Triton twin of :func:`fastcomm.reference.dequantize_blockwise`: ``(code - qmax - 1) * scale`` in fp32.

    One program per ``rows`` blocks; the fp32 value is rounded to ``dtype`` to nearest even. The output is
    on ``codes``' device.

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
        QMAX=2 ** (bits - 1) - 1,
        BITS=bits,
        PER_BYTE=8 // bits,
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
