"""1-bit sign compression: one bit per element and one fp32 scale (mean magnitude) per chunk."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fastcomm import ops
from fastcomm.compress._blockwise import BlockwisePayload

__all__ = ["SignCompressor"]


@dataclass(frozen=True)
class SignCompressor(BlockwisePayload):
    """Signs packed 8 per byte and the mean magnitude of each ``chunk`` elements (``ops.sign_compress``).

    Args:
        chunk: elements per fp32 scale.

    Example::

        compressor = SignCompressor(chunk=2048)
        payload = torch.empty(compressor.wire_bytes(4096, torch.float32), dtype=torch.uint8)
        compressor.compress_into(payload, torch.randn(4096), None, None, seed=0)
    """

    chunk: int = 2048
    bits = 1

    def __post_init__(self) -> None:
        if not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk <= 0:
            raise ValueError(f"chunk must be a positive int, got {self.chunk!r}")

    @property
    def block(self) -> int:  # type: ignore[override]
        return self.chunk

    def _encode(
        self, x: Tensor, residual_out: Tensor | None, residual_in: Tensor | None, seed: int
    ) -> tuple[Tensor, Tensor]:
        return ops.sign_compress(x, residual_out, self.chunk, residual_source=residual_in)

    def _decode(self, out: Tensor, codes: Tensor, scales: Tensor, accumulate: bool) -> None:
        ops.sign_decompress_into(out, codes, scales, self.chunk, accumulate)
