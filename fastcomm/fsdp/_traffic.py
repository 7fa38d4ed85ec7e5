"""What one FSDP collective sent, beside what its dense twin would have sent."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Traffic"]


@dataclass
class Traffic:
    """Bytes this rank sent through one compressed collective, and what the dense collective sends.

    Attributes:
        calls: how many times the collective ran (one per gradient sync, or per unshard for a gather).
        sent_bytes: payload bytes this rank sent.
        dense_bytes: bytes this rank sends in the dense collective of the same tensors (ring algorithms).

    Example::

        traffic = Traffic()
        traffic.add(sent=1_000, dense=4_000)
    """

    calls: int = 0
    sent_bytes: int = 0
    dense_bytes: int = 0

    def add(self, sent: int, dense: int) -> None:
        """Count one call."""
        self.calls += 1
        self.sent_bytes += sent
        self.dense_bytes += dense

    def state_dict(self) -> dict[str, int]:
        """The counters."""
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.calls, self.sent_bytes = int(state_dict["calls"]), int(state_dict["sent_bytes"])
        self.dense_bytes = int(state_dict["dense_bytes"])
