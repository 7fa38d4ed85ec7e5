"""Blockwise quantization: ``bits``-wide signed codes with one absmax fp32 scale per block."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fastcomm import ops, reference
from fastcomm.compress._blockwise import BlockwisePayload

__all__ = ["QuantCompressor"]


@dataclass(frozen=True)
class QuantCompressor(BlockwisePayload):
    """8/4/2-bit codes and one absmax scale per ``block`` (``ops.quantize_blockwise``), error feedback fused.

    Args:
        bits: code width, 8, 4 or 2.
        block: elements per scale.
        stochastic: unbiased stochastic rounding (from the ``seed`` of each call) instead of nearest.

    Example::

        compressor = QuantCompressor(bits=4, block=128)
        payload = torch.empty(compressor.wire_bytes(1024, torch.float32), dtype=torch.uint8)
        compressor.compress_into(payload, torch.randn(1024), None, None, seed=7)
    """

    bits: int = 8
    block: int = 256
    stochastic: bool = True

    def __post_init__(self) -> None:
        bits = self.bits
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in reference.QUANT_BITS:
            raise ValueError(f"bits must be one of {reference.QUANT_BITS}, got {self.bits!r}")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block <= 0:
            raise ValueError(f"block must be a positive int, got {self.block!r}")

    def _encode(
        self, x: Tensor, residual_out: Tensor | None, residual_in: Tensor | None, seed: int
    ) -> tuple[Tensor, Tensor]:
        return ops.quantize_blockwise(
            x,
            self.bits,
            self.block,
            self.stochastic,
            seed,
            residual=residual_out,
            residual_source=residual_in,
        )

    def _decode(self, out: Tensor, codes: Tensor, scales: Tensor, accumulate: bool) -> None:
        ops.dequantize_blockwise_into(out, codes, scales, self.bits, self.block, accumulate)
