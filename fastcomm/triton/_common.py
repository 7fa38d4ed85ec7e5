"""What the Triton kernel families share: the tile-size helper, the row-kernel launches, and code packing.

Every kernel here lays a tensor out as rows of ``row_length`` elements (a quantization block or a sign
chunk), so a row's reduction is a plain ``tl.max``/``tl.sum`` along the tile's column axes and no integer
division by a runtime length is needed. :func:`tile_for` is the only place that picks tile shapes and warps.

A family's encoder kernel takes ``(*inputs, codes, scales, n, row_length, row_bytes, nrows, *scalars)`` and
the constexprs ``PER_BYTE, ROWS, COLUMNS, LOOPS`` (plus its own); its decoder kernel takes ``(codes, scales,
out, n, row_length, nrows)`` and ``BITS, LANES, ROWS, COLUMNS`` (plus its own). :func:`launch_encoder`,
:func:`launch_decoder` and :func:`decode_into` are the host side of that contract, and :func:`row_tile`,
:func:`tile_index`, :func:`store_bytes`, :func:`load_accumulated` and :func:`load_codes` the shared index
arithmetic inside the kernels.

Error feedback is fused: an encoder reads ``x`` and the residual's source once and writes the codes, the
scales and the new residual once (:func:`residual_operands` picks the buffers). Kernels leave the length ``n``
specialised (Triton's default): when it is a multiple of 16, as large gradients are, the masks ``index < n``
are known constant over runs of 16 elements and loads and stores vectorise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = [
    "ResidualOperands",
    "Tile",
    "decode_into",
    "decoder_tile",
    "device_guard",
    "launch_decoder",
    "launch_encoder",
    "load_accumulated",
    "load_codes",
    "pack_codes",
    "residual_operands",
    "round_to",
    "row_tile",
    "store_bytes",
    "store_decoded",
    "tile_for",
    "tile_index",
    "to_float32",
]

# A row wider than this is walked in column tiles of this width (two passes: reduce, then encode).
MAX_COLUMNS = 4096
# Elements one program handles; small rows are stacked until a program has about this many.
TARGET_ELEMENTS = 2048


@dataclass(frozen=True)
class Tile:
    """Launch shape of a row kernel: ``rows x columns`` elements per program and the warps to run it."""

    rows: int
    columns: int
    num_warps: int
    loops: bool  # True when a row is wider than ``columns`` and the kernel walks it in column tiles


def tile_for(row_length: int, align: int = 1) -> Tile:
    """The tile for rows of ``row_length`` elements, ``columns`` a power of two and a multiple of ``align``.

    Args:
        row_length: elements per row (quantization block, sign chunk, or a flat run of elements).
        align: elements per packed byte; the column tile must hold whole bytes.

    Returns:
        A :class:`Tile` whose ``rows * columns`` is about ``TARGET_ELEMENTS`` (more for a row wider than
        that, up to ``MAX_COLUMNS``).
    """
    columns = min(max(triton.next_power_of_2(row_length), align), MAX_COLUMNS)
    rows = max(1, TARGET_ELEMENTS // columns)
    num_warps = max(1, min(8, rows * columns // 256))
    return Tile(rows=rows, columns=columns, num_warps=num_warps, loops=row_length > columns)


def store_decoded(out: torch.Tensor, decoded: torch.Tensor, accumulate: bool) -> None:
    """``out = decoded`` or, accumulating, ``out = out + decoded`` added in fp32 and rounded once.

    The ``*_into`` ops are composed from the functional kernels: ``decoded`` is 1-D, in ``out.dtype`` when
    overwriting and in fp32 when accumulating (for fp32 ``out`` that is exactly ``out.add_(decoded)``).
    """
    flat = out.view(-1)
    if not accumulate:
        flat.copy_(decoded)
    elif out.dtype == torch.float32:
        flat.add_(decoded)
    else:
        flat.copy_(flat.float() + decoded)


@dataclass(frozen=True)
class ResidualOperands:
    """The flat buffers a fused error-feedback kernel reads (``source``) and writes (``target``).

    ``target`` is ``residual.view(-1)`` when the residual is contiguous, else a contiguous copy that
    :meth:`finish` copies back; ``source`` is ``target`` itself for the in-place call (each element is read
    before it is written, by the same program), or ``residual_source`` flattened. Both are ``None`` without a
    residual.
    """

    residual: torch.Tensor | None
    source: torch.Tensor | None
    target: torch.Tensor | None

    def finish(self) -> None:
        """Copy a strided residual's result back (a no-op when the kernel wrote it in place)."""
        if self.residual is not None and self.target is not None and not self.residual.is_contiguous():
            self.residual.copy_(self.target.view_as(self.residual))


def residual_operands(
    residual: torch.Tensor | None, residual_source: torch.Tensor | None
) -> ResidualOperands:
    """The buffers of ``acc = x + source`` and ``residual = f(acc)``, read and written in one kernel pass.

    ``residual_source`` (read, never written) replaces ``residual`` as the source, so the result has the bits
    of ``residual.copy_(residual_source)`` followed by the in-place call, without the copy.

    Raises:
        ValueError: ``residual_source`` is given without ``residual``.
    """
    if residual is None:
        if residual_source is not None:
            raise ValueError("residual_source needs residual: acc - sent is written to residual")
        return ResidualOperands(None, None, None)
    target = residual.view(-1) if residual.is_contiguous() else residual.reshape(-1).contiguous()
    if residual_source is None or residual_source is residual:
        return ResidualOperands(residual, target, target)
    return ResidualOperands(residual, residual_source.reshape(-1).contiguous(), target)


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s CUDA device current for a launch (a no-op for CPU tensors under the interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


@triton.jit
def to_float32(value):
    """``value`` widened exactly to fp32; bf16 by shifting its bits (the interpreter flushes subnormals)."""
    if value.dtype == tl.bfloat16:
        return (value.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return value.to(tl.float32)


@triton.jit
def round_to(value, dtype: tl.constexpr):
    """fp32 ``value`` rounded to nearest even in ``dtype``, as torch's ``.to(dtype)`` does.

    bf16 is rounded with integer ops on the bit pattern (NaN becomes torch's 0x7FC0): one exact definition
    on every backend, where the interpreter's own fp32 -> bf16 cast truncates.
    """
    if dtype == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(value != value, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return value.to(dtype)


@triton.jit(do_not_specialize=["n", "nbytes"])
def _pack_kernel(
    codes_ptr, out_ptr, n, nbytes, BITS: tl.constexpr, PER_BYTE: tl.constexpr, BYTES: tl.constexpr
):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    lane = tl.arange(0, PER_BYTE)
    index = byte[:, None] * PER_BYTE + lane[None, :]
    code = tl.load(codes_ptr + index, mask=index < n, other=0).to(tl.int32)
    packed = tl.sum(code << (lane * BITS)[None, :], axis=1)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)


def pack_codes(codes: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Pack one ``bits``-wide code per byte of ``codes`` into ``out``, laid out as ``reference.pack_codes``.

    Used when a row length is not a multiple of the codes per byte, so a byte straddles two rows and the
    row kernels write one code per byte first.
    """
    per_byte = 8 // bits
    tile = tile_for(TARGET_ELEMENTS)
    nbytes = out.numel()
    grid = (triton.cdiv(nbytes, tile.columns // per_byte),)
    with device_guard(codes):
        _pack_kernel[grid](
            codes,
            out,
            codes.numel(),
            nbytes,
            BITS=bits,
            PER_BYTE=per_byte,
            BYTES=tile.columns // per_byte,
            num_warps=tile.num_warps,
            enable_fp_fusion=False,
        )
    return out


@triton.jit
def row_tile(row_length, ROWS: tl.constexpr, COLUMNS: tl.constexpr, PER_BYTE: tl.constexpr):
    """An encoder program's rows, their first elements, and its ``[rows, bytes, per_byte]`` column offsets.

    Returns ``(rows, first, byte_col, lane, col)``: ``rows`` and ``first = rows * row_length`` are
    ``[ROWS]``, ``byte_col`` is ``[COLUMNS // PER_BYTE]``, ``lane`` is ``[PER_BYTE]`` and ``col`` the
    ``[1, COLUMNS // PER_BYTE, PER_BYTE]`` element offsets within a row.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    byte_col = tl.arange(0, COLUMNS // PER_BYTE)
    lane = tl.arange(0, PER_BYTE)
    col = byte_col[None, :, None] * PER_BYTE + lane[None, None, :]
    return rows, rows * row_length, byte_col, lane, col


@triton.jit
def load_accumulated(x_ptr, source_ptr, index, mask):
    """``acc = x + source`` in ``x``'s dtype (one fp32 add rounded once, which equals the dtype's own add).

    ``source_ptr`` is ``None`` (a compile-time constant) when there is no residual: ``acc`` is ``x``.
    """
    x = tl.load(x_ptr + index, mask=mask, other=0.0)
    if source_ptr is not None:
        r = tl.load(source_ptr + index, mask=mask, other=0.0)
        x = round_to(to_float32(x) + to_float32(r), x_ptr.dtype.element_ty)
    return x


@triton.jit
def decoder_tile(scales_ptr, row_length, nrows, ROWS: tl.constexpr):
    """A decoder program's ``[ROWS]`` rows, their first elements and their ``[ROWS, 1, 1]`` scales."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    scale = tl.load(scales_ptr + rows, mask=rows < nrows, other=0.0)[:, None, None]
    return rows, rows * row_length, scale


@triton.jit
def load_codes(codes_ptr, first, start, n, row_length, BITS: tl.constexpr, LANES: tl.constexpr,
               COLUMNS: tl.constexpr):  # fmt: skip
    """The ``[rows, bytes, LANES]`` codes of the column tile at ``start``, their indices, and which exist.

    ``LANES`` is the codes per byte when a row holds whole bytes: each byte is then loaded once and split
    along the last axis. It is 1 when bytes straddle rows, and each element loads its own byte.
    """
    byte_col = tl.arange(0, COLUMNS // LANES)
    lane = tl.arange(0, LANES)
    col = start + byte_col[None, :, None] * LANES + lane[None, None, :]
    index, mask = tile_index(first[:, None, None], col, n, row_length)
    if LANES == 8 // BITS:
        byte_index = (first[:, None] + start) // LANES + byte_col[None, :]
        byte_mask = tl.max(mask.to(tl.int32), axis=2) != 0
        byte = tl.load(codes_ptr + byte_index, mask=byte_mask, other=0).to(tl.int32)[:, :, None]
        shift = lane[None, None, :] * BITS
    else:
        byte = tl.load(codes_ptr + index // (8 // BITS), mask=mask, other=0).to(tl.int32)
        shift = ((index % (8 // BITS)) * BITS).to(tl.int32)
    return (byte >> shift) & ((1 << BITS) - 1), index, mask


@triton.jit
def tile_index(first, col, n, row_length):
    """Flat indices of the elements at offsets ``col`` of rows starting at ``first``, and which exist."""
    index = first + col
    return index, (col < row_length) & (index < n)


@triton.jit
def store_bytes(
    out_ptr, packed, rows, first, byte_col, start, n, row_length, row_bytes, PER_BYTE: tl.constexpr
):
    """Store the ``[rows, bytes]`` packed bytes of the column tile at element ``start`` of each row.

    A byte exists when its first element lies inside its row and inside the tensor.
    """
    bc = start // PER_BYTE + byte_col[None, :]
    byte_ok = (bc * PER_BYTE < row_length) & (first[:, None] + bc * PER_BYTE < n)
    tl.store(out_ptr + rows[:, None] * row_bytes + bc, packed, mask=byte_ok)


def launch_encoder(
    kernel: Any,
    inputs: tuple[torch.Tensor, ...],
    flat: torch.Tensor,
    bits: int,
    row_length: int,
    scalars: tuple[int, ...] = (),
    **constexprs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch a row encoder over ``flat``: ``bits``-wide codes packed into bytes and one fp32 scale per row.

    1. ``codes`` (``ceil(n * bits / 8)`` bytes) and ``scales`` (``ceil(n / row_length)``) are allocated on
       ``flat``'s device; nothing is launched for an empty ``flat``.
    2. One program per ``tile.rows`` rows. When ``row_length`` is not a multiple of the codes per byte, a
       byte straddles two rows: the kernel then writes one code per byte (``PER_BYTE=1``) and
       :func:`pack_codes` packs them.

    Args:
        kernel: the family's ``@triton.jit`` encoder (see the module docstring for its arguments).
        inputs: the tensors it reads (and writes) before ``codes``; the first is ``flat``'s data.
        flat: the contiguous 1-D input, whose length and device size the outputs.
        bits: code width (1 for sign bits).
        row_length: elements per scale.
        scalars: runtime arguments after ``nrows``.
        constexprs: the family's own compile-time arguments.

    Returns:
        ``(codes, scales)``.
    """
    n = flat.numel()
    nrows = triton.cdiv(n, row_length)
    per_byte = 8 // bits
    codes = torch.empty(triton.cdiv(n * bits, 8), dtype=torch.uint8, device=flat.device)
    scales = torch.empty(nrows, dtype=torch.float32, device=flat.device)
    if n == 0:
        return codes, scales
    aligned = row_length % per_byte == 0
    layout = per_byte if aligned else 1
    target = codes if aligned else torch.empty(n, dtype=torch.uint8, device=flat.device)
    tile = tile_for(row_length, align=layout)
    with device_guard(flat):
        kernel[(triton.cdiv(nrows, tile.rows),)](
            *inputs,
            target,
            scales,
            n,
            row_length,
            row_length // layout,
            nrows,
            *scalars,
            PER_BYTE=layout,
            ROWS=tile.rows,
            COLUMNS=tile.columns,
            LOOPS=tile.loops,
            num_warps=tile.num_warps,
            enable_fp_fusion=False,
            **constexprs,
        )
    if not aligned:
        pack_codes(target, bits, out=codes)
    return codes, scales


def launch_decoder(
    kernel: Any,
    codes_name: str,
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    row_length: int,
    dtype: torch.dtype,
    bits: int,
    **constexprs: Any,
) -> torch.Tensor:
    """Launch a row decoder: ``numel`` values of ``dtype`` from packed ``codes`` and one scale per row.

    Args:
        kernel: the family's ``@triton.jit`` decoder (see the module docstring for its arguments).
        codes_name: what the op calls ``codes`` (``"codes"``, ``"packed"``), for the error message.
        codes: packed uint8 codes; the output goes on their device.
        scales: fp32 scales, one per row, on the same device.
        numel: how many values to produce.
        row_length: elements per scale.
        dtype: output dtype.
        bits: code width (1 for sign bits).
        constexprs: the family's own compile-time arguments.

    Returns:
        A 1-D tensor of ``numel`` values.

    Raises:
        ValueError: ``scales`` is on another device than ``codes``.
    """
    if scales.device != codes.device:
        owner = codes_name + ("'" if codes_name.endswith("s") else "'s")
        raise ValueError(f"scales must be on {owner} device {codes.device}, got {scales.device}")
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    if numel == 0:
        return out
    nrows = triton.cdiv(numel, row_length)
    per_byte = 8 // bits
    lanes = per_byte if row_length % per_byte == 0 else 1
    tile = tile_for(row_length, align=lanes)
    with device_guard(codes):
        kernel[(triton.cdiv(nrows, tile.rows),)](
            codes.contiguous(),
            scales.contiguous(),
            out,
            numel,
            row_length,
            nrows,
            BITS=bits,
            LANES=lanes,
            ROWS=tile.rows,
            COLUMNS=tile.columns,
            num_warps=tile.num_warps,
            enable_fp_fusion=False,
            **constexprs,
        )
    return out


def decode_into(
    out: torch.Tensor,
    decode: Callable[[torch.Tensor, torch.Tensor, int, torch.dtype], torch.Tensor],
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    row_length: int,
    accumulate: bool,
) -> None:
    """A ``*_into`` op composed from its functional decoder: decode what ``out`` needs, then store it.

    The first ``ceil(numel * bits / 8)`` codes and ``ceil(numel / row_length)`` scales of the payload are
    decoded by ``decode(codes, scales, numel, dtype)`` (in ``out.dtype``, or in fp32 when accumulating) and
    stored with :func:`store_decoded`.
    """
    n = out.numel()
    codes = codes.reshape(-1)[: triton.cdiv(n * bits, 8)]
    scales = scales.reshape(-1)[: triton.cdiv(n, row_length)]
    decoded = decode(codes, scales, n, torch.float32 if accumulate else out.dtype)
    store_decoded(out, decoded, accumulate)
