"""The "auto" hook: per bucket, the exchange a cost model says is fastest here, or plain allreduce.

``fastcomm.register(ddp, "auto")`` runs dense allreduce for ``warmup_steps`` steps, then measures, from the
hook call of bucket 0 (so every rank does it at the same point):

1. The link: two timed allreduces of probe tensors (small and large) give its latency and bandwidth.
2. Each candidate's compression and decoding on the buckets' device (:func:`fastcomm.advise.measure_rates`
   of the candidates' kernels on as many elements as the largest bucket, up to 16M: on a small tensor, in
   a CPU's cache, they ran 1.5x faster and made compression look cheaper than it is).

The slowest rank's figures are agreed on by one allreduce (MAX of times), so every rank makes the same
choice. Each bucket size then gets the candidate of least predicted time (``fastcomm.advise``'s model of
its collectives plus its compression), or dense allreduce unless a candidate is predicted at least
``margin`` faster. The model predicts; the clock checks: 3 trial steps under the choice, then 3 dense
steps at the same point of the job (not the warm-up's, which still hold its start-up work); if the trial's
median step time is above the dense steps' (the last two: the first pays what compression owed), on the
slowest rank's clock, every bucket stays dense until the next measurement, so auto is never the reason a
job got slower for more than its trial. The choice is made again every ``recheck_every`` steps.

All candidates go through one two-phase exchange with error feedback and one bucket store, segments of
the same length (whole blocks of every candidate), so what a bucket owes under one method is owed under
the next; a bucket that goes dense sends what it owes with its allreduce. By default only methods at loss
parity under any optimizer are candidates: bf16 cast, 8-bit and 4-bit quantization (sign needs
:class:`fastcomm.CompressedAdam`).

Candidates are named as the advisor names its methods (``fastcomm.advise.methods``, from
:func:`fastcomm.compress.registry.label`): ``"cast_bf16_two_phase"``, ``"quantize8"``, ``"quantize4"``,
``"sign"``; so are the ``stats()`` keys (``auto_quantize8_buckets``). The old names (``"cast16"``,
``"quant8"``, ``"quant4"``) still work for one release, with a ``DeprecationWarning`` naming the new one.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real types.
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.advise.kernels import KernelRates, measure_rates
from fastcomm.advise.methods import METHODS, Method, codec_kernels, method_cost, method_of
from fastcomm.advise.model import Link, Topology
from fastcomm.collectives import segment_layout
from fastcomm.collectives.two_phase import TwoPhaseLayout
from fastcomm.hooks.engine.compression import run_compressed
from fastcomm.hooks.engine.options import require_int, require_real
from fastcomm.hooks.engine.twophase import TwoPhaseState, two_phase_bucket

__all__ = ["CANDIDATES", "DEFAULT_CANDIDATES", "AutoState", "auto_hook", "choose", "measured_figures"]

_TRIAL_STEPS = 3  # steps under a new choice, then as many dense ones, before their times are compared

# candidate name -> the advisor's method (its compressor): the two-phase ones, the exchange auto runs
CANDIDATES: dict[str, Method] = {m.name: m for m in METHODS if m.exchange == "two_phase"}
# the candidates by default: those at loss parity under any optimizer
DEFAULT_CANDIDATES = ("cast_bf16_two_phase", "quantize8", "quantize4")
_PROBE_NUMELS = (1024, 1 << 20)
# kernels are timed on as many elements as the largest bucket seen, within these bounds (64 MB of fp32 at
# the most: DDP's 25 MB buckets and the hooks' residuals and codes beside them are past a CPU's L3 slice)
_RATE_NUMELS = (1 << 16, 1 << 24)


def choose(numel: int, world_size: int, link: Link, rates: KernelRates, candidates: tuple[str, ...],
           margin: float) -> str:  # fmt: skip
    """The candidate predicted fastest for a bucket of ``numel`` fp32 gradients, or ``"dense"``.

    A candidate is chosen only when its predicted time (collectives and compression) is below
    ``(1 - margin)`` of a dense ring allreduce's.

    Example::

        choose(25_000_000, 2, Link(1e-4, 1.2e8), rates, ("quantize8",), 0.05)   # "quantize8" on 1 Gbit/s
    """
    topology = Topology(world_size, 1, inter=link, intra=link)

    def seconds(method: Method) -> float:
        cost = method_cost(method, topology, numel, 1, rates, [])
        return sum(t.seconds for t in cost.transfers) + cost.codec_s

    dense = seconds(METHODS[0])
    best, best_s = "dense", dense * (1.0 - margin)
    for name in _candidates(candidates):
        predicted = seconds(CANDIDATES[name])
        if predicted < best_s:
            best, best_s = name, predicted
    return best


class AutoState(TwoPhaseState):
    """State of :func:`auto_hook`: the candidates, the measured link and rates, each bucket size's choice.

    Args:
        candidates: names of :data:`CANDIDATES` to choose among (besides dense allreduce); an old name
            (``"quant8"``) warns (``DeprecationWarning``) and is replaced by its new one.
        warmup_steps: dense steps before the first measurement (their step times are the baseline).
        recheck_every: steps between measurements after the first.
        margin: how much faster a candidate must be predicted than dense to be chosen.
        link: a :class:`~fastcomm.advise.model.Link` to use instead of measuring one (tests, or a link
            you know).
        **options: the :class:`~fastcomm.hooks.engine.twophase.TwoPhaseState` options (``error_feedback``,
            ``min_compress_numel``, ``wire_chunk_bytes``, ``overlap_phase2``, ``process_group``).

    Example::

        state = fastcomm.register(ddp, "auto")
        ...
        print(state.choices)                   # {bucket numel: "quantize8" or "dense", ...}
        print(state.stats()["auto_quantize8_buckets"])
    """

    _OPTIONS = ("candidates", "warmup_steps", "recheck_every", "margin", "link", *TwoPhaseState._OPTIONS)
    dense_takes_segment = True

    def __init__(
        self,
        candidates: tuple[str, ...] = DEFAULT_CANDIDATES,
        warmup_steps: int = 4,
        recheck_every: int = 500,
        margin: float = 0.1,
        link: Link | None = None,
        **options: Any,
    ) -> None:
        self.candidates = _candidates(candidates)
        self.warmup_steps = require_int("warmup_steps", warmup_steps, minimum=0)
        self.recheck_every = require_int("recheck_every", recheck_every, minimum=1)
        self.margin = require_real("margin", margin)
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        if link is not None and not isinstance(link, Link):
            raise ValueError(f"link must be a fastcomm.advise.model.Link or None, got {link!r}")
        self.link = link
        # segments of whole blocks of every candidate: a switch keeps each rank's segment and its residual
        self._compressors = {c: CANDIDATES[c].build_compressor() for c in self.candidates}
        self._unit = math.lcm(8, *(c.block for c in self._compressors.values()))
        super().__init__(**options)

    def _reset_internal(self) -> None:
        super()._reset_internal()
        self.measured: tuple[Link, KernelRates] | None = None
        self.choices: dict[int, str] = {}
        self._measured_at = -1
        self._iteration_start: float | None = None
        self._largest = 0  # the largest bucket seen (elements): the kernels are timed at its size
        # After a measurement: "chosen" (trial steps under the choice), then "dense" (as many dense steps),
        # then "settled". The step periods (seconds) of each; whether the choice was found slower than dense
        # (then every bucket is dense until the next measurement).
        self._phase = "settled"
        self._periods: dict[str, list[float]] = {"dense": [], "chosen": []}
        self.reverted = False
        self.trial_medians: tuple[float, float] | None = None  # (chosen, dense): the last judged trial's

    def begin_bucket(self, bucket: dist.GradBucket) -> Any:
        key = super().begin_bucket(bucket)
        self._largest = max(self._largest, bucket.buffer().numel())
        if bucket.index() != 0 or dist.get_world_size(self.process_group) == 1:
            return key
        steps = self.accounting.steps
        if self._iteration_start is not None and self._phase != "settled":
            self._periods[self._phase].append(time.perf_counter() - self._iteration_start)
        due = steps >= self.warmup_steps and (
            self._measured_at < 0 or steps - self._measured_at >= self.recheck_every
        )
        if due:
            self.measured = measured_figures(
                self.link, bucket.buffer().device.type, self.candidates, self._largest, self.process_group
            )
            self.choices, self.reverted, self._measured_at = {}, False, steps
            self._phase, self._periods = "chosen", {"dense": [], "chosen": []}
        elif self._phase == "chosen" and self._any_choice() == "dense":
            self._phase = "settled"  # every bucket size chose dense: nothing to try
        elif self._phase == "chosen" and len(self._periods["chosen"]) == _TRIAL_STEPS:
            self._phase = "dense"
        elif self._phase == "dense" and len(self._periods["dense"]) == _TRIAL_STEPS:
            medians = _trial_medians(self._periods, self.process_group, bucket.buffer().device)
            self._phase, self.trial_medians = "settled", medians
            self.reverted = self.trial_medians[0] > self.trial_medians[1]
        self._iteration_start = time.perf_counter()  # the probes and the judgement are not the model's time
        return key

    def _any_choice(self) -> str:
        return next((c for c in self.choices.values() if c != "dense"), "dense")

    def choice(self, numel: int) -> str:
        """The method of a bucket of ``numel`` elements at this step (``"dense"`` before the measurement,
        during the dense steps that follow a trial, and after a trial found the chosen methods slower than
        dense, until the next measurement)."""
        if self.measured is None or not self.candidates or self.reverted or self._phase == "dense":
            return "dense"
        if numel not in self.choices:
            link, rates = self.measured
            world_size = dist.get_world_size(self.process_group)
            self.choices[numel] = choose(numel, world_size, link, rates, self.candidates, self.margin)
        return self.choices[numel]

    def use_compression(self, numel: int) -> bool:
        return super().use_compression(numel) and self.choice(numel) != "dense"

    def layout(self, numel: int, world_size: int) -> TwoPhaseLayout:
        """The chosen candidate's compressor over segments of whole blocks of every candidate, so a switch
        keeps each rank's segment and its phase-2 residual."""
        compressor = self._compressors[self.choice(numel)]
        return TwoPhaseLayout(compressor, segment_layout(numel, world_size, self._unit), self._unit)

    def stats(self) -> dict[str, float | int]:
        """:meth:`HookState.stats`, how many bucket sizes each method got (``auto_<method>_buckets``, the
        sizes themselves in :attr:`choices`) and the measured link (``auto_link_*``), all numbers."""
        stats = dict(super().stats())
        for method in ("dense", *self.candidates):
            stats[f"auto_{method}_buckets"] = sum(1 for chosen in self.choices.values() if chosen == method)
        stats["auto_reverted"] = int(self.reverted)
        chosen, dense = self.trial_medians or (0.0, 0.0)  # the last judged trial (0: none yet)
        stats["auto_trial_chosen_step_s"], stats["auto_trial_dense_step_s"] = chosen, dense
        if self.measured is not None:
            stats["auto_link_latency_s"] = self.measured[0].alpha_s
            stats["auto_link_bytes_per_second"] = self.measured[0].bandwidth_Bps
        return stats


def _candidates(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` as :data:`CANDIDATES`' names (an old one warns, at the code that built the state).

    Raises:
        ValueError: a single string, or a name that is not a candidate, listing the candidates.
    """
    if isinstance(names, str):
        raise ValueError(f"candidates must be a tuple of names among {sorted(CANDIDATES)}, got {names!r}")
    try:
        # stacklevel 4: method_of -> _candidates -> AutoState.__init__ or choose -> their caller
        return tuple(method_of(name, tuple(CANDIDATES.values()), stacklevel=4).name for name in names)
    except ValueError as error:
        raise ValueError(f"candidates: {error}") from error


def measured_figures(link: Link | None, device: str, candidates: tuple[str, ...], largest: int,
                     group: dist.ProcessGroup | None) -> tuple[Link, KernelRates]:  # fmt: skip
    """What :func:`choose` decides from, the same on every rank of ``group``: ``link`` (or one probed on
    ``group``: two timed allreduces) and the ``candidates``' kernels timed here on ``device`` at ``largest``
    elements, each the slowest rank's (one MAX allreduce). A collective on ``group``: every rank calls it
    at the same point. Its tensors are on ``device`` (a ``ProcessGroupNCCL`` takes CUDA tensors only).

    Example::

        link, rates = measured_figures(None, "cpu", ("quantize8",), 1 << 20, group)
        choose(1 << 20, group.size(), link, rates, ("quantize8",), 0.1)      # the same on every rank
    """
    return _agreed(
        link or _probe_link(group, device), _local_rates(device, candidates, largest), group, device
    )


def _probe_link(group: dist.ProcessGroup | None, device: str = "cpu") -> Link:
    """Latency and bandwidth from two timed ring allreduces (a small and a large probe on ``device``), best
    of three."""
    world_size = dist.get_world_size(group)
    times = []
    for numel in _PROBE_NUMELS:
        probe = torch.ones(numel, device=device)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            dist.all_reduce(probe, group=group)
            if probe.is_cuda:  # NCCL's wait blocks the stream, not this thread
                torch.cuda.synchronize(probe.device)
            best = min(best, time.perf_counter() - start)
        times.append(best)
    steps = 2 * (world_size - 1)
    small_bytes, large_bytes = (4 * n * steps / world_size for n in _PROBE_NUMELS)
    per_byte = max((times[1] - times[0]) / (large_bytes - small_bytes), 1e-12)
    alpha = max(0.0, (times[0] - small_bytes * per_byte) / steps)
    return Link(alpha, 1.0 / per_byte, name="measured")


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def _trial_medians(
    periods: dict[str, list[float]], group: dist.ProcessGroup | None, device: str | torch.device = "cpu"
) -> tuple[float, float]:
    """The median step period of the trial steps under the choice and of the dense steps that followed
    them, on the slowest rank's clock (one MAX allreduce: every rank judges alike). The first dense step
    is left out: it pays what the compressed steps owed. The model predicts; this checks: the choice is
    kept only if its median is not above dense's, so auto is never the reason a job got slower for more
    than its trial steps."""
    medians = torch.tensor(
        [_median(periods["chosen"]), _median(periods["dense"][1:] or periods["dense"])],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    return float(medians[0]), float(medians[1])


def _local_rates(device: str, candidates: tuple[str, ...], largest: int) -> KernelRates:
    """The candidates' compression kernels timed on ``device`` at the largest bucket's size, within
    :data:`_RATE_NUMELS` (every rank measures the same keys; the slowest rank's figures are agreed on)."""
    kernels = tuple(dict.fromkeys(k for name in candidates for k in codec_kernels(CANDIDATES[name])))
    low, high = _RATE_NUMELS
    return measure_rates(device, numel=min(max(largest, low), high), repeat=3, kernels=kernels)


def _agreed(
    link: Link, rates: KernelRates, group: dist.ProcessGroup | None, device: str = "cpu"
) -> tuple[Link, KernelRates]:
    """The slowest rank's link and kernel figures (MAX of times over ranks, a tensor on ``device``): every
    rank chooses alike."""
    keys = sorted(rates.rates)
    times = torch.tensor(
        [link.alpha_s, 1.0 / link.bandwidth_Bps, 1.0 / rates.sparse_entries_per_s]
        + [1.0 / rates.rates[k] for k in keys],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    values = times.tolist()
    agreed_link = Link(values[0], 1.0 / values[1], link.overlaps_compute, link.name)
    agreed = KernelRates({k: 1.0 / v for k, v in zip(keys, values[3:], strict=True)}, 1.0 / values[2],
                         rates.device, rates.threads, "measured, slowest rank")  # fmt: skip
    return agreed_link, agreed


def auto_hook(state: AutoState | None, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: each bucket through the method :class:`AutoState` chose for its size.

    1. Dense allreduce during ``warmup_steps``, and for buckets whose choice is ``"dense"`` (with what the
       bucket still owes from compressed steps, both phases' residuals).
    2. Otherwise the two-phase exchange with the chosen compressor, error feedback on both phases.

    Example::

        state = fastcomm.register(ddp, "auto", recheck_every=200)
    """
    return run_compressed(state, bucket, AutoState, two_phase_bucket)
