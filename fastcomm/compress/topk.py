"""Top-k selection: the k largest-magnitude entries as (int32 index, value) pairs (as in DGC)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fastcomm import ops
from fastcomm.compress.protocol import all_finite

__all__ = ["TopKCompressor", "fit_to_k"]


@dataclass(frozen=True)
class TopKCompressor:
    """k ``(index, value)`` pairs per tensor: ``k`` int32 indices, then ``k`` values in the input's dtype.

    Payload values keep the input's dtype, so :meth:`decompress_into` needs an ``out`` of that dtype.
    The payload always holds exactly ``k`` entries: DGC's sampled threshold (``exact=False``) may select
    more (the smallest of them stay in the residual) or fewer (zero-padded). Not blockwise: the hooks
    all-gather the payloads.

    Args:
        k: entries per payload.
        exact: exactly the k largest, or DGC's sampled threshold (about k, fewer passes).

    Example::

        compressor = TopKCompressor(k=10)
        x = torch.randn(1000)
        payload = torch.empty(compressor.wire_bytes(x.numel(), x.dtype), dtype=torch.uint8)
        residual = torch.zeros_like(x)
        compressor.compress_into(payload, x, residual, residual, seed=0)
    """

    k: int
    exact: bool = False
    block = 0

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k <= 0:
            raise ValueError(f"k must be a positive int, got {self.k!r}")

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return self.k * (4 + torch.empty(0, dtype=dtype).element_size())

    def select(
        self, x: Tensor, residual_out: Tensor | None, residual_in: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(values, indices, sent)``: exactly k entries of ``x + residual_in``; ``sent`` unpadded indices.

        ``residual_out`` receives the accumulated tensor with the sent entries zeroed.
        """
        selected_values, selected = ops.topk_select(
            x, min(self.k, x.numel()), residual=residual_out, exact=self.exact, residual_source=residual_in
        )
        values, indices, kept = fit_to_k(selected_values, selected, self.k)
        if kept is not None and residual_out is not None:  # cut to k: the dropped entries stay owed
            dropped = torch.ones(selected.numel(), dtype=torch.bool, device=x.device)
            dropped[kept] = False
            residual_out[selected[dropped].long()] = selected_values[dropped]
        return values, indices, selected if kept is None else indices

    def pack(self, payload: Tensor, values: Tensor, indices: Tensor) -> None:
        """Write :meth:`select`'s entries into ``payload``."""
        payload[: 4 * self.k].copy_(indices.view(torch.uint8))
        payload[4 * self.k :].copy_(values.contiguous().view(torch.uint8))

    def unpack(self, payloads: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(int32 indices, values)`` of every row of ``payloads`` (rows concatenated)."""
        rows = payloads.reshape(-1, payloads.shape[-1])
        indices = rows[:, : 4 * self.k].contiguous().view(torch.int32).reshape(-1)
        return indices, rows[:, 4 * self.k :].contiguous().view(dtype).reshape(-1)

    def compress_into(
        self, payload: Tensor, x: Tensor, residual_out: Tensor | None, residual_in: Tensor | None, seed: int
    ) -> None:
        values, indices, _ = self.select(x, residual_out, residual_in)
        self.pack(payload, values, indices)

    def decompress_into(
        self, out: Tensor, payload: Tensor, payload_numel: int, accumulate: bool = False, divisor: int = 1
    ) -> None:
        indices, values = self.unpack(payload, out.dtype)
        if not accumulate:
            out.zero_()
        keep = indices < out.numel()
        ops.sparse_accumulate(out, indices[keep], values[keep] / divisor if divisor != 1 else values[keep])

    def payload_finite(self, payloads: Tensor, payload_numel: int, dtype: torch.dtype) -> bool:
        return all_finite(self.unpack(payloads, dtype)[1])

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            raise ValueError(f"TopKCompressor is stateless; got a state_dict with {sorted(state_dict)}")


def fit_to_k(values: Tensor, indices: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """Exactly k entries: keep the k largest magnitudes of an over-full selection, zero-pad a short one.

    Returns ``(values, indices, kept)``: ``kept`` holds the positions (ascending, int64) of the entries an
    over-full selection kept, else ``None``. Ties in magnitude keep the lower index.

    Example::

        >>> indices = torch.tensor([1, 4, 9], dtype=torch.int32)
        >>> fit_to_k(torch.tensor([0.5, -3.0, 2.0]), indices, 2)[1].tolist()
        [4, 9]
    """
    count = indices.numel()
    if count > k:
        # the op's exact mode is an O(count) radix select returning ascending positions: no sort needed
        _, positions = ops.topk_select(values, k, exact=True)
        kept = positions.long()
        return values[kept], indices[kept], kept
    if count < k:
        pad = k - count
        return torch.cat([values, values.new_zeros(pad)]), torch.cat([indices, indices.new_zeros(pad)]), None
    return values, indices, None
