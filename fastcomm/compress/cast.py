"""Cast compression: each value rounded to a 16-bit float (bf16 or fp16), what it lost fed back.

The compressor form of ``cast_hook`` (an allreduce in bf16): as a blockwise :class:`Compressor` it goes
through the two-phase exchange, with error feedback, and through hierarchical compression
(``fastcomm.register(ddp, fastcomm.compressor("cast"), node_size=L)``: dense inside the node, bf16 between
nodes), which ``cast_hook``'s state, not a compressing state, does not take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fastcomm.compress.protocol import all_finite

__all__ = ["CastCompressor"]

_WIRE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CastCompressor:
    """Values as ``dtype`` (2 bytes each); ``residual_out`` gets ``x + residual_in`` minus the rounded value.

    Blockwise with ``block = 1``: every element decodes on its own. Rounding is to nearest (``Tensor.to``),
    computed from the fp32 sum ``x + residual_in``.

    Args:
        dtype: ``torch.bfloat16`` (the range of fp32) or ``torch.float16`` (more precision, overflows
            beyond 65504).

    Raises:
        ValueError: another dtype.

    Example::

        compressor = CastCompressor(torch.bfloat16)
        x = torch.randn(1000)
        residual = torch.zeros(1000)
        payload = torch.empty(compressor.wire_bytes(1000, x.dtype), dtype=torch.uint8)
        compressor.compress_into(payload, x, residual, residual, seed=0)
        out = torch.empty(1000)
        compressor.decompress_into(out, payload, 1000)
        assert torch.equal(out + residual, x)  # bf16 keeps 8 bits of mantissa, the residual the rest
    """

    dtype: torch.dtype = torch.bfloat16
    block = 1

    def __post_init__(self) -> None:
        if self.dtype not in _WIRE_DTYPES:
            raise ValueError(f"dtype must be one of {_WIRE_DTYPES}, got {self.dtype!r}")

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * self.dtype.itemsize

    def compress_into(
        self, payload: Tensor, x: Tensor, residual_out: Tensor | None, residual_in: Tensor | None, seed: int
    ) -> None:
        narrow = payload[: self.wire_bytes(x.numel(), x.dtype)].view(self.dtype)
        if residual_out is None or residual_out.dtype != torch.float32:
            acc = x.float() if residual_in is None else x.float() + residual_in.float()
            narrow.copy_(acc)
            if residual_out is not None:
                residual_out.copy_(acc - narrow.float())
            return
        # the fp32 sum is built in residual_out (no temporary); elementwise: residual_in may be residual_out
        if residual_in is None:
            residual_out.copy_(x)
        else:
            torch.add(x, residual_in, out=residual_out)
        narrow.copy_(residual_out)
        residual_out.sub_(narrow)

    def decompress_into(
        self, out: Tensor, payload: Tensor, payload_numel: int, accumulate: bool = False, divisor: int = 1
    ) -> None:
        values = payload[: self.wire_bytes(payload_numel, out.dtype)].view(self.dtype)[: out.numel()]
        if divisor != 1:
            values = values.float() / divisor
        if accumulate:
            out += values
        else:
            out.copy_(values)

    def payload_finite(self, payloads: Tensor, payload_numel: int, dtype: torch.dtype) -> bool:
        return all_finite(payloads[:, : self.wire_bytes(payload_numel, dtype)].contiguous().view(self.dtype))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            raise ValueError(f"CastCompressor is stateless; got a state_dict with {sorted(state_dict)}")
