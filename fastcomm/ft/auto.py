"""``"auto"`` under torchft: each quorum's per-bucket choice, the same on every replica of the quorum.

:func:`fastcomm.register`'s ``"auto"`` measures one fixed world once and keeps its choice. Under torchft the
world is the quorum, and its size changes when a replica leaves or joins; a bucket compressed one way on a
replica and another way on its peer would be decoded as what it is not. :class:`QuorumAuto` decides again
at the first exchange of every quorum, on every replica alike:

1. the figures: the ``link`` given, or one probed on the quorum's group (auto's two timed all-reduces), and
   this replica's compression kernels timed on its device; the quorum agrees on the slowest replica's
   (one MAX all-reduce, :func:`fastcomm.hooks.auto.measured_figures`), so every replica holds the same;
2. each bucket size then gets :func:`fastcomm.hooks.auto.choose`'s pick for the quorum's size, a pure
   function of equal inputs: the same on every replica. What it is chosen from (candidates, margin, a
   given link) is compared at the quorum's first exchange (:class:`~fastcomm.ft.CompressorMismatchError`).

Not carried over from the fixed world: the warm-up, the timed trial against dense steps, and the recheck
(a quorum's world can change under them); the model's pick is used from the quorum's first step.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fastcomm.advise.methods import method_of
from fastcomm.advise.model import Link
from fastcomm.compress.protocol import Compressor
from fastcomm.hooks.auto import CANDIDATES, DEFAULT_CANDIDATES, choose, measured_figures

__all__ = ["OPTIONS", "QuorumAuto"]

OPTIONS = ("candidates", "margin", "link")  # what fastcomm.ft.register(..., "auto") takes


class QuorumAuto:
    """The per-bucket choice of ``"auto"`` for the current quorum (:func:`fastcomm.ft.register`).

    Args:
        device: where the buckets are (the kernels are timed there).
        largest: the largest bucket's elements (the kernels are timed at that size).
        candidates: names of :data:`fastcomm.hooks.auto.CANDIDATES` to choose among, besides dense.
        margin: how much faster than dense a candidate must be predicted to be chosen.
        link: a :class:`~fastcomm.advise.model.Link` to use instead of probing each quorum's.

    Example::

        auto = QuorumAuto("cpu", 1 << 20, link=Link(1e-4, 1.25e8))
        auto.decide(group)                  # at a quorum's first exchange, on every replica
        auto.compressor(1 << 20)            # a quantize4 compressor, say, or None (dense)
    """

    def __init__(self, device: str, largest: int, candidates: tuple[str, ...] = DEFAULT_CANDIDATES,
                 margin: float = 0.1, link: Link | None = None) -> None:  # fmt: skip
        if isinstance(candidates, str):
            raise ValueError(f"candidates must be a tuple of names among {sorted(CANDIDATES)}, got "
                             f"{candidates!r}")  # fmt: skip
        self.candidates = tuple(method_of(name, tuple(CANDIDATES.values())).name for name in candidates)
        if not 0.0 <= float(margin) < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        if link is not None and not isinstance(link, Link):
            raise ValueError(f"link must be a fastcomm.advise.model.Link or None, got {link!r}")
        self.device, self.largest, self.margin, self.link = device, largest, float(margin), link
        self._compressors = {name: CANDIDATES[name].build_compressor() for name in self.candidates}
        self._group: dist.ProcessGroup | None = None
        self.figures: tuple[Link, Any] | None = None
        self.world_size = 0
        self.choices: dict[int, str] = {}
        # (quorum size, that quorum's choices by bucket size): one entry a quorum, the choices filled in
        # as its buckets come
        self.decisions: list[tuple[int, dict[int, str]]] = []

    def settings(self) -> str:
        """What every replica of a quorum must share (compared at its first exchange)."""
        return f"candidates={self.candidates} margin={self.margin} link={self.link!r}"

    def decide(self, group: dist.ProcessGroup) -> None:
        """At the first call on ``group`` (a new quorum): agree on the figures, forget the last choices. A
        collective on ``group``; later calls on it do nothing."""
        if group is self._group:
            return
        self.figures = measured_figures(self.link, self.device, self.candidates, self.largest, group)
        self._group, self.world_size, self.choices = group, group.size(), {}
        self.decisions.append((self.world_size, self.choices))

    def choice(self, numel: int) -> str:
        """The current quorum's method for a bucket of ``numel`` elements (``"dense"``, ``"quantize8"``)."""
        if self.figures is None:
            raise RuntimeError("QuorumAuto.choice before decide(): decide at the quorum's first exchange")
        if numel not in self.choices:
            link, rates = self.figures
            self.choices[numel] = choose(numel, self.world_size, link, rates, self.candidates, self.margin)
        return self.choices[numel]

    def compressor(self, numel: int) -> Compressor | None:
        """The chosen method's compressor for a bucket of ``numel`` elements, or ``None`` (dense)."""
        name = self.choice(numel)
        return None if name == "dense" else self._compressors[name]
