"""SparseLoCo's compressor: the top-k of each chunk, 2-bit values, and error feedback that decays.

SparseLoCo (Sarfi et al., 2025) sends DiLoCo's pseudo-gradients as the ``k`` largest-magnitude entries of
each ``chunk``-element chunk (about 1-3%), each value in 2 bits with one scale per chunk, and keeps what was
not sent in an error-feedback accumulator that decays by ``decay`` per round. The accumulator carries the
pseudo-gradients of earlier rounds into later ones, so it takes the place of DiLoCo's outer momentum: the
outer step is plain SGD (:attr:`SparseLoCoCompressor.outer_step`: lr 1, no momentum), which
:class:`fastcomm.DiLoCo` uses when its own ``outer_lr`` and ``outer_momentum`` are left unset.

One departure from the paper, also in ``outer_step`` (``keep_unsent``): after a sync each replica restarts
from the global weights *minus what it has not sent* (``decay`` times its residual), and its residual
starts from zero, instead of from the global weights with the residual kept aside. From scratch at H=10 the
paper's restart throws away 97-98% of every interval's local progress, which the next interval redoes while
the residual still holds it: about 5 points further from dense here (docs/diloco.md, "SparseLoCo").

The mean of sparse pseudo-gradients (``rescale``): where few ranks picked the same entry, the ranks' mean
holds an entry one rank of ``R`` sent at ``1/R`` of its value, so the outer step is shorter than a dense
mean's by the overlap of the ranks' picks. With ``rescale`` (the default) :class:`fastcomm.DiLoCo` divides
the summed pseudo-gradient by the mean number of ranks that sent an entry, measured at each sync from the
exchange itself (:meth:`SparseLoCoCompressor.mean_scale`: entries in the union of the picks over entries one
rank sends); identical picks leave the mean as it is, disjoint ones give each entry its sender's value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor

from fastcomm import ops, reference
from fastcomm.compress.protocol import all_finite

__all__ = ["SparseLoCoCompressor"]

_LEVELS = 3.0  # 2-bit codes 0..3 stand for (-1, -1/3, 1/3, 1) times the chunk's absmax
_MAX_CHUNK = 1 << 16  # a position inside a chunk is sent as 16 bits


@dataclass(frozen=True)
class SparseLoCoCompressor:
    """``k`` entries of every ``chunk`` elements: a 16-bit position and a 2-bit value each, one fp32 scale
    per chunk; error feedback with the residual decayed by ``decay`` before it is added.

    1. ``e = x + decay * residual_in`` (``decay=1``: plain error feedback).
    2. Per chunk of ``e`` (the last one zero padded): the ``k`` largest magnitudes, their absmax ``s``.
    3. Each value rounded to the nearest of ``(-1, -1/3, 1/3, 1) * s`` (2 bits).
    4. ``residual_out = e - decoded``: what was not sent (the other entries whole, the rounding error).

    Payload (not blockwise: ranks all-gather it, as the paper does, and every rank decodes the sum):
    ``n_chunks * k`` uint16 positions, then the 2-bit codes four to a byte, then ``n_chunks`` fp32 scales.
    ``k=120`` of ``chunk=4096`` (2.9%) is 274 bytes per 16 KiB of fp32: 60x fewer bytes per exchange,
    600x per step at ``sync_every=10``.

    Args:
        k: entries sent per chunk (``1 <= k <= chunk``).
        chunk: elements per chunk (at most 65536).
        decay: the error-feedback accumulator's decay per round, in ``(0, 1]``: 1 with DiLoCo's
            ``keep_unsent`` (the default there), 0.95 for the paper's restart (``keep_unsent=False``).
        rescale: DiLoCo scales the ranks' mean by :meth:`mean_scale` (the mean number of senders of an
            entry, divided out); ``False``: the plain mean over ranks.

    Example::

        compressor = SparseLoCoCompressor(k=120, chunk=4096)
        x, residual = torch.randn(10000), torch.zeros(10000)
        payload = torch.empty(compressor.wire_bytes(x.numel(), x.dtype), dtype=torch.uint8)
        compressor.compress_into(payload, x, residual, residual, seed=0)
        out = torch.empty_like(x)
        compressor.decompress_into(out, payload, x.numel())  # out + residual == x (decay applies next)
    """

    k: int = 120
    chunk: int = 4096
    decay: float = 1.0
    rescale: bool = True
    block = 0
    # the outer step this compressor is made for (the paper's): DiLoCo's defaults when unset there
    outer_step: ClassVar[Mapping[str, float | bool]] = MappingProxyType(
        {"outer_lr": 1.0, "outer_momentum": 0.0, "keep_unsent": True}
    )

    def __post_init__(self) -> None:
        for name in ("k", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.chunk > _MAX_CHUNK:
            raise ValueError(f"chunk must be at most {_MAX_CHUNK} (16-bit positions), got {self.chunk}")
        if self.k > self.chunk:
            raise ValueError(f"k ({self.k}) must be at most chunk ({self.chunk})")
        decay = self.decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
        if not isinstance(self.rescale, bool):
            raise ValueError(f"rescale must be True or False, got {self.rescale!r}")

    def _chunks(self, numel: int) -> int:
        return max(1, -(-numel // self.chunk))

    def _sizes(self, numel: int) -> tuple[int, int, int]:
        """Bytes of the positions, of the codes and of the scales of ``numel`` elements."""
        entries = self._chunks(numel) * self.k
        return 2 * entries, -(-entries // 4), 4 * self._chunks(numel)

    def mean_scale(self, mean: Tensor) -> float:
        """The factor that turns the ranks' mean of sparse pseudo-gradients into the mean over the ranks
        that sent each entry, on average: entries in ``mean`` (the union of the ranks' picks) over the
        entries one rank sends, at least 1 (at most the world size, when no two ranks picked alike).

        Example::

            mean = torch.zeros(8192); mean[:240] = 1.0  # two ranks, 120 + 120 entries, none shared
            SparseLoCoCompressor(k=60, chunk=4096).mean_scale(mean)  # 240 / 120 = 2.0
        """
        numel = mean.numel()
        last = numel - (self._chunks(numel) - 1) * self.chunk
        sent = (self._chunks(numel) - 1) * self.k + min(self.k, last)
        return max(1.0, int(torch.count_nonzero(mean)) / sent)

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return sum(self._sizes(numel))

    def compress_into(
        self, payload: Tensor, x: Tensor, residual_out: Tensor | None, residual_in: Tensor | None, seed: int
    ) -> None:
        numel, chunks = x.numel(), self._chunks(x.numel())
        accumulated = torch.zeros(chunks * self.chunk, dtype=torch.float32, device=x.device)
        accumulated[:numel].copy_(x.reshape(-1))
        if residual_in is not None:
            accumulated[:numel].add_(residual_in.reshape(-1).float(), alpha=float(self.decay))
        rows = accumulated.view(chunks, self.chunk)
        positions = rows.abs().topk(self.k, dim=1, sorted=False).indices
        values = rows.gather(1, positions)
        scales = values.abs().amax(dim=1, keepdim=True)
        codes = (values / torch.where(scales > 0, scales, 1.0) + 1.0).mul_(_LEVELS / 2).round_().clamp_(0, 3)
        if residual_out is not None:
            rows.scatter_(1, positions, values - (codes * (2 / _LEVELS) - 1.0) * scales)
            residual_out.view(-1).copy_(accumulated[:numel])
        position_bytes, code_bytes, _ = self._sizes(numel)
        payload[:position_bytes].copy_(positions.to(torch.int32).to(torch.int16).view(-1).view(torch.uint8))
        payload[position_bytes : position_bytes + code_bytes].copy_(reference.pack_codes(codes.view(-1), 2))
        payload[position_bytes + code_bytes :].copy_(scales.view(-1).view(torch.uint8))

    def _unpack(self, payload: Tensor, numel: int) -> tuple[Tensor, Tensor]:
        """``(int32 positions in the tensor, fp32 values)`` of one payload, padding positions included."""
        position_bytes, code_bytes, _ = self._sizes(numel)
        chunks = self._chunks(numel)
        within = payload[:position_bytes].clone().view(torch.int16).to(torch.int32) & 0xFFFF
        starts = torch.arange(chunks, dtype=torch.int32, device=payload.device).repeat_interleave(self.k)
        packed = payload[position_bytes : position_bytes + code_bytes]
        codes = reference.unpack_codes(packed, 2, chunks * self.k)
        scales = payload[position_bytes + code_bytes :].clone().view(torch.float32)
        levels = codes.float().mul_(2 / _LEVELS).sub_(1.0)
        return starts * self.chunk + within, levels.view(chunks, self.k).mul_(scales[:, None]).view(-1)

    def decompress_into(
        self, out: Tensor, payload: Tensor, payload_numel: int, accumulate: bool = False, divisor: int = 1
    ) -> None:
        positions, values = self._unpack(payload, payload_numel)
        if not accumulate:
            out.zero_()
        keep = positions < out.numel()
        values = values[keep].to(out.dtype)
        ops.sparse_accumulate(out.view(-1), positions[keep], values / divisor if divisor != 1 else values)

    def payload_finite(self, payloads: Tensor, payload_numel: int, dtype: torch.dtype) -> bool:
        position_bytes, code_bytes, _ = self._sizes(payload_numel)
        rows = payloads.reshape(-1, payloads.shape[-1])
        return all_finite(rows[:, position_bytes + code_bytes :].reshape(-1).clone().view(torch.float32))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            raise ValueError(f"SparseLoCoCompressor is stateless; got a state_dict with {sorted(state_dict)}")
