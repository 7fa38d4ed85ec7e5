"""What each hook sends and computes per step, flat and two-level, in the terms of :mod:`.model`.

Each :class:`Method` names a hook (a :func:`fastcomm.register` name and options) and how it exchanges a
bucket, as the hooks do (``fastcomm.hooks``):

- ``allreduce``: one allreduce of the bucket in its wire dtype (dense fp32: no hook; ``cast``: bf16), ring or
  tree, whichever is faster;
- ``two_phase`` (quantize, sign, blockwise compressors): an all-to-all of the compressed segments (each rank
  owns ``ceil(numel / W)`` elements rounded up to whole blocks and bytes), then an all-gather of each
  owner's re-compressed segment;
- ``all_gather`` (top-k): an all-gather of every rank's ``k = ceil(ratio * numel)`` (index, value) pairs;
- ``powersgd``: two allreduces of fp32, the dense elements and the ``P`` factors, then the ``Q`` factors.

Payload sizes come from the compressors' own ``wire_bytes`` (and PowerSGD's plan), so the model sends what
the hooks send. Two-level (``node_size = L``): a dense reduce-scatter inside the node, the flat exchange of a
``1/L`` shard over the nodes (every local rank at once, sharing the node's link), and an all-gather inside
the node of the shard's compressed payloads (two-phase) or of the decoded shard (top-k).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastcomm.advise.kernels import KernelRates
from fastcomm.advise.model import Topology, Transfer, all_gather, reduce_scatter
from fastcomm.compress import (
    CastCompressor,
    PowerSGDCompressor,
    QuantCompressor,
    SignCompressor,
    TopKCompressor,
)
from fastcomm.compress.protocol import Compressor

__all__ = ["METHODS", "Cost", "Method", "codec_kernels", "method_cost"]

_FP32 = 4


@dataclass(frozen=True)
class Method:
    """One hook configuration the advisor prices.

    Attributes:
        name: the row's name (``"quant8"``).
        hook: the :func:`fastcomm.register` name, ``None`` for no hook (dense allreduce).
        options: the register options.
        exchange: ``"allreduce"``, ``"two_phase"``, ``"all_gather"`` or ``"powersgd"``.
        flat_only: why fastcomm has no two-level (``node_size``) form of it, when it has none.

    Example::

        Method("quant2", "quantize", {"bits": 2}, "two_phase")   # a row advise.predict(methods=...) prices
    """

    name: str
    hook: str | None
    options: dict[str, Any] = field(default_factory=dict)
    exchange: str = "allreduce"
    flat_only: str | None = None

    def compressor(self) -> Compressor:
        """The compressor whose ``wire_bytes`` sizes this method's payloads (two-phase and top-k)."""
        if self.hook == "quantize":
            return QuantCompressor(self.options.get("bits", 8), self.options.get("block", 256))
        if self.hook == "sign":
            return SignCompressor(self.options.get("chunk", 2048))
        if self.hook in ("cast", "cast16"):
            return CastCompressor(self.options.get("dtype", torch.bfloat16))
        raise ValueError(f"{self.name}: a {self.exchange} method has no blockwise compressor")


METHODS: tuple[Method, ...] = (
    Method("allreduce", None, flat_only="dense allreduce: a ring already crosses each node's link once"),
    Method(
        "cast_bf16",
        "cast",
        {"dtype": torch.bfloat16},
        flat_only="cast_hook is flat; register(ddp, 'cast16', node_size=L) is its two-level form",
    ),
    Method("cast16", "cast16", {"dtype": torch.bfloat16}, "two_phase"),
    Method("topk_0.01", "topk", {"ratio": 0.01}, "all_gather"),
    Method("quant8", "quantize", {"bits": 8}, "two_phase"),
    Method("quant4", "quantize", {"bits": 4}, "two_phase"),
    Method("sign", "sign", {}, "two_phase"),
    Method(
        "powersgd_r4",
        "powersgd",
        {"rank": 4},
        "powersgd",
        flat_only="PowerSGD is flat: a 1/L shard would cut its matrices",
    ),
)


@dataclass(frozen=True)
class Cost:
    """One method's communication (as transfers on the topology's links) and compression seconds per step."""

    transfers: tuple[Transfer, ...]
    codec_s: float
    sent_bytes: float  # what one rank hands to the network per step, all collectives


def _unit(block: int) -> int:
    return block * 8 // math.gcd(block, 8)


def _segment(numel: int, ranks: int, block: int) -> int:
    unit = _unit(block)
    per_rank = -(-numel // ranks)
    return -(-per_rank // unit) * unit


def _codec_passes(method: Method) -> tuple[str, str]:
    """The (compress, decode) kernels of a two-phase method."""
    if method.hook == "quantize":
        bits = 8 if method.options.get("bits", 8) == 8 else 4  # 2-bit: 4-bit's rates (bench_kernels: alike)
        return f"quantize{bits}", f"dequantize{bits}"
    if method.hook == "sign":
        return "sign_compress", "sign_decompress"
    return "copy", "copy"  # a cast: about one memory pass each way


def codec_kernels(method: Method) -> tuple[str, ...]:
    """The :data:`~fastcomm.advise.kernels.KERNELS` keys :func:`method_cost` prices ``method``'s compression
    with (none for dense allreduce), e.g. to measure only those (:func:`~fastcomm.advise.measure_rates`)."""
    if method.exchange == "two_phase":
        return tuple(dict.fromkeys(_codec_passes(method)))
    if method.exchange == "all_gather":
        return ("topk_select",)
    if method.exchange == "powersgd":
        return ("powersgd_project", "powersgd_back_project", "powersgd_expand")
    return () if method.hook is None else ("copy",)


def _two_phase(method: Method, topology: Topology, numel: int, rates: KernelRates) -> Cost:
    """One bucket of ``numel`` through the flat two-phase exchange over ``topology``'s ranks."""
    compressor = method.compressor()
    w = topology.gpus
    segment = _segment(numel, w, compressor.block)
    payload = compressor.wire_bytes(segment, torch.float32)
    transfers = [*topology.flat_all_to_all(w * payload), topology.flat_ring(w * payload, 1.0)]
    compress, decode = _codec_passes(method)
    codec = (
        rates.seconds(compress, _FP32 * numel)
        + rates.seconds(decode, _FP32 * numel)
        + rates.seconds(compress, _FP32 * segment)
        + rates.seconds(decode, _FP32 * w * segment)
    )
    if compress == "copy":
        codec *= 0.75  # a cast reads 4 and writes 2 bytes (or the reverse) where a copy moves 4 and 4
    return Cost(tuple(transfers), codec, 2 * (w - 1) * payload)


def _top_k(method: Method, topology: Topology, numel: int, rates: KernelRates) -> Cost:
    k = min(numel, max(1, math.ceil(method.options.get("ratio", 0.01) * numel)))
    payload = TopKCompressor(k).wire_bytes(numel, torch.float32)
    w = topology.gpus
    codec = rates.seconds("topk_select", _FP32 * numel) + 2 * w * k / rates.sparse_entries_per_s
    return Cost((topology.flat_ring(w * payload, 1.0),), codec, (w - 1) * payload)


def _allreduce(method: Method, topology: Topology, numel: int, rates: KernelRates) -> Cost:
    width = 2 if method.hook == "cast" else _FP32
    codec = 0.0 if method.hook is None else 2 * 0.75 * rates.seconds("copy", _FP32 * numel)
    w = topology.gpus
    return Cost((topology.flat_allreduce(width * numel),), codec, 2 * (w - 1) / w * width * numel)


def _powersgd_sizes(method: Method, shapes: Sequence[Sequence[int]]) -> tuple[int, int]:
    plan = PowerSGDCompressor(method.options.get("rank", 4)).plan([torch.Size(s) for s in shapes], 1024)
    return plan.first_numel, plan.second_numel


def _powersgd(
    method: Method, topology: Topology, shapes: Sequence[Sequence[int]], buckets: int, rates: KernelRates
) -> Cost:
    first, second = _powersgd_sizes(method, shapes)
    w = topology.gpus
    transfers = []
    for numel in (first, second):  # one allreduce of each vector per bucket
        one = topology.flat_allreduce(_FP32 * numel / buckets)
        transfers.append(Transfer(one.link, buckets * one.seconds, buckets * one.cross_node_bytes))
    numel = sum(math.prod(s) for s in shapes)
    codec = sum(
        rates.seconds(k, _FP32 * numel)
        for k in ("powersgd_project", "powersgd_back_project", "powersgd_expand")
    )
    return Cost(tuple(transfers), codec, 2 * (w - 1) / w * _FP32 * (first + second))


def _flat(method: Method, topology: Topology, numel: int, rates: KernelRates) -> Cost:
    if method.exchange == "two_phase":
        return _two_phase(method, topology, numel, rates)
    if method.exchange == "all_gather":
        return _top_k(method, topology, numel, rates)
    return _allreduce(method, topology, numel, rates)


def _two_level(method: Method, topology: Topology, numel: int, rates: KernelRates) -> Cost:
    """One bucket through dense reduce-scatter in the node, the flat exchange of the shard across nodes, and
    the gather in the node."""
    per_node = topology.gpus_per_node
    shard = -(-numel // per_node)
    intra = topology.intra
    inner = _flat(method, topology.shard_exchange(), shard, rates)
    gathered = (
        method.compressor().wire_bytes(
            _segment(shard, topology.nodes, method.compressor().block), torch.float32
        )
        * topology.nodes
        if method.exchange == "two_phase"
        else _FP32 * shard
    )
    scatter = Transfer("intra", reduce_scatter(_FP32 * per_node * shard, per_node, intra))
    gather = Transfer("intra", all_gather(per_node * gathered, per_node, intra))
    summing = rates.seconds("copy", _FP32 * (per_node - 1) * shard)
    decode_rest = 0.0
    if method.exchange == "two_phase":
        _, decode = _codec_passes(method)
        decode_rest = rates.seconds(decode, _FP32 * (per_node - 1) * shard)  # the partners' shards
    sent = (per_node - 1) * (_FP32 * shard + gathered) + inner.sent_bytes
    # every local rank runs its shard's exchange at once: the node's link carries per_node of them
    crossing = tuple(Transfer(t.link, t.seconds, per_node * t.cross_node_bytes) for t in inner.transfers)
    return Cost((scatter, *crossing, gather), inner.codec_s + summing + decode_rest, sent)


def method_cost(
    method: Method,
    topology: Topology,
    numel: int,
    buckets: int,
    rates: KernelRates,
    shapes: Sequence[Sequence[int]],
    hierarchical: bool = False,
) -> Cost:
    """Communication and compression of ``method`` per step, for ``numel`` gradients in ``buckets`` equal
    buckets (PowerSGD: matrices of ``shapes``), flat or two-level.

    Raises:
        ValueError: ``hierarchical`` for a method that has no two-level form.

    Example::

        from fastcomm.advise import METHODS, Topology, parse_link, kernel_rates
        topology = Topology(4, 2, inter=parse_link("1gbit"), intra=parse_link("loopback"))
        cost = method_cost(METHODS[4], topology, 25_000_000, 4, kernel_rates(), [], hierarchical=True)
    """
    if hierarchical and method.flat_only:
        raise ValueError(f"{method.name} has no two-level form: {method.flat_only}")
    if method.exchange == "powersgd":
        return _powersgd(method, topology, shapes, buckets, rates)
    bucket = -(-numel // buckets)
    one = (_two_level if hierarchical and topology.gpus_per_node > 1 else _flat)(
        method, topology, bucket, rates
    )
    transfers = tuple(
        Transfer(t.link, buckets * t.seconds, buckets * t.cross_node_bytes) for t in one.transfers
    )
    return Cost(transfers, buckets * one.codec_s, buckets * one.sent_bytes)
