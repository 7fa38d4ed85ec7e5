"""Weighted streams: several sources mixed in set proportions, with an exact resume.

- :mod:`fastio.mixing.stream`: :class:`Stream` (a source and its weight) and the mixing modes.
- :mod:`fastio.mixing.schedule`: the epoch's mixed list of sample ids (counts, each stream's own walk, the
  interleave, the layout for the ranks).
- :mod:`fastio.mixing.source`: the streams' sources as one :class:`fastio.sources.Source`, with the
  provenance field ``"stream"``.
- :mod:`fastio.mixing.batches`: :class:`StreamBatches`, the loader's batches over that list, and its resume.

Example::

    loader = fastio.StreamLoader([fastio.Stream("data/web", 0.7), fastio.Stream("data/code", 0.3)],
                                 batch_size=64, shuffle=True, seed=0)
"""

from fastio.mixing.batches import StreamBatches, mixed_batches, mixing_identity
from fastio.mixing.schedule import MixedOrders
from fastio.mixing.source import PROVENANCE_FIELD, MixedSource, open_streams
from fastio.mixing.stream import MIX_MODES, Stream, as_streams

__all__ = [
    "MIX_MODES",
    "PROVENANCE_FIELD",
    "MixedOrders",
    "MixedSource",
    "Stream",
    "StreamBatches",
    "as_streams",
    "mixed_batches",
    "mixing_identity",
    "open_streams",
]
