"""Triton kernels for 1-bit sign compression with error feedback, the twins of ``reference.sign_compress``.

One program handles ``rows`` whole chunks laid out as ``[rows, bytes, 8]``: the chunk's mean magnitude is a
float64 sum over the last two axes (rounded to fp32 once, as the reference does), and the sign bits of one
byte are summed along the last axis. The residual update is one fp32 subtraction rounded to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastcomm.triton._common import device_guard, pack_codes, round_to, store_decoded, tile_for, to_float32

__all__ = ["sign_compress", "sign_decompress", "sign_decompress_into"]


@triton.jit
def _accumulate(x_ptr, residual_ptr, index, mask, HAS_RESIDUAL: tl.constexpr):
    """``x + residual`` in ``x``'s dtype (one fp32 add rounded once, which equals the dtype's own add)."""
    x = tl.load(x_ptr + index, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + index, mask=mask, other=0.0)
        x = round_to(to_float32(x) + to_float32(r), x_ptr.dtype.element_ty)
    return x


@triton.jit
def _encode(acc, scale, index, mask, lane, residual_ptr, HAS_RESIDUAL: tl.constexpr):
    """Stores the residual of a ``[rows, bytes, 8]`` tile and returns its ``[rows, bytes]`` sign bytes."""
    acc32 = to_float32(acc)
    positive = acc32 >= 0.0
    if HAS_RESIDUAL:
        sent = tl.where(positive, scale[:, None, None], -scale[:, None, None])
        tl.store(residual_ptr + index, round_to(acc32 - sent, residual_ptr.dtype.element_ty), mask=mask)
    bit = (positive & mask).to(tl.int32)
    return tl.sum(bit << lane[None, None, :], axis=2).to(tl.uint8)


@triton.jit(do_not_specialize=["n", "nchunks"])  # lengths only bound masks
def _sign_compress_kernel(
    x_ptr,
    residual_ptr,
    out_ptr,
    scales_ptr,
    n,
    chunk,
    chunk_bytes,
    nchunks,
    HAS_RESIDUAL: tl.constexpr,
    PER_BYTE: tl.constexpr,
    ROWS: tl.constexpr,
    BYTES: tl.constexpr,
    LOOPS: tl.constexpr,
):
    COLUMNS: tl.constexpr = BYTES * PER_BYTE
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    first = rows * chunk
    byte_col = tl.arange(0, BYTES)
    lane = tl.arange(0, PER_BYTE)
    col = byte_col[None, :, None] * PER_BYTE + lane[None, None, :]
    count = tl.maximum(tl.minimum(n - first, chunk), 1).to(tl.float64)

    if LOOPS:
        total = tl.zeros([ROWS], tl.float64)
        for start in range(0, chunk, COLUMNS):
            c = start + col
            index = first[:, None, None] + c
            acc = _accumulate(x_ptr, residual_ptr, index, (c < chunk) & (index < n), HAS_RESIDUAL)
            total += tl.sum(tl.sum(tl.abs(to_float32(acc).to(tl.float64)), axis=2), axis=1)
    else:
        index = first[:, None, None] + col
        mask = (col < chunk) & (index < n)
        acc = _accumulate(x_ptr, residual_ptr, index, mask, HAS_RESIDUAL)
        total = tl.sum(tl.sum(tl.abs(to_float32(acc).to(tl.float64)), axis=2), axis=1)

    scale = (total / count).to(tl.float32)
    tl.store(scales_ptr + rows, scale, mask=rows < nchunks)

    if LOOPS:
        # The second pass reads the residual it has not yet overwritten: each element is written once, after.
        for start in range(0, chunk, COLUMNS):
            c = start + col
            index = first[:, None, None] + c
            mask = (c < chunk) & (index < n)
            acc = _accumulate(x_ptr, residual_ptr, index, mask, HAS_RESIDUAL)
            packed = _encode(acc, scale, index, mask, lane, residual_ptr, HAS_RESIDUAL)
            bc = start // PER_BYTE + byte_col[None, :]
            byte_ok = (bc * PER_BYTE < chunk) & (first[:, None] + bc * PER_BYTE < n)
            tl.store(out_ptr + rows[:, None] * chunk_bytes + bc, packed, mask=byte_ok)
    else:
        packed = _encode(acc, scale, index, mask, lane, residual_ptr, HAS_RESIDUAL)
        bc = byte_col[None, :]
        byte_ok = (bc * PER_BYTE < chunk) & (first[:, None] + bc * PER_BYTE < n)
        tl.store(out_ptr + rows[:, None] * chunk_bytes + bc, packed, mask=byte_ok)


@triton.jit(do_not_specialize=["n", "nchunks"])
def _sign_decompress_kernel(
    packed_ptr, scales_ptr, out_ptr, n, chunk, nchunks, ROWS: tl.constexpr, COLUMNS: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    scale = tl.load(scales_ptr + rows, mask=rows < nchunks, other=0.0)[:, None]
    first = rows[:, None] * chunk
    col = tl.arange(0, COLUMNS)[None, :]
    for start in range(0, chunk, COLUMNS):
        c = start + col
        index = first + c
        mask = (c < chunk) & (index < n)
        byte = tl.load(packed_ptr + index // 8, mask=mask, other=0).to(tl.int32)
        value = tl.where(((byte >> (index % 8).to(tl.int32)) & 1) != 0, scale, -scale)
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

    Args:
        x: fp32/fp16/bf16 tensor of any shape and strides (flattened).
        residual: error-feedback buffer like ``x`` or ``None``.
        chunk: elements per scale, any positive int.
        residual_source: read instead of ``residual`` for ``acc``; composed as
            ``residual.copy_(residual_source)`` followed by the in-place path (needs ``residual``).

    Returns:
        ``(packed uint8 of ceil(n / 8), scales float32 of ceil(n / chunk))`` on ``x``'s device.

    Example::

        >>> g = torch.randn(5000, device="cuda"); r = torch.zeros_like(g)
        >>> packed, scales = sign_compress(g, r)
    """
    if residual_source is not None:
        if residual is None:
            raise ValueError("residual_source needs residual: acc - sent is written to residual")
        residual.copy_(residual_source)  # a no-op when they are the same tensor
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    nchunks = triton.cdiv(n, chunk)
    packed = torch.empty(triton.cdiv(n, 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(nchunks, dtype=torch.float32, device=x.device)
    if n == 0:
        return packed, scales
    has_residual = residual is not None
    # The kernel updates a flat contiguous buffer; a strided residual gets the result copied back.
    in_place = has_residual and residual.is_contiguous()
    if not has_residual:
        work = flat
    elif in_place:
        work = residual.view(-1)
    else:
        work = residual.reshape(-1).contiguous()
    aligned = chunk % 8 == 0
    layout = 8 if aligned else 1
    target = packed if aligned else torch.empty(n, dtype=torch.uint8, device=x.device)
    tile = tile_for(chunk, align=layout)
    with device_guard(flat):
        _sign_compress_kernel[(triton.cdiv(nchunks, tile.rows),)](
            flat,
            work,
            target,
            scales,
            n,
            chunk,
            chunk // layout,
            nchunks,
            HAS_RESIDUAL=has_residual,
            PER_BYTE=layout,
            ROWS=tile.rows,
            BYTES=tile.columns // layout,
            LOOPS=tile.loops,
            num_warps=tile.num_warps,
            enable_fp_fusion=False,
        )
    if not aligned:
        pack_codes(target, 1, out=packed)
    if has_residual and not in_place:
        residual.copy_(work.view_as(residual))
    return packed, scales


def sign_decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    chunk: int = 2048,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Triton twin of :func:`fastcomm.reference.sign_decompress`: ``+scale`` for bit 1, ``-scale`` for 0.

    Args:
        packed: uint8 sign bits from :func:`sign_compress`.
        scales: fp32 scales, one per chunk.
        numel: how many values to produce.
        chunk: elements per scale.
        dtype: output dtype (fp32/fp16/bf16, rounded to nearest even).

    Returns:
        A 1-D tensor of ``numel`` values on ``packed``'s device.

    Raises:
        ValueError: ``scales`` is on another device than ``packed``.

    Example::

        >>> out = sign_decompress(*sign_compress(g), numel=g.numel())
    """
    if scales.device != packed.device:
        raise ValueError(f"scales must be on packed's device {packed.device}, got {scales.device}")
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    if numel == 0:
        return out
    nchunks = triton.cdiv(numel, chunk)
    tile = tile_for(chunk)
    with device_guard(packed):
        _sign_decompress_kernel[(triton.cdiv(nchunks, tile.rows),)](
            packed.contiguous(),
            scales.contiguous(),
            out,
            numel,
            chunk,
            nchunks,
            ROWS=tile.rows,
            COLUMNS=tile.columns,
            num_warps=tile.num_warps,
            enable_fp_fusion=False,
        )
    return out


def sign_decompress_into(
    out: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    chunk: int = 2048,
    accumulate: bool = False,
) -> None:
    """Triton twin of :func:`fastcomm.reference.sign_decompress_into`, composed from the kernel above.

    The first ``ceil(numel / 8)`` bytes and ``ceil(numel / chunk)`` scales of the payload are decoded (in
    ``out.dtype``, or in fp32 when accumulating) and stored with :func:`store_decoded`.

    Args:
        out: contiguous fp32/fp16/bf16 tensor; ``numel = out.numel()``.
        packed: uint8 sign bits, at least ``ceil(numel / 8)``.
        scales: fp32 scales, at least ``ceil(numel / chunk)``.
        chunk: elements per scale.
        accumulate: add to ``out`` (in fp32, rounded once) instead of overwriting it.

    Example::

        >>> sign_decompress_into(grad, *sign_compress(g), accumulate=True)
    """
    n = out.numel()
    packed = packed.reshape(-1)[: triton.cdiv(n, 8)]
    scales = scales.reshape(-1)[: triton.cdiv(n, chunk)]
    dtype = torch.float32 if accumulate else out.dtype
    store_decoded(out, sign_decompress(packed, scales, n, chunk, dtype), accumulate)
