"""The argument checks of the public ops in :mod:`fastcomm.ops`, one ``check_<op>`` per op.

Each check takes the op's bound arguments by name (defaults applied), raises a ``TypeError`` or
``ValueError`` that names the bad argument, and may replace a value by its normalised form (``bool(...)``, a
flat view), which is what the op then receives. The twins in :mod:`fastcomm.reference` check nothing; these
checks are what stands between a user's call and a native kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastcomm import reference

__all__ = [
    "check_dequantize_blockwise",
    "check_dequantize_blockwise_into",
    "check_powersgd_back_project",
    "check_powersgd_expand",
    "check_powersgd_project",
    "check_quantize_blockwise",
    "check_sign_compress",
    "check_sign_decompress",
    "check_sign_decompress_into",
    "check_sparse_accumulate",
    "check_sparse_mean",
    "check_topk_select",
    "num_blocks",
]


def num_blocks(n: int, block: int) -> int:
    """How many blocks of ``block`` elements hold ``n`` elements (the last one may be partial)."""
    return -(-n // block)


def _check_float(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in reference.FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_residual(x: Tensor, residual: Tensor | None) -> None:
    if residual is None:
        return
    _check_float("residual", residual)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            "residual must match x in shape, dtype and device: "
            f"x is {tuple(x.shape)} {x.dtype} on {x.device}, "
            f"residual is {tuple(residual.shape)} {residual.dtype} on {residual.device}"
        )


def _extent(t: Tensor) -> tuple[int, int]:
    """The byte range ``[first, last)`` that a strided tensor's elements lie in."""
    span = (
        sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
        if t.numel()
        else 0
    )
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _check_residual_source(x: Tensor, residual: Tensor | None, residual_source: Tensor | None) -> None:
    if residual_source is None:
        return
    if residual is None:
        raise ValueError(
            "residual_source needs residual: x + residual_source is compressed and acc - sent is written to "
            "residual, so pass both (residual_source=residual is the in-place form)"
        )
    _check_float("residual_source", residual_source)
    if (
        residual_source.shape != x.shape
        or residual_source.dtype != x.dtype
        or residual_source.device != x.device
    ):
        raise ValueError(
            "residual_source must match x in shape, dtype and device: "
            f"x is {tuple(x.shape)} {x.dtype} on {x.device}, residual_source is "
            f"{tuple(residual_source.shape)} {residual_source.dtype} on {residual_source.device}"
        )
    same_view = (
        residual_source.data_ptr() == residual.data_ptr() and residual_source.stride() == residual.stride()
    )
    (a0, a1), (b0, b1) = _extent(residual_source), _extent(residual)
    if not same_view and a0 < b1 and b0 < a1:
        raise ValueError(
            "residual_source must be residual itself or lie apart from it: the two overlap in memory, so the "
            "kernel would read values it has already overwritten"
        )


def _check_out(out: Tensor) -> None:
    _check_float("out", out)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous: it is written in place through out.view(-1)")


def _check_payload_prefix(name: str, t: Tensor, dtype: torch.dtype, needed: int, out: Tensor) -> None:
    """``t`` holds at least ``needed`` elements of ``dtype`` on ``out``'s device (any extra is ignored)."""
    if not isinstance(t, Tensor) or t.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.numel() < needed:
        raise ValueError(
            f"{name} has {t.numel()} elements, needs at least {needed} to fill out ({out.numel()} elements)"
        )
    if t.device != out.device:
        raise ValueError(f"{name} is on {t.device} but out is on {out.device}")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_bits(bits: int) -> None:
    if bits not in reference.QUANT_BITS:
        raise ValueError(f"bits must be one of {reference.QUANT_BITS}, got {bits!r}")


def _check_payload(name: str, t: Tensor, dtype: torch.dtype, expected: int) -> None:
    if not isinstance(t, Tensor) or t.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.numel() != expected:
        raise ValueError(f"{name} has {t.numel()} elements, expected {expected} for these arguments")


def _check_numel(numel: int) -> None:
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in reference.FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")


def _check_compress_input(args: dict[str, Any]) -> None:
    """What every compressor takes first: a float ``x`` and its optional error-feedback buffers."""
    x, residual = args["x"], args["residual"]
    _check_float("x", x)
    _check_residual(x, residual)
    _check_residual_source(x, residual, args["residual_source"])


# ------------------------------------------------------------------------------------------ per-op checks
def check_topk_select(args: dict[str, Any]) -> None:
    _check_compress_input(args)
    x, k = args["x"], args["k"]
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= x.numel():
        raise ValueError(f"k must be an int in [0, x.numel()={x.numel()}], got {k!r}")
    args["exact"] = bool(args["exact"])


def check_quantize_blockwise(args: dict[str, Any]) -> None:
    _check_compress_input(args)
    _check_bits(args["bits"])
    _check_positive("block", args["block"])
    seed = args["seed"]
    if not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must be an int64, got {seed!r}")
    args["stochastic"] = bool(args["stochastic"])


def check_dequantize_blockwise(args: dict[str, Any]) -> None:
    bits, block, numel = args["bits"], args["block"], args["numel"]
    _check_bits(bits)
    _check_positive("block", block)
    _check_numel(numel)
    _check_payload("codes", args["codes"], torch.uint8, num_blocks(numel * bits, 8))
    _check_payload("scales", args["scales"], torch.float32, num_blocks(numel, block))
    _check_dtype(args["dtype"])


def check_dequantize_blockwise_into(args: dict[str, Any]) -> None:
    out, bits, block = args["out"], args["bits"], args["block"]
    _check_out(out)
    _check_bits(bits)
    _check_positive("block", block)
    _check_payload_prefix("codes", args["codes"], torch.uint8, num_blocks(out.numel() * bits, 8), out)
    _check_payload_prefix("scales", args["scales"], torch.float32, num_blocks(out.numel(), block), out)
    args["accumulate"] = bool(args["accumulate"])


def check_sign_compress(args: dict[str, Any]) -> None:
    _check_compress_input(args)
    _check_positive("chunk", args["chunk"])


def check_sign_decompress(args: dict[str, Any]) -> None:
    chunk, numel = args["chunk"], args["numel"]
    _check_positive("chunk", chunk)
    _check_numel(numel)
    _check_payload("packed", args["packed"], torch.uint8, num_blocks(numel, 8))
    _check_payload("scales", args["scales"], torch.float32, num_blocks(numel, chunk))
    _check_dtype(args["dtype"])


def check_sign_decompress_into(args: dict[str, Any]) -> None:
    out, chunk = args["out"], args["chunk"]
    _check_out(out)
    _check_positive("chunk", chunk)
    _check_payload_prefix("packed", args["packed"], torch.uint8, num_blocks(out.numel(), 8), out)
    _check_payload_prefix("scales", args["scales"], torch.float32, num_blocks(out.numel(), chunk), out)
    args["accumulate"] = bool(args["accumulate"])


def check_sparse_accumulate(args: dict[str, Any]) -> None:
    out, indices, values = args["out"], args["indices"], args["values"]
    _check_float("out", out)
    _check_float("values", values)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous: it is accumulated in place through out.view(-1)")
    _check_index_dtype("indices", indices, "an int32 or int64 tensor")
    if indices.numel() != values.numel():
        raise ValueError(f"indices has {indices.numel()} elements but values has {values.numel()}")
    _check_indices("indices", indices, out)
    args["indices"], args["values"] = indices.reshape(-1), values.reshape(-1)


def check_sparse_mean(args: dict[str, Any]) -> None:
    check_sparse_accumulate(args)
    world_size = args["world_size"]
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    clear = args["clear"]
    if clear is not None:
        _check_index_dtype("clear", clear, "None or an int32 or int64 tensor")
        _check_indices("clear", clear, args["out"])
        args["clear"] = clear.reshape(-1)


def _check_index_dtype(name: str, indices: Any, expected: str) -> None:
    if not isinstance(indices, Tensor) or indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be {expected}, got {getattr(indices, 'dtype', indices)}")


def _check_indices(name: str, indices: Tensor, out: Tensor) -> None:
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= out.numel()):
        raise ValueError(f"{name} must lie in [0, out.numel()={out.numel()})")


def _check_matrix(name: str, t: Any, shape: tuple[int, int]) -> None:
    if not isinstance(t, Tensor) or t.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {shape[0]} x {shape[1]}, got {tuple(t.shape)}")
    if shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows (stride 1 along dim 1), got strides {t.stride()}")


def _check_powersgd_factors(matrix_name: str, args: dict[str, Any], factor: str) -> tuple[int, int]:
    matrix, q_t = args[matrix_name], args["q_t"]
    if not isinstance(matrix, Tensor) or matrix.dim() != 2:
        raise ValueError(
            f"{matrix_name} must be a 2-D tensor (n x m), got {getattr(matrix, 'shape', matrix)}"
        )
    if not isinstance(q_t, Tensor) or q_t.dim() != 2:
        raise ValueError(f"q_t must be a 2-D tensor (r x m), got {getattr(q_t, 'shape', q_t)}")
    (n, m), r = matrix.shape, q_t.shape[0]
    _check_matrix(matrix_name, matrix, (n, m))
    _check_matrix("q_t", q_t, (r, m))
    _check_matrix(factor, args[factor], (n, r))
    return n, m


def check_powersgd_project(args: dict[str, Any]) -> None:
    n, m = _check_powersgd_factors("x", args, "p")
    gradient, residual = args["gradient"], args["residual"]
    if residual is not None and gradient is None:
        raise ValueError("residual needs gradient: x = gradient + residual is formed only from a gradient")
    for name in ("gradient", "residual"):
        if args[name] is not None:
            _check_matrix(name, args[name], (n, m))


def check_powersgd_back_project(args: dict[str, Any]) -> None:
    _check_powersgd_factors("x", args, "p")


def check_powersgd_expand(args: dict[str, Any]) -> None:
    n, m = _check_powersgd_factors("mean", args, "p")
    if args["residual"] is not None:
        _check_matrix("residual", args["residual"], (n, m))
        if args["residual"].data_ptr() == args["mean"].data_ptr() and n * m:
            raise ValueError("residual and mean must be different tensors (both are written)")
