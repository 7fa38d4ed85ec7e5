"""The parameters cut into fragments, and the exchange of one fragment's pseudo-gradient.

A :class:`Fragment` is a run of consecutive parameters (about ``1/F`` of the model's elements) with what the
outer optimizer keeps for it: the global weights (fp32, flat), the outer momentum and the error-feedback
:class:`~fastcomm.collectives.Residual`. An :class:`Exchange` is one fragment's pseudo-gradient on its way
through an all-reduce: issued at one step, waited for and applied at a later one (or the same).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastcomm.collectives import (
    CompressedWork,
    PeerCollectiveError,
    Residual,
    Traffic,
    all_reduce,
    ring_bytes,
)
from fastcomm.compress.protocol import AllreduceCompressor, Compressor

__all__ = ["Exchange", "Fragment", "split_parameters"]


def split_parameters(params: Sequence[nn.Parameter], fragments: int) -> list[list[nn.Parameter]]:
    """``params`` cut into ``fragments`` runs of consecutive parameters of about equal element counts.

    Example::

        groups = split_parameters(list(model.parameters()), 4)
    """
    if fragments > len(params):
        raise ValueError(f"fragments ({fragments}) must be at most the number of parameters ({len(params)})")
    prefix = [0]
    for param in params:
        prefix.append(prefix[-1] + param.numel())
    starts = [0]
    for k in range(1, fragments):
        cut = starts[-1] + 1  # at least one parameter per fragment, and one left for each later one
        while cut < len(params) - (fragments - k) and prefix[cut] * fragments < k * prefix[-1]:
            cut += 1
        starts.append(cut)
    starts.append(len(params))
    return [list(params[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]


@dataclass
class Fragment:
    """One fragment: its parameters and the outer optimizer's state for them.

    Example::

        fragment = Fragment.of(0, [p for p in model.parameters()], offset=0)
        delta = fragment.global_weights - fragment.local_weights()
    """

    index: int
    params: list[nn.Parameter]
    offset: int  # the fragment syncs after the steps s with s % sync_every == offset
    global_weights: Tensor
    momentum: Tensor
    residual: Residual = field(default_factory=Residual)

    @classmethod
    def of(
        cls, index: int, params: list[nn.Parameter], offset: int, residual_dtype: torch.dtype | None = None
    ) -> Fragment:
        """A fragment whose global weights are the parameters' values now (fp32), its residual kept in
        ``residual_dtype`` between exchanges."""
        flat = torch.cat([p.detach().reshape(-1).float() for p in params])
        return cls(index, params, offset, flat, torch.zeros_like(flat), Residual(residual_dtype))

    @property
    def numel(self) -> int:
        return self.global_weights.numel()

    def local_weights(self) -> Tensor:
        """This rank's weights of the fragment, fp32, flat (a copy)."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def write_local(self, flat: Tensor) -> None:
        """Copy ``flat`` into the parameters (rounded to their dtype)."""
        start = 0
        with torch.no_grad():
            for param in self.params:
                param.copy_(flat[start : start + param.numel()].view_as(param))
                start += param.numel()


@dataclass
class Exchange:
    """One fragment's pseudo-gradient being averaged: issued after step ``issued``, applied after ``due``.

    ``mean`` becomes the ranks' mean once :meth:`settle` returns; ``sent_local`` is the fragment's local
    weights at the send (kept only when the exchange is applied later than issued).
    """

    fragment: int
    issued: int
    due: int
    mean: Tensor
    sent_local: Tensor | None
    work: CompressedWork | dist.Work | None = None
    divide_by: int = 1  # a plain all-reduce sums; the mean divides by the world size
    scale_of: Callable[[Tensor], float] | None = None  # a sparse mean's rescale (SparseLoCo's mean_scale)
    blocked_s: float = 0.0

    @classmethod
    def start(
        cls, fragment: Fragment, *, step: int, due: int, compressor: Compressor | AllreduceCompressor | None,
        group: dist.ProcessGroup | None, chunk_bytes: int | None, traffic: Traffic,
    ) -> Exchange:  # fmt: skip
        """Issue the all-reduce of ``global - local`` for ``fragment`` (asynchronously); what it sends is
        counted in ``traffic`` (by the compressed all-reduce itself, once sent)."""
        local = fragment.local_weights()
        delta = fragment.global_weights - local
        exchange = cls(fragment.index, step, due, delta, local if due > step else None)
        try:
            if compressor is None:
                exchange.work = dist.all_reduce(delta, group=group, async_op=True)
                exchange.divide_by = dist.get_world_size(group)
                dense = ring_bytes(delta.numel(), delta.element_size(), exchange.divide_by)
                traffic.add(dense, dense)
            else:
                extra = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
                exchange.work = all_reduce(delta, compressor, residual=fragment.residual, group=group,
                                           async_op=True, seed=step, traffic=traffic, **extra)  # fmt: skip
                if getattr(compressor, "rescale", False) is True:
                    exchange.scale_of = getattr(compressor, "mean_scale", None)
        except Exception as error:
            raise _failed(fragment.index, error) from error
        return exchange

    def settle(self) -> None:
        """Wait for the all-reduce (the time waited is ``blocked_s``); ``mean`` is then the mean (a sparse one
        rescaled by ``scale_of``, the mean number of ranks that sent an entry divided out)."""
        if self.work is None:
            return
        begin = time.perf_counter()
        try:
            self.work.wait()
        except Exception as error:
            raise _failed(self.fragment, error) from error
        self.blocked_s = time.perf_counter() - begin
        self.work = None
        if self.divide_by > 1:
            self.mean.div_(self.divide_by)
        if self.scale_of is not None:
            self.mean.mul_(self.scale_of(self.mean))

    def state_dict(self) -> dict[str, object]:
        """The settled exchange (a checkpoint never holds one in flight)."""
        self.settle()
        return {"fragment": self.fragment, "issued": self.issued, "due": self.due, "mean": self.mean.clone(),
                "sent_local": None if self.sent_local is None else self.sent_local.clone()}

    @classmethod
    def from_state_dict(cls, state: dict[str, object]) -> Exchange:
        """An exchange restored settled from :meth:`state_dict`."""
        mean, sent = state["mean"], state["sent_local"]
        assert isinstance(mean, Tensor) and (sent is None or isinstance(sent, Tensor))
        return cls(int(state["fragment"]), int(state["issued"]), int(state["due"]), mean.clone(),  # type: ignore[arg-type]
                   None if sent is None else sent.clone())  # fmt: skip


def _failed(fragment: int, error: Exception) -> PeerCollectiveError:
    """The error of fragment ``fragment``'s failed all-reduce: it names the fragment, and the collective that
    failed where one was named (the lane's barrier, a phase of the compressed exchange)."""
    where = f"DiLoCo fragment {fragment} all-reduce"
    if isinstance(error, PeerCollectiveError):
        return PeerCollectiveError(f"{where} ({error.where})", None, error.reason)
    return PeerCollectiveError(where, None, error)
