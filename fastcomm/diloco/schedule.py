"""DiLoCo's outer learning rate: a number, a function of the step, or the default that follows the inner LR.

Why the default follows the inner optimizer's LR (docs/diloco.md, "Defaults"): a pseudo-gradient is the
sum of ``H`` inner steps, so its length follows the inner LR. From scratch, an outer step that extrapolates
past the replicas' mean while the inner LR warms up or peaks (long steps, replicas far apart) starts a loss
spike that a short run never recovers from. Later, as the inner LR decays, the replicas' steps are more and
more noise that their mean cancels: the mean is shorter than a step of each replica (or of dense AdamW,
whose steps are as long as a replica's), and a longer outer step gives that length back.
:class:`InnerLRFollower` is low until the inner LR has peaked and rises to high as it decays, with no run
length to know.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["InnerLRFollower", "check_outer_lr", "outer_lr_ramp"]


def check_outer_lr(value: Any, where: str = "") -> float:
    """``value`` as a float, or ``ValueError`` unless it is a number > 0 (``where`` ends the message).

    A number is Python's, numpy's or a one-element tensor (what ``float()`` takes without parsing a string).

    Example::

        lr = check_outer_lr(np.float32(0.7))
    """
    if isinstance(value, bool) or not hasattr(type(value), "__float__") or not float(value) > 0:
        raise ValueError(f"outer_lr must be a number > 0 or a function of the step returning one, got "
                         f"{value!r}{where}")
    return float(value)


def outer_lr_ramp(start: float, end: float, hold: int, until: int) -> Callable[[int], float]:
    """An outer lr schedule for :class:`~fastcomm.DiLoCo`: ``start`` up to inner step ``hold``, then linear
    to ``end`` at step ``until``, then ``end``.

    Why: from scratch, a full outer step on the first syncs (when the replicas move far apart in ``H``
    steps) can start a loss spike that a short run never recovers from; a lower outer lr then, rising
    later while the inner LR decays, kept 4-bit DiLoCo near dense on the LM task (docs/diloco.md). The
    default (:class:`InnerLRFollower`) does the same without the run's length.

    Example::

        outer = fastcomm.DiLoCo(model, inner, sync_every=10, outer_momentum=0.5,
                                outer_lr=fastcomm.outer_lr_ramp(0.5, 1.0, hold=100, until=500))
    """
    for name, value in (("start", start), ("end", end)):
        check_outer_lr(value, f" for {name}")
    if isinstance(hold, bool) or not isinstance(hold, int) or not 0 <= hold < until:
        raise ValueError(f"outer_lr_ramp needs 0 <= hold < until (ints), got hold={hold!r}, until={until!r}")

    def lr(step: int) -> float:
        if step <= hold:
            return float(start)
        if step >= until:
            return float(end)
        return start + (end - start) * (step - hold) / (until - hold)

    return lr


@dataclass
class InnerLRFollower:
    """DiLoCo's default outer lr: ``low`` until the inner LR has peaked, then rising to ``high`` as the inner
    LR decays: ``low + (high - low) * (1 - inner_lr / peak)``, ``peak`` the largest inner LR seen at a sync.

    A warm-up (the inner LR rising) and a constant inner LR both give ``low``; a cosine to zero ends at
    ``high``. ``peak`` is state (:meth:`state_dict`), so a resumed run continues the same schedule.

    Args:
        low: the outer lr at the inner LR's peak and before it.
        high: the outer lr once the inner LR has decayed to zero.

    Example::

        follow = InnerLRFollower(low=0.5, high=1.0)
        follow(1e-3), follow(2e-3), follow(1e-3)  # 0.5 (rising), 0.5 (the peak), 0.75 (half way down)
    """

    low: float = 0.5
    high: float = 1.0
    peak: float = 0.0

    def __post_init__(self) -> None:
        check_outer_lr(self.low, " for low")
        check_outer_lr(self.high, " for high")

    def __call__(self, inner_lr: float) -> float:
        if inner_lr >= self.peak:
            self.peak = float(inner_lr)
            return float(self.low)
        return self.low + (self.high - self.low) * (1.0 - inner_lr / self.peak)

    def state_dict(self) -> dict[str, float]:
        """The inner LR's peak seen so far."""
        return {"peak": self.peak}

    def load_state_dict(self, state_dict: dict[str, float]) -> None:
        """Restore :meth:`state_dict`'s peak."""
        self.peak = float(state_dict["peak"])
