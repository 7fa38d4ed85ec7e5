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

from fastcomm.triton._common import device_guard, pack_codes, round_to, store_decoded, tile_for, to_float32

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
    BYTES: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    LOOPS: tl.constexpr,
):
    COLUMNS: tl.constexpr = BYTES * PER_BYTE
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    first = rows * block
    byte_col = tl.arange(0, BYTES)
    lane = tl.arange(0, PER_BYTE)
    col = byte_col[None, :, None] * PER_BYTE + lane[None, None, :]
    seed32 = seed.to(tl.uint32)
    qmax = tl.full([ROWS], QMAX, tl.float32)

    if LOOPS:
        absmax = tl.zeros([ROWS], tl.float32)
        bad = tl.zeros([ROWS], tl.int32)
        for start in range(0, block, COLUMNS):
            c = start + col
            index = first[:, None, None] + c
            x = to_float32(tl.load(x_ptr + index, mask=(c < block) & (index < n), other=0.0))
            tile_absmax, tile_bad = _row_absmax(x)
            absmax = tl.maximum(absmax, tile_absmax)
            bad = tl.maximum(bad, tile_bad)
    else:
        index = first[:, None, None] + col
        mask = (col < block) & (index < n)
        x = to_float32(tl.load(x_ptr + index, mask=mask, other=0.0))
        absmax, bad = _row_absmax(x)

    usable = (bad == 0) & (absmax > 0.0)
    absmax = tl.where(bad != 0, float("nan"), absmax)
    tl.store(scales_ptr + rows, tl.math.div_rn(absmax, qmax), mask=rows < nblocks)
    inv = tl.where(usable, tl.math.div_rn(qmax, tl.where(usable, absmax, 1.0)), 0.0)
    usable = usable & (inv != float("inf"))  # a subnormal absmax overflows qmax / absmax
    inv = tl.where(usable, inv, 0.0)

    if LOOPS:
        for start in range(0, block, COLUMNS):
            c = start + col
            index = first[:, None, None] + c
            mask = (c < block) & (index < n)
            x = to_float32(tl.load(x_ptr + index, mask=mask, other=0.0))
            packed = _encode(x, inv, usable, index, mask, lane, seed32, QMAX, BITS, STOCHASTIC)
            bc = start // PER_BYTE + byte_col[None, :]
            byte_ok = (bc * PER_BYTE < block) & (first[:, None] + bc * PER_BYTE < n)
            tl.store(out_ptr + rows[:, None] * block_bytes + bc, packed, mask=byte_ok)
    else:
        packed = _encode(x, inv, usable, index, mask, lane, seed32, QMAX, BITS, STOCHASTIC)
        bc = byte_col[None, :]
        byte_ok = (bc * PER_BYTE < block) & (first[:, None] + bc * PER_BYTE < n)
        tl.store(out_ptr + rows[:, None] * block_bytes + bc, packed, mask=byte_ok)


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
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    scale = tl.load(scales_ptr + rows, mask=rows < nblocks, other=0.0)[:, None]
    first = rows[:, None] * block
    col = tl.arange(0, COLUMNS)[None, :]
    for start in range(0, block, COLUMNS):
        c = start + col
        index = first + c
        mask = (c < block) & (index < n)
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

    Args:
        x: fp32/fp16/bf16 tensor of any shape and strides (flattened; converted to fp32 in the kernel).
        bits: 8, 4 or 2.
        block: elements per scale, any positive int.
        stochastic: ``u`` from the counter hash of ``(index, seed)`` instead of 0.5.
        seed: int64 seed, folded to 32 bits as ``(seed ^ (seed >> 32)) & 0xFFFFFFFF``.
        residual: error-feedback buffer like ``x``: ``x + residual`` is quantized and ``residual`` becomes
            ``acc - dequantized`` (fp32, rounded once), with torch ops around the kernel (not fused yet).
        residual_source: read instead of ``residual`` for ``acc``; composed as
            ``residual.copy_(residual_source)`` followed by the in-place path (needs ``residual``).

    Returns:
        ``(codes uint8 of ceil(n * bits / 8), scales float32 of ceil(n / block))`` on ``x``'s device.

    Example::

        >>> codes, scales = quantize_blockwise(torch.randn(1000, device="cuda"), bits=4)
    """
    if residual_source is not None:
        if residual is None:
            raise ValueError("residual_source needs residual: acc - sent is written to residual")
        residual.copy_(residual_source)  # a no-op when they are the same tensor
    if residual is not None:
        acc = x.reshape(-1) + residual.reshape(-1)
        codes, scales = quantize_blockwise(acc, bits, block, stochastic, seed)
        sent = dequantize_blockwise(codes, scales, acc.numel(), bits, block, torch.float32)
        residual.copy_((acc.float() - sent).to(x.dtype).view_as(residual))
        return codes, scales
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    nblocks = triton.cdiv(n, block)
    per_byte = 8 // bits
    codes = torch.empty(triton.cdiv(n * bits, 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    if n == 0:
        return codes, scales
    aligned = block % per_byte == 0
    layout = per_byte if aligned else 1
    target = codes if aligned else torch.empty(n, dtype=torch.uint8, device=x.device)
    tile = tile_for(block, align=layout)
    seed32 = (seed ^ (seed >> 32)) & _MASK32
    with device_guard(flat):
        _quantize_kernel[(triton.cdiv(nblocks, tile.rows),)](
            flat,
            target,
            scales,
            n,
            block,
            block // layout,
            nblocks,
            seed32,
            QMAX=2 ** (bits - 1) - 1,
            BITS=bits,
            PER_BYTE=layout,
            ROWS=tile.rows,
            BYTES=tile.columns // layout,
            STOCHASTIC=bool(stochastic),
            LOOPS=tile.loops,
            num_warps=tile.num_warps,
            enable_fp_fusion=False,
        )
    if not aligned:
        pack_codes(target, bits, out=codes)
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

    Args:
        codes: packed uint8 codes from :func:`quantize_blockwise`.
        scales: fp32 scales, one per block.
        numel: how many values to produce.
        bits: 8, 4 or 2.
        block: elements per scale.
        dtype: output dtype (fp32/fp16/bf16, rounded to nearest even from fp32).

    Returns:
        A 1-D tensor of ``numel`` values on ``codes``' device.

    Raises:
        ValueError: ``scales`` is on another device than ``codes``.

    Example::

        >>> out = dequantize_blockwise(*quantize_blockwise(g), numel=g.numel())
    """
    if scales.device != codes.device:
        raise ValueError(f"scales must be on codes' device {codes.device}, got {scales.device}")
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    if numel == 0:
        return out
    nblocks = triton.cdiv(numel, block)
    tile = tile_for(block)
    with device_guard(codes):
        _dequantize_kernel[(triton.cdiv(nblocks, tile.rows),)](
            codes.contiguous(),
            scales.contiguous(),
            out,
            numel,
            block,
            nblocks,
            QMAX=2 ** (bits - 1) - 1,
            BITS=bits,
            PER_BYTE=8 // bits,
            ROWS=tile.rows,
            COLUMNS=tile.columns,
            num_warps=tile.num_warps,
            enable_fp_fusion=False,
        )
    return out


def dequantize_blockwise_into(
    out: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int = 8,
    block: int = 256,
    accumulate: bool = False,
) -> None:
    """Triton twin of :func:`fastcomm.reference.dequantize_blockwise_into`, composed from the kernel above.

    The first ``ceil(numel * bits / 8)`` codes and ``ceil(numel / block)`` scales of the payload are decoded
    (in ``out.dtype``, or in fp32 when accumulating) and stored with :func:`store_decoded`.

    Args:
        out: contiguous fp32/fp16/bf16 tensor; ``numel = out.numel()``.
        codes: packed uint8 codes, at least as many as ``numel`` values need.
        scales: fp32 scales, at least ``ceil(numel / block)``.
        bits: 8, 4 or 2.
        block: elements per scale.
        accumulate: add to ``out`` (in fp32, rounded once) instead of overwriting it.

    Example::

        >>> dequantize_blockwise_into(grad, *quantize_blockwise(g), accumulate=True)
    """
    n = out.numel()
    codes = codes.reshape(-1)[: triton.cdiv(n * bits, 8)]
    scales = scales.reshape(-1)[: triton.cdiv(n, block)]
    dtype = torch.float32 if accumulate else out.dtype
    store_decoded(out, dequantize_blockwise(codes, scales, n, bits, block, dtype), accumulate)
