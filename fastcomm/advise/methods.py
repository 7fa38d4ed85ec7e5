"""What each hook sends and computes per step, flat and two-level, in the terms of :mod:`.model`.

Each :class:`Method` is a compressor in the one vocabulary (:mod:`fastcomm.compress.registry`: a name and
its options, or none for dense allreduce) and the exchange a hook runs it through, as the hooks do
(``fastcomm.hooks``):

- ``allreduce``: one allreduce of the bucket in its wire dtype (dense fp32: no hook; ``cast``: bf16), ring or
  tree, whichever is faster;
- ``two_phase`` (quantize, sign, blockwise compressors): an all-to-all of the compressed segments (each rank
  owns ``ceil(numel / W)`` elements rounded up to whole blocks and bytes), then an all-gather of each
  owner's re-compressed segment;
- ``all_gather`` (top-k): an all-gather of every rank's ``k = ceil(ratio * numel)`` (index, value) pairs;
- ``powersgd``: two allreduces of fp32, the dense elements and the ``P`` factors, then the ``Q`` factors.

A method's name is its compressor's :func:`~fastcomm.compress.registry.label` (``"quantize8"``,
``"topk0.01"``, ``"powersgd_r4"``), the same in the advisor's rows, the "auto" hook's candidates and its
``stats()`` keys, and the benchmarks. The names before this vocabulary (``"quant8"``, ``"quant4"``,
``"cast16"``, ``"topk_0.01"``: :data:`RENAMED_METHODS`) still find their rows through :func:`method_of` for
one release, with a ``DeprecationWarning`` naming the new one.

Payload sizes come from the compressors' own ``wire_bytes`` (and PowerSGD's plan), so the model sends what
the hooks send. Two-level (``node_size = L``): a dense reduce-scatter inside the node, the flat exchange of a
``1/L`` shard over the nodes (every local rank at once, sharing the node's link), and an all-gather inside
the node of the shard's compressed payloads (two-phase) or of the decoded shard (top-k).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from fastcomm.advise.kernels import KernelRates
from fastcomm.advise.model import Topology, Transfer, all_gather, reduce_scatter
from fastcomm.compress import registry
from fastcomm.compress.protocol import AllreduceCompressor, Compressor

__all__ = ["EXCHANGES", "METHODS", "RENAMED_METHODS", "Cost", "Method", "codec_kernels", "method_cost",
           "method_of"]  # fmt: skip

_FP32 = 4
EXCHANGES = ("allreduce", "two_phase", "all_gather", "powersgd")
_DENSE = "allreduce"  # the name of the method without a compressor


@dataclass(frozen=True)
class Method:
    """One hook configuration the advisor prices: a compressor and the exchange it goes through.

    Attributes:
        compressor: a name of :mod:`fastcomm.compress.registry` (``"quantize"``), ``None`` for dense
            allreduce (no hook).
        options: its options in the same vocabulary (``{"bits": 8}``; topk: the hooks' ``ratio``).
        exchange: one of :data:`EXCHANGES`.
        flat_only: why fastcomm has no two-level (``node_size``) form of it, when it has none.
        exchange_in_name: add ``_<exchange>`` to the name: the row's compressor and options are another
            row's too, through another exchange (the ``cast`` compressor's two-phase exchange beside
            ``cast_hook``'s allreduce).

    Example::

        two_bit = Method("quantize", {"bits": 2}, "two_phase")   # two_bit.name == "quantize2"
        rows = fastcomm.advise.predict(1.3e9, 64, 8, "25gbit", "nvlink", 0.8, methods=[METHODS[0], two_bit])
    """

    compressor: str | None
    options: Mapping[str, Any] = field(default_factory=dict)
    exchange: str = "allreduce"
    flat_only: str | None = None
    exchange_in_name: bool = False

    def __post_init__(self) -> None:
        if self.compressor is not None:  # a renamed compressor name warns (at the caller) and resolves
            object.__setattr__(self, "compressor", registry.factory_of(self.compressor, stacklevel=4)[0])
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"options must be a mapping of the compressor's options, got {self.options!r}")

    @cached_property
    def name(self) -> str:
        """The row's name: the compressor's :func:`~fastcomm.compress.registry.label` (``"allreduce"``
        without one), with ``_<exchange>`` where :attr:`exchange_in_name`."""
        if self.compressor is None:
            return _DENSE
        text = registry.label(self.compressor, **self.options)
        return f"{text}_{self.exchange}" if self.exchange_in_name else text

    def build_compressor(self) -> Compressor:
        """The compressor whose ``wire_bytes`` sizes this method's payloads (two-phase and cast), built by
        :mod:`fastcomm.compress.registry`.

        Raises:
            ValueError: a dense, top-k or PowerSGD method (their payloads are sized otherwise).
        """
        built = None
        if self.compressor is not None and self.exchange in ("allreduce", "two_phase"):
            built = registry.compressor_of(self.compressor, self.options)
        if not isinstance(built, Compressor):
            raise ValueError(f"{self.name}: a {self.exchange} method has no blockwise compressor")
        return built


METHODS: tuple[Method, ...] = (
    Method(None, flat_only="dense allreduce: a ring already crosses each node's link once"),
    Method(
        "cast",
        {"dtype": torch.bfloat16},
        flat_only="cast_hook is flat; register(ddp, fastcomm.compressor('cast'), node_size=L) "
        "(cast_bf16_two_phase) is its two-level form",
    ),
    Method("cast", {"dtype": torch.bfloat16}, "two_phase", exchange_in_name=True),
    Method("topk", {"ratio": 0.01}, "all_gather"),
    Method("quantize", {"bits": 8}, "two_phase"),
    Method("quantize", {"bits": 4}, "two_phase"),
    Method("sign", {}, "two_phase"),
    Method(
        "powersgd",
        {"rank": 4},
        "powersgd",
        flat_only="PowerSGD is flat: a 1/L shard would cut its matrices",
    ),
)

# a method's name before the labels of fastcomm.compress.registry -> its name now (served, with a
# DeprecationWarning, until the next release)
RENAMED_METHODS: Mapping[str, str] = {
    "quant8": "quantize8",
    "quant4": "quantize4",
    "cast16": "cast_bf16_two_phase",
    "topk_0.01": "topk0.01",
}


def method_of(name: str, methods: Sequence[Method] = METHODS, stacklevel: int = 2) -> Method:
    """The method of ``methods`` called ``name``; an old name (:data:`RENAMED_METHODS`) warns and resolves.

    Args:
        name: a method's name (``"quantize8"``, ``"allreduce"``).
        methods: where to look (default :data:`METHODS`).
        stacklevel: where the warning points (2: at the caller of this function).

    Raises:
        ValueError: no method has this name; the message lists the names there are.

    Example::

        row = method_of("quantize4")
        rows = fastcomm.advise.predict(1.3e9, 64, 8, "25gbit", "nvlink", 0.8, methods=[METHODS[0], row])
    """
    if isinstance(name, str) and name in RENAMED_METHODS:
        new = RENAMED_METHODS[name]
        warnings.warn(
            f"the method name {name!r} is deprecated and goes in the next release: use {new!r}",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        name = new
    found = next((m for m in methods if m.name == name), None)
    if found is None:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(m.name for m in methods)}")
    return found


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
    if method.compressor == "quantize":
        bits = 8 if method.options.get("bits", 8) == 8 else 4  # 2-bit: 4-bit's rates (bench_kernels: alike)
        return f"quantize{bits}", f"dequantize{bits}"
    if method.compressor == "sign":
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
    return () if method.compressor is None else ("copy",)


def _two_phase(method: Method, topology: Topology, numel: int, rates: KernelRates) -> Cost:
    """One bucket of ``numel`` through the flat two-phase exchange over ``topology``'s ranks."""
    compressor = method.build_compressor()
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
    payload = registry.compressor("topk", k=k).wire_bytes(numel, torch.float32)
    w = topology.gpus
    codec = rates.seconds("topk_select", _FP32 * numel) + 2 * w * k / rates.sparse_entries_per_s
    return Cost((topology.flat_ring(w * payload, 1.0),), codec, (w - 1) * payload)


def _allreduce(method: Method, topology: Topology, numel: int, rates: KernelRates) -> Cost:
    width = _FP32 if method.compressor is None else method.options.get("dtype", torch.bfloat16).itemsize
    codec = 0.0 if method.compressor is None else 2 * 0.75 * rates.seconds("copy", _FP32 * numel)
    w = topology.gpus
    return Cost((topology.flat_allreduce(width * numel),), codec, 2 * (w - 1) / w * width * numel)


def _powersgd_sizes(method: Method, shapes: Sequence[Sequence[int]]) -> tuple[int, int]:
    powersgd = registry.compressor_of("powersgd", method.options)
    assert isinstance(powersgd, AllreduceCompressor)
    plan = powersgd.plan([torch.Size(s) for s in shapes], 1024)
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
        method.build_compressor().wire_bytes(
            _segment(shard, topology.nodes, method.build_compressor().block), torch.float32
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
