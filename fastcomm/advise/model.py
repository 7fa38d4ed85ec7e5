"""The alpha-beta cost model: links, collectives, a two-level topology, and how a step hides communication.

A message of ``b`` bytes over a :class:`Link` takes ``alpha + b / bandwidth``. The collectives below give the
time of the standard algorithms over ``p`` ranks on one link, where ``nbytes`` is the whole vector:

==================  ===============================================  ============================
collective          time                                             each rank sends
==================  ===============================================  ============================
ring allreduce      ``2 (p-1)/p * n/B + 2 (p-1) alpha``              ``2 (p-1)/p * n``
tree allreduce      ``2 n/B + 2 ceil(log2 p) alpha`` (pipelined)     ``2 n`` at inner nodes
reduce-scatter      ``(p-1)/p * n/B + (p-1) alpha``                  ``(p-1)/p * n``
all-gather          ``(p-1)/p * n/B + (p-1) alpha``                  ``(p-1)/p * n``
all-to-all          ``(p-1)/p * n/B + (p-1) alpha`` (pairwise)       ``(p-1)/p * n``
==================  ===============================================  ============================

:class:`Topology` places ``gpus`` ranks on nodes of ``gpus_per_node``: ranks of a node share the ``intra``
link, and each node has one ``inter`` link (its NIC, one ``bandwidth`` each way) shared by its ranks. A ring
over every rank in node order crosses each NIC once, so a flat ring collective runs at the slower link's
rate; an all-to-all sends ``L (W-L)/W`` of a rank's buffer through each NIC (every rank talks to every other
node's ranks).

How a step hides communication (:func:`exposed_seconds`), the stated assumptions:

1. DDP's buckets become ready evenly over the backward pass, which is ``backward_share`` (2/3) of the step's
   compute; a bucket's communication starts when it is ready and its link is free.
2. Communication on a link that ``overlaps_compute`` (a NIC or NVLink moving data by DMA) then runs behind
   the rest of the backward pass: only ``max(C / buckets, C - backward * (buckets-1)/buckets)`` of its ``C``
   seconds shows, which is the last bucket's share when the link keeps up.
3. Communication on a link that does not (TCP over loopback, whose copies run on the cores that compute)
   shows in full.
4. Compression kernels run on the compute stream (or the compute cores): they add to the step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = [
    "ETHERNET_EFFICIENCY",
    "LINK_PRESETS",
    "Link",
    "Topology",
    "Transfer",
    "all_gather",
    "all_to_all",
    "exposed_seconds",
    "parse_link",
    "parse_seconds",
    "reduce_scatter",
    "ring_allreduce",
    "tree_allreduce",
]

# TCP payload per Ethernet frame: a 1448-byte segment (1500 MTU less IP/TCP headers and timestamps) in a
# 1514-byte frame, which is what tc's tbf meters; a shaped 1 Gbit/s veth moved 119.5 MB/s (0.956 of 125)
ETHERNET_EFFICIENCY = 1448 / 1514


@dataclass(frozen=True)
class Link:
    """One link: latency per message, bytes per second each way, and whether its transfers hide behind
    compute.

    Attributes:
        alpha_s: seconds per message (latency and per-call overhead).
        bandwidth_Bps: payload bytes per second in each direction.
        overlaps_compute: ``True`` when the link moves data without the compute cores (NIC, NVLink);
            ``False`` for TCP over loopback on cores that are busy computing.
        name: how the link was given, for printing.

    Example::

        >>> Link(alpha_s=0.0, bandwidth_Bps=1e9).transfer(2e9)
        2.0
    """

    alpha_s: float
    bandwidth_Bps: float  # noqa: N815 - bytes per second, spelled as the issue does
    overlaps_compute: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        if not self.alpha_s >= 0 or not math.isfinite(self.alpha_s):
            raise ValueError(f"alpha_s must be a finite number >= 0, got {self.alpha_s!r}")
        if not self.bandwidth_Bps > 0 or not math.isfinite(self.bandwidth_Bps):
            raise ValueError(f"bandwidth_Bps must be a finite number > 0, got {self.bandwidth_Bps!r}")

    def transfer(self, nbytes: float, messages: int = 1) -> float:
        """Seconds to send ``nbytes`` as ``messages`` messages."""
        return messages * self.alpha_s + nbytes / self.bandwidth_Bps


# Per-GPU figures for the common in-node links (alpha: a small collective's latency). NVLink 4 (H100) moves
# 450 GB/s each way; NCCL's allreduce reaches about 2/3 of it. PCIe 4.0 x16: 32 GB/s nominal, ~20 achieved.
# Loopback: TCP between processes of one machine, about 1.5 GB/s per stream (netlab's traffic check measured
# 1477 MB/s), its copies on the CPU.
LINK_PRESETS: dict[str, Link] = {
    "nvlink": Link(5e-6, 300e9, True, "nvlink"),
    "pcie": Link(10e-6, 20e9, True, "pcie"),
    "loopback": Link(50e-6, 1.5e9, False, "loopback"),
}

_RATE = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|bps|b/s|B/s|Bps)\s*$", re.IGNORECASE
)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_link(text: str, alpha_s: float = 25e-6) -> Link:
    """A :class:`Link` from a preset name or a rate.

    Bit rates (``25gbit``, ``100mbit``, ``10Gbps``) are Ethernet: the payload rate is
    :data:`ETHERNET_EFFICIENCY` of it. Byte rates (``12GB/s``, ``500MBps``) are taken as payload rates.
    Presets (``nvlink``, ``pcie``, ``loopback``) carry their own latency.

    Raises:
        ValueError: neither a preset nor a rate.

    Example::

        >>> round(parse_link("1gbit").bandwidth_Bps / 1e6, 1)
        119.5
    """
    preset = LINK_PRESETS.get(text.strip().lower())
    if preset is not None:
        return preset
    match = _RATE.match(text)
    if match is None:
        known = ", ".join(LINK_PRESETS)
        raise ValueError(f"not a link: {text!r}; give a rate (25gbit, 100mbit, 12GB/s) or one of {known}")
    value, prefix, unit = float(match.group(1)), match.group(2).lower(), match.group(3)
    bits = unit.lower() == "bit" or unit in ("bps", "b/s")  # lower-case b: bits, as in 10Gbps
    rate = value * _SCALE[prefix] * (ETHERNET_EFFICIENCY / 8 if bits else 1.0)
    return Link(alpha_s, rate, True, text.strip())


def parse_seconds(text: str | float) -> float:
    """Seconds from ``0.8``, ``"0.8s"`` or ``"800ms"``.

    Example::

        >>> parse_seconds("800ms")
        0.8
    """
    if isinstance(text, (int, float)):
        return float(text)
    match = re.match(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ms|us|s)?\s*$", text)
    if match is None:
        raise ValueError(f"not a duration: {text!r}; give seconds (0.8, 0.8s) or milliseconds (800ms)")
    return float(match.group(1)) * {"ms": 1e-3, "us": 1e-6}.get(match.group(2) or "s", 1.0)


def _check(nbytes: float, p: int) -> None:
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"p must be a positive int, got {p!r}")


def ring_allreduce(nbytes: float, p: int, link: Link) -> float:
    """Ring allreduce of ``nbytes`` over ``p`` ranks: ``2 (p-1)/p * n/B + 2 (p-1) alpha``.

    Example::

        >>> ring_allreduce(1e9, 2, Link(0.0, 1e9))
        1.0
    """
    _check(nbytes, p)
    return 0.0 if p == 1 else 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes / link.bandwidth_Bps


def tree_allreduce(nbytes: float, p: int, link: Link) -> float:
    """Pipelined binary-tree allreduce (reduce up, broadcast down): ``2 n/B + 2 ceil(log2 p) alpha``.

    An inner node receives from two children and sends to its parent (and the reverse going down), so the
    bandwidth term does not shrink with ``p``; the latency term grows with the depth only (NCCL's tree).

    Example::

        >>> tree_allreduce(1e9, 8, Link(1e-3, 1e9))
        2.006
    """
    _check(nbytes, p)
    return 0.0 if p == 1 else 2 * math.ceil(math.log2(p)) * link.alpha_s + 2 * nbytes / link.bandwidth_Bps


def reduce_scatter(nbytes: float, p: int, link: Link) -> float:
    """Ring reduce-scatter of ``nbytes`` (each rank ends with ``n/p``): ``(p-1)/p * n/B + (p-1) alpha``.

    Example::

        >>> reduce_scatter(1e9, 4, Link(0.0, 1e9))
        0.75
    """
    _check(nbytes, p)
    return 0.0 if p == 1 else (p - 1) * link.alpha_s + (p - 1) / p * nbytes / link.bandwidth_Bps


def all_gather(nbytes: float, p: int, link: Link) -> float:
    """Ring all-gather of ``nbytes`` in all (``n/p`` from each rank): ``(p-1)/p * n/B + (p-1) alpha``.

    Example::

        >>> all_gather(1e9, 4, Link(0.0, 1e9))
        0.75
    """
    return reduce_scatter(nbytes, p, link)


def all_to_all(nbytes: float, p: int, link: Link) -> float:
    """Pairwise all-to-all of a ``nbytes`` buffer per rank (``n/p`` to each rank, all at once):
    ``(p-1)/p * n/B + (p-1) alpha``.

    Example::

        >>> all_to_all(1e9, 2, Link(0.0, 1e9))
        0.5
    """
    return reduce_scatter(nbytes, p, link)


@dataclass(frozen=True)
class Transfer:
    """Seconds of one collective (or its part) on one of a topology's links: ``"intra"`` or ``"inter"``."""

    link: str
    seconds: float
    cross_node_bytes: float = 0.0  # bytes each node sends over its NIC (each way)


@dataclass(frozen=True)
class Topology:
    """``gpus`` ranks, ``gpus_per_node`` to a node; ``intra`` joins a node's ranks, ``inter`` is each node's
    link to the others (shared by its ranks).

    Example::

        topology = Topology(64, 8, inter=parse_link("25gbit"), intra=parse_link("nvlink"))
        topology.flat_ring(2 * 1e9, 2.0)   # a ring allreduce of 1 GB over all 64 ranks
    """

    gpus: int
    gpus_per_node: int
    inter: Link
    intra: Link

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"gpus must be a positive int, got {self.gpus!r}")
        per_node = self.gpus_per_node
        if not isinstance(per_node, int) or per_node < 1 or self.gpus % per_node:
            raise ValueError(
                f"gpus_per_node must be a positive int dividing gpus={self.gpus}, got {per_node!r}"
            )

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    def link(self, name: str) -> Link:
        return self.intra if name == "intra" else self.inter

    def flat_ring(self, nbytes: float, passes: float) -> Transfer:
        """A ring collective over every rank moving ``passes * (W-1)/W * nbytes`` per rank (2 for an
        allreduce, 1 for a reduce-scatter or all-gather), with ``passes * (W-1)`` messages: at the slower
        link's rate when the ring crosses nodes."""
        w = self.gpus
        if w == 1:
            return Transfer("intra", 0.0)
        volume = passes * (w - 1) / w * nbytes
        messages = round(passes * (w - 1))
        if self.nodes == 1:
            return Transfer("intra", self.intra.transfer(volume, messages))
        slow = min((self.intra, self.inter), key=lambda link: link.bandwidth_Bps)
        alpha = max(self.intra.alpha_s, self.inter.alpha_s)
        name = "inter" if slow is self.inter else "intra"
        return Transfer(name, messages * alpha + volume / slow.bandwidth_Bps, volume)

    def flat_tree(self, nbytes: float) -> Transfer:
        """A pipelined tree allreduce over every rank (:func:`tree_allreduce`): ``2 n`` through the slowest
        link on the tree's paths, ``2 ceil(log2 W)`` of its latencies."""
        w = self.gpus
        if w == 1:
            return Transfer("intra", 0.0)
        if self.nodes == 1:
            return Transfer("intra", tree_allreduce(nbytes, w, self.intra))
        slow = min((self.intra, self.inter), key=lambda link: link.bandwidth_Bps)
        alpha = max(self.intra.alpha_s, self.inter.alpha_s)
        name = "inter" if slow is self.inter else "intra"
        seconds = 2 * math.ceil(math.log2(w)) * alpha + 2 * nbytes / slow.bandwidth_Bps
        return Transfer(name, seconds, 2 * nbytes)

    def flat_allreduce(self, nbytes: float) -> Transfer:
        """An allreduce over every rank as a library picks it (NCCL's tuner; gloo's ring on few ranks):
        the faster of the ring and the tree."""
        return min(self.flat_ring(nbytes, 2.0), self.flat_tree(nbytes), key=lambda t: t.seconds)

    def flat_all_to_all(self, nbytes: float) -> list[Transfer]:
        """A pairwise all-to-all of ``nbytes`` per rank over every rank: ``(L-1)/W`` of it inside the node,
        ``L (W-L)/W`` of a rank's buffer through each node's NIC."""
        w, per_node = self.gpus, self.gpus_per_node
        inside = self.intra.transfer((per_node - 1) / w * nbytes, per_node - 1) if per_node > 1 else 0.0
        transfers = [Transfer("intra", inside)]
        if self.nodes > 1:
            crossing = per_node * (w - per_node) / w * nbytes
            transfers.append(Transfer("inter", self.inter.transfer(crossing, w - per_node), crossing))
        return transfers

    def shard_exchange(self) -> Topology:
        """The topology of one local rank's cross-node exchange in a two-level schedule: one rank per node,
        sharing its NIC with the node's other ``gpus_per_node - 1`` exchanges running at the same time."""
        shared = replace(self.inter, bandwidth_Bps=self.inter.bandwidth_Bps / self.gpus_per_node)
        return Topology(self.nodes, 1, inter=shared, intra=self.intra)


def exposed_seconds(
    transfers: Sequence[Transfer], topology: Topology, backward_s: float, buckets: int
) -> float:
    """The communication a step shows, from its transfers (the module docstring's assumptions 1-3).

    Transfers on a link that does not overlap compute add up; the others, per link, run behind the
    backward pass (links run in parallel, pipelined over the buckets).

    Example::

        >>> t = Topology(2, 2, inter=Link(0, 1e9), intra=Link(0, 1e9))
        >>> exposed_seconds([Transfer("intra", 1.0)], t, backward_s=0.6, buckets=4)
        0.55
    """
    buckets = max(1, buckets)
    serial = 0.0
    per_link: dict[str, float] = {}
    for transfer in transfers:
        if topology.link(transfer.link).overlaps_compute:
            per_link[transfer.link] = per_link.get(transfer.link, 0.0) + transfer.seconds
        else:
            serial += transfer.seconds
    if not per_link:
        return serial
    slowest = max(per_link.values())
    hidden_busy = slowest + (sum(per_link.values()) - slowest) / buckets
    return serial + max(hidden_busy / buckets, hidden_busy - backward_s * (buckets - 1) / buckets)
