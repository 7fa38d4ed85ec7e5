"""Rank processes for the compressor tests: a compressor defined here, registered by name, trained with.

:class:`HalfCompressor` is the whole of a new compressor: one class against the ``Compressor`` protocol
and one registry call. The workers then use it through ``fastcomm.register(ddp, "half")`` and check the
result against the test's own arithmetic.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _hooks_workers import loss_of, make_mlp
from torch import Tensor, nn

import fastcomm
from fastcomm.compress import all_finite


@dataclass(frozen=True)
class HalfCompressor:
    """fp16 values on the wire, what fp16 rounding dropped kept as the residual (``block`` 1 or 0)."""

    block: int = 1

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return 2 * numel

    def compress_into(
        self, payload: Tensor, x: Tensor, residual_out: Tensor | None, residual_in: Tensor | None, seed: int
    ) -> None:
        acc = x.float() if residual_in is None else x.float() + residual_in.float()
        sent = acc.half()
        payload.copy_(sent.view(torch.uint8))
        if residual_out is not None:
            residual_out.copy_(acc - sent.float())

    def decompress_into(
        self, out: Tensor, payload: Tensor, payload_numel: int, accumulate: bool = False, divisor: int = 1
    ) -> None:
        values = payload[: 2 * out.numel()].clone().view(torch.float16).float() / divisor
        if accumulate:
            out.add_(values.to(out.dtype))
        else:
            out.copy_(values)

    def payload_finite(self, payloads: Tensor, payload_numel: int, dtype: torch.dtype) -> bool:
        return all_finite(payloads.contiguous().view(torch.float16))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        assert not state_dict


def _expected_first_step(raw: list[Tensor]) -> list[Tensor]:
    """The mean of every rank's fp16-rounded gradient; the two-phase exchange rounds the mean once more."""
    world_size = dist.get_world_size()
    expected = []
    for grad in raw:
        gathered = [torch.empty_like(grad) for _ in range(world_size)]
        dist.all_gather(gathered, grad)
        expected.append(sum(g.half().float() for g in gathered) / world_size)
    return expected


def registered_compressor_worker(rank: int, world_size: int) -> None:
    """A compressor registered by name trains through ``fastcomm.register``, both exchanges."""
    fastcomm.hooks.add_compressor("half", HalfCompressor)
    for block in (1, 0):  # blockwise: the two-phase exchange; not blockwise: the all-gather one
        model = make_mlp(80)
        local = copy.deepcopy(model)
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
        state = fastcomm.register(ddp, "half", block=block, min_compress_numel=0)
        assert isinstance(state, fastcomm.hooks.CompressorState) and state.compressor.block == block
        params, local_params = list(model.parameters()), list(local.parameters())
        sent = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)  # sum of hook outputs
        raw = torch.zeros_like(sent)  # sum of this rank's raw gradients
        for step in range(5):
            ddp.zero_grad()
            local.zero_grad()
            loss_of(ddp, rank, step).backward()
            loss_of(local, rank, step).backward()
            if step == 0:
                expected = _expected_first_step([q.grad for q in local_params])
                for p, e in zip(params, expected, strict=True):
                    final = e.half().float() if block else e  # phase 2 sends the mean in fp16 again
                    assert torch.equal(p.grad, final), f"block={block}: first step differs from fp16 mean"
            sent += torch.cat([p.grad.reshape(-1) for p in params]).double()
            raw += torch.cat([q.grad.reshape(-1) for q in local_params]).double()
        stats = state.stats()
        assert stats["steps"] == 5 and stats["compressed_buckets"] > 0, stats
        assert stats["compression_ratio"] > 1.9, stats  # fp16 instead of fp32
        # error feedback: what was sent plus what is still owed is every raw gradient, in the mean over ranks
        owed = torch.cat([state.residual_of(p).reshape(-1) for p in params]).double()
        dist.all_reduce(owed)
        dist.all_reduce(raw)
        err = float((sent + owed / world_size - raw / world_size).abs().max())
        assert err < 1e-5, f"block={block}: error feedback lost {err} across steps and the rebuild"
        restored = pickle.loads(pickle.dumps(state))
        assert restored.compressor == state.compressor and restored.stats()["steps"] == 5
