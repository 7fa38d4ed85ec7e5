"""What the Triton kernel families share: the one tile-size helper, the device guard, and code packing.

Every kernel here lays a tensor out as rows of ``row_length`` elements (a quantization block or a sign
chunk), so a row's reduction is a plain ``tl.max``/``tl.sum`` along the tile's column axes and no integer
division by a runtime length is needed. :func:`tile_for` is the only place that picks tile shapes and warps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["Tile", "device_guard", "pack_codes", "round_to", "store_decoded", "tile_for", "to_float32"]

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
    """Pack one ``bits``-wide code per byte of ``codes`` into ``out``, as ``reference._pack`` lays them out.

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
