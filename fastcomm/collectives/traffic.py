"""The traffic counter every mode reports through: the DDP hooks, FSDP and DiLoCo count bytes alike.

Each counts, per collective call, the payload bytes this rank sent (``sent_bytes``) beside what the dense
collective of the same tensors sends (``dense_bytes``, ring algorithms), and reports them under those names
with their ratio (:meth:`Traffic.stats`).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Traffic", "ring_bytes"]


def ring_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``numel`` elements: ``2 (W - 1) / W`` of the tensor.

    Example::

        >>> ring_bytes(1000, 4, 2)
        4000
    """
    return 2 * (world_size - 1) * numel * element_size // world_size


class Traffic:
    """Bytes this rank sent through compressed collectives, and what the dense collectives would send.

    Thread-safe: a hook counts from gloo's callback threads and the phase-2 lane as well as its own.

    Attributes:
        calls: collective calls counted (a gradient sync, a bucket, an unshard, a fragment's sync).
        sent_bytes: payload bytes this rank sent.
        dense_bytes: bytes this rank sends in the dense collectives of the same tensors.

    Example::

        traffic = Traffic()
        traffic.add(sent=1_000, dense=4_000)
        traffic.stats()  # {'sent_bytes': 1000, 'dense_bytes': 4000, 'compression_ratio': 4.0}
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = self.sent_bytes = self.dense_bytes = 0

    def add(self, sent: int, dense: int) -> None:
        """Count one call that sent ``sent`` bytes where the dense collective sends ``dense``."""
        with self._lock:
            self.calls += 1
            self.sent_bytes += sent
            self.dense_bytes += dense

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Traffic) and self.state_dict() == other.state_dict()

    __hash__ = None  # type: ignore[assignment]  # counters change: not a dict key

    def __repr__(self) -> str:
        return f"Traffic(calls={self.calls}, sent_bytes={self.sent_bytes}, dense_bytes={self.dense_bytes})"

    @property
    def compression_ratio(self) -> float:
        """``dense_bytes / sent_bytes`` (1.0 while nothing was sent)."""
        return self.dense_bytes / self.sent_bytes if self.sent_bytes else 1.0

    def stats(self) -> dict[str, int | float]:
        """``sent_bytes``, ``dense_bytes`` and ``compression_ratio``, the names every mode reports."""
        with self._lock:
            sent, dense = self.sent_bytes, self.dense_bytes
        return {"sent_bytes": sent, "dense_bytes": dense, "compression_ratio": dense / sent if sent else 1.0}

    def state_dict(self) -> dict[str, int]:
        """The counters."""
        with self._lock:
            return {"calls": self.calls, "sent_bytes": self.sent_bytes, "dense_bytes": self.dense_bytes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a missing counter reads as 0; ``bytes_sent``, the
        name the DDP hooks' and DiLoCo's checkpoints use, as ``sent_bytes``)."""
        sent = state_dict.get("sent_bytes", state_dict.get("bytes_sent", 0))
        with self._lock:
            self.calls, self.sent_bytes = int(state_dict.get("calls", 0)), int(sent)
            self.dense_bytes = int(state_dict.get("dense_bytes", 0))
