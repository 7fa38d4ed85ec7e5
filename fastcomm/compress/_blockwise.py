"""The payload layout of blockwise compressors: packed codes, then one fp32 scale per block."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastcomm.compress.protocol import all_finite

__all__ = ["BlockwisePayload"]


class BlockwisePayload:
    """Codes of ``bits`` per element (whole bytes), then one fp32 scale per ``block`` elements.

    The base of :class:`~fastcomm.compress.SignCompressor` and
    :class:`~fastcomm.compress.QuantCompressor`; subclasses set ``bits`` and ``block`` and implement
    ``_encode(x, residual_out, residual_in, seed) -> (codes, scales)`` and
    ``_decode(out, codes, scales, accumulate)``.

    Example::

        q = fastcomm.compress.QuantCompressor(bits=8, block=64)
        q.wire_bytes(128, torch.float32)  # 128 code bytes + 2 scales * 4 bytes = 136
    """

    bits: int
    block: int

    def code_bytes(self, numel: int) -> int:
        """Bytes of the packed codes of ``numel`` elements."""
        return -(-numel * self.bits // 8)

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return self.code_bytes(numel) + -(-numel // self.block) * 4

    def compress_into(
        self, payload: Tensor, x: Tensor, residual_out: Tensor | None, residual_in: Tensor | None, seed: int
    ) -> None:
        codes, scales = self._encode(x, residual_out, residual_in, seed)
        width = self.code_bytes(x.numel())
        payload[:width].copy_(codes)
        payload[width:].copy_(scales.view(torch.uint8))

    def decompress_into(
        self, out: Tensor, payload: Tensor, payload_numel: int, accumulate: bool = False, divisor: int = 1
    ) -> None:
        width = self.code_bytes(payload_numel)
        scales = payload[width:].clone().view(torch.float32)  # a copy: the slice may be misaligned
        if divisor != 1:
            scales /= divisor
        self._decode(out, payload[:width], scales, accumulate)

    def payload_finite(self, payloads: Tensor, payload_numel: int, dtype: torch.dtype) -> bool:
        # inf/NaN anywhere in a block makes its scale non-finite
        return all_finite(payloads[:, self.code_bytes(payload_numel) :].contiguous().view(torch.float32))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            name = type(self).__name__
            raise ValueError(f"{name} is stateless; got a state_dict with {sorted(state_dict)}")

    def _encode(
        self, x: Tensor, residual_out: Tensor | None, residual_in: Tensor | None, seed: int
    ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _decode(self, out: Tensor, codes: Tensor, scales: Tensor, accumulate: bool) -> None:
        raise NotImplementedError
