"""What every hook state shares: step accounting, per-parameter bucket state, statistics, checkpoints.

DDP calls a comm hook once per bucket, in bucket-index order, on every rank. The classes here turn that
stream of calls into iterations and keep the per-bucket tensors (error-feedback residuals, DGC velocity)
consistent across three things that PyTorch's own hooks trip over:

* **Bucket rebuilds.** DDP regroups its parameters into new buckets after the first iteration. Bucket
  state is keyed by the parameters a bucket holds (each parameter gets an integer key, in the order the
  state first sees it), and a bucket never seen before inherits every slice its parameters had in their old
  buckets. Compression can therefore start at step 0.
* **Skipped steps.** A hook's output is identical on every rank, so whether it holds inf/NaN is a decision
  all ranks agree on without another collective. Tensors a hook updates are *staged* and committed only when
  the next iteration starts (or ``stats()``/``state_dict()`` is called); if any bucket of the iteration was
  non-finite (GradScaler will skip that step), the staged tensors are dropped and the step is not counted.
* **One state per model.** A state remembers the parameters it serves; handing it to a second model is an
  error. A hook registered with ``state=None`` gets a default state per model (see :func:`resolve_state`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from fastcomm.hooks._errors import collective_value
from fastcomm.hooks._options import OptionTypeError, require_bool, require_int
from fastcomm.hooks._wire import DEFAULT_CHUNK_BYTES

__all__ = [
    "CompressedCall",
    "CompressionState",
    "HookState",
    "PendingPhase",
    "all_finite",
    "begin_compressed",
    "default_state",
    "resolve_state",
]

BucketKey = tuple[int, ...]


@dataclass
class _BucketEntry:
    """State of one bucket layout: which parameters, in what order, and its tensors.

    ``tensors`` holds bucket-layout tensors (one element per gradient element, e.g. ``"residual"``,
    ``"velocity"``) and at most one segment tensor, ``"server_residual"``: the phase-2 residual of the part
    ``[segment_start, segment_start + len)`` of the bucket that this rank reduces in two-phase hooks.
    """

    numels: tuple[int, ...]
    world_size: int
    segment_start: int = 0
    tensors: dict[str, Tensor] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(self.numels)


def world_of(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group`` (the default group when ``None``)."""
    return dist.get_world_size(group), dist.get_rank(group)


def ring_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``numel`` elements: ``2 (W - 1) / W`` of the tensor."""
    return 2 * (world_size - 1) * numel * element_size // world_size


# all_gather_into_tensor was renamed all_gather_single; use whichever this torch has, without a warning.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_finite(tensor: Tensor) -> Tensor | bool:
    """Whether every element is finite, by one min/max pass (NaN propagates into both, inf into one).

    ``torch.isfinite(t).all()`` allocates a mask and makes several passes: tens of times slower on CPU.
    """
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor.reshape(-1))
    return bool(torch.isfinite(low) & torch.isfinite(high))


def completed(tensor: Tensor) -> torch.futures.Future[Tensor]:
    """A future that already holds ``tensor``."""
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


class HookState:
    """Base of every hook state: process group, iteration and step accounting, statistics, pickling.

    Subclasses list their user-facing options in ``_OPTIONS`` (constructor keyword names); those, not the
    process group, are what pickling keeps.

    Args:
        process_group: the group to reduce over; ``None`` for the default group.

    Example::

        state = fastcomm.CastState(torch.bfloat16)
        restored = pickle.loads(pickle.dumps(state))  # same options and counters, default process group
    """

    _OPTIONS: tuple[str, ...] = ()

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise OptionTypeError(
                f"process_group must be None or a torch.distributed.ProcessGroup, got {process_group!r} "
                f"({type(process_group).__name__})"
            )
        self.process_group = process_group
        self._reset_internal()

    def _reset_internal(self) -> None:
        # parameters: identity -> integer key, in first-seen order; the model bound by register()
        self._param_keys: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._next_param_key = 0
        self._bound_params: WeakIdKeyDictionary | None = None
        self._iterations_seen = 0
        # the open iteration: staged tensors and whether its output held inf/NaN
        self._iteration_open = False
        self._iteration_nonfinite = False
        self._staged: dict[tuple[BucketKey, str], Tensor] = {}
        # statistics (updated from DDP's hook thread, gloo's callback threads and the phase-2 thread)
        self._stats_lock = threading.Lock()
        self._steps = 0
        self._skipped_steps = 0
        self._bytes_sent = 0
        self._dense_bytes = 0
        self._compress_seconds = 0.0
        self._compressed_buckets = 0
        self._dense_buckets = 0

    # ------------------------------------------------------------------------------------------ options
    def options(self) -> dict[str, Any]:
        """The constructor options this state was made with (without the process group)."""
        return {name: getattr(self, name) for name in self._OPTIONS}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({fields})"

    # ------------------------------------------------------------------------------------------ binding
    def bind(self, module: torch.nn.Module) -> None:
        """Tie this state to the parameters of ``module`` (``register()`` does this).

        Raises:
            ValueError: the state already serves another model.
        """
        params = [p for p in module.parameters() if p.requires_grad]
        if self._bound_params is not None:
            if all(p in self._bound_params for p in params):
                return
            raise ValueError(
                f"this {type(self).__name__} is already registered on another model; a state holds "
                f"per-bucket residuals and a step counter for one model, so create one state per DDP model"
            )
        if len(self._param_keys) and not all(p in self._param_keys for p in params):
            raise ValueError(f"this {type(self).__name__} has already served another model's buckets")
        self._bound_params = WeakIdKeyDictionary({p: True for p in params})

    def _bucket_key(self, bucket: dist.GradBucket) -> BucketKey:
        keys = []
        for param in bucket.parameters():
            key = self._param_keys.get(param)
            if key is None:
                foreign = (self._bound_params is not None and param not in self._bound_params) or (
                    self._bound_params is None and self._iterations_seen > 1
                )
                if foreign:
                    raise ValueError(
                        f"{type(self).__name__} got a bucket with parameters of another model: a state is "
                        f"registered on two models. Create one state per DDP model."
                    )
                key = self._next_param_key
                self._param_keys[param] = key
                self._next_param_key += 1
            keys.append(key)
        return tuple(keys)

    # --------------------------------------------------------------------------------------- iterations
    def _begin_bucket(self, bucket: dist.GradBucket) -> BucketKey:
        """Start of a hook call: a new iteration at bucket 0, then the bucket's parameter key."""
        if bucket.index() == 0:
            self._finish_iteration()
            self._iteration_open = True
            self._iterations_seen += 1
        return self._bucket_key(bucket)

    def _finish_iteration(self) -> None:
        """Commit the staged tensors and count the step, or drop them if the iteration was non-finite."""
        if not self._iteration_open:
            return
        if self._iteration_nonfinite:
            self._skipped_steps += 1
        else:
            self._steps += 1
            self._commit(self._staged)
        self._staged = {}
        self._iteration_open = False
        self._iteration_nonfinite = False

    def _commit(self, staged: dict[tuple[BucketKey, str], Tensor]) -> None:
        """Make staged tensors current (subclasses that stage tensors override this)."""

    def _note_output(self, finite: bool | Tensor) -> None:
        """Record whether a bucket's (rank-identical) result was finite."""
        if not bool(finite):
            self._iteration_nonfinite = True

    def _count(self, bytes_sent: int, dense_bytes: int, seconds: float, compressed: bool) -> None:
        with self._stats_lock:
            self._bytes_sent += bytes_sent
            self._dense_bytes += dense_bytes
            self._compress_seconds += seconds
            if compressed:
                self._compressed_buckets += 1
            else:
                self._dense_buckets += 1

    def _add_seconds(self, seconds: float) -> None:
        """Add compression time measured on another thread (a collective's callback)."""
        with self._stats_lock:
            self._compress_seconds += seconds

    def _dense_allreduce(self, buffer: Tensor, world_size: int, bucket: int) -> torch.futures.Future[Tensor]:
        """Mean over ranks by one async allreduce (divided first, so fp16 cannot overflow in the sum)."""
        tensor = buffer.div_(world_size)
        work = dist.all_reduce(tensor, group=self.process_group, async_op=True)
        self._count(
            ring_bytes(tensor.numel(), tensor.element_size(), world_size),
            ring_bytes(tensor.numel(), tensor.element_size(), world_size),
            0.0,
            compressed=False,
        )

        def finish(future: torch.futures.Future[list[Tensor]]) -> Tensor:
            result = collective_value(future, f"{type(self).__name__} dense allreduce", bucket)[0]
            self._note_output(all_finite(result))
            return result

        return work.get_future().then(finish)

    def _local(self, buffer: Tensor) -> torch.futures.Future[Tensor]:
        """World size 1: the gradient is already the mean; only the step accounting runs."""
        self._note_output(all_finite(buffer))
        self._count(0, 0, 0.0, compressed=False)
        return completed(buffer)

    # ------------------------------------------------------------------------------------------- public
    @property
    def steps(self) -> int:
        """Optimizer steps really taken (iterations whose reduced gradients were all finite)."""
        self._finish_iteration()
        return self._steps

    def stats(self) -> dict[str, float | int]:
        """Counters since construction (or since the checkpoint they were restored from).

        Returns:
            A dict with ``steps`` (finite iterations), ``skipped_steps`` (iterations with inf/NaN, which
            GradScaler skips), ``bytes_sent`` (bytes this rank put on the wire: ``(W-1)/W`` of an
            all-to-all's send buffer, ``W-1`` times an all-gather's payload, a ring allreduce's
            ``2(W-1)/W``), ``dense_bytes`` (what a ring allreduce of the same buckets in their own dtype
            would have sent), ``compression_ratio`` (``dense_bytes / bytes_sent``, 1.0 when nothing was
            sent), ``compress_seconds`` (time in compression and decompression, not in collectives),
            ``compressed_buckets`` and ``dense_buckets`` (hook calls of each kind).

        Example::

            stats = state.stats()
            print(f"{stats['compression_ratio']:.1f}x less traffic, {stats['skipped_steps']} steps skipped")
        """
        self._finish_iteration()
        ratio = self._dense_bytes / self._bytes_sent if self._bytes_sent else 1.0
        return {
            "steps": self._steps,
            "skipped_steps": self._skipped_steps,
            "bytes_sent": self._bytes_sent,
            "dense_bytes": self._dense_bytes,
            "compression_ratio": ratio,
            "compress_seconds": self._compress_seconds,
            "compressed_buckets": self._compressed_buckets,
            "dense_buckets": self._dense_buckets,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically, without the process group.

        Parameters are identified by the order in which this state first saw them, which is the same in a
        fresh process for the same model and DDP configuration. Compression works per bucket, so gradients
        after a restore are bit-identical when the restored DDP's bucket layout equals the one the checkpoint
        was taken with: a fresh DDP uses its initial layout for its first iteration and rebuilds after it
        (with ``find_unused_parameters=True`` it keeps one layout throughout). Residuals themselves move to
        any new layout, so nothing owed is lost either way.

        Returns:
            A dict of plain Python values and CPU-clonable tensors, for ``torch.save``.

        Example::

            torch.save({"model": model.state_dict(), "comm": state.state_dict()}, path)
            ...
            state = fastcomm.register(ddp, "topk", ratio=0.01)
            state.load_state_dict(torch.load(path)["comm"])
        """
        self._finish_iteration()
        return {
            "type": type(self).__name__,
            "options": self.options(),
            "steps": self._steps,
            "skipped_steps": self._skipped_steps,
            "bytes_sent": self._bytes_sent,
            "dense_bytes": self._dense_bytes,
            "compress_seconds": self._compress_seconds,
            "compressed_buckets": self._compressed_buckets,
            "dense_buckets": self._dense_buckets,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (counters and per-bucket tensors; options stay as built).

        Raises:
            ValueError: the dict comes from another kind of state.
        """
        if state_dict.get("type") != type(self).__name__:
            raise ValueError(f"state_dict is for {state_dict.get('type')!r}, not {type(self).__name__}")
        self._finish_iteration()
        self._steps = int(state_dict["steps"])
        self._skipped_steps = int(state_dict["skipped_steps"])
        self._bytes_sent = int(state_dict["bytes_sent"])
        self._dense_bytes = int(state_dict["dense_bytes"])
        self._compress_seconds = float(state_dict["compress_seconds"])
        self._compressed_buckets = int(state_dict["compressed_buckets"])
        self._dense_buckets = int(state_dict["dense_buckets"])

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options(), "state_dict": self.state_dict()}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self.__init__(**pickled["options"])  # type: ignore[misc]
        self.load_state_dict(pickled["state_dict"])


class CompressionState(HookState):
    """Options and per-bucket state shared by the compressing hooks (top-k, quantized, sign).

    Args:
        error_feedback: keep what compression dropped, per bucket, and add it to the next gradient.
        start_iter: plain (dense) allreduce for the first ``start_iter`` steps.
        min_compress_numel: buckets with fewer elements go dense.
        wire_chunk_bytes: each collective is issued as back-to-back chunks of about this many bytes per
            peer (at most 64 chunks): gloo keeps a TCP link busy only with several transfers in flight (on
            a 1 Gbit/s link one 8 MB all-to-all moved 61 MB/s each way, 16 chunks 115 MB/s).
        process_group: the group to reduce over; ``None`` for the default group.

    Example::

        state = fastcomm.register(ddp, "quantize", bits=4, start_iter=10, min_compress_numel=4096)
        owed = state.residual_of(next(ddp.module.parameters()))  # what error feedback still has to send
    """

    _OPTIONS = ("error_feedback", "start_iter", "min_compress_numel", "wire_chunk_bytes")

    def __init__(
        self,
        *,
        error_feedback: bool = True,
        start_iter: int = 0,
        min_compress_numel: int = 1024,
        wire_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.error_feedback = require_bool("error_feedback", error_feedback)
        self.wire_chunk_bytes = require_int("wire_chunk_bytes", wire_chunk_bytes, minimum=1)
        self.start_iter = require_int("start_iter", start_iter, minimum=0)
        self.min_compress_numel = require_int("min_compress_numel", min_compress_numel, minimum=0)
        super().__init__(process_group)

    def _reset_internal(self) -> None:
        super()._reset_internal()
        self._buckets: dict[BucketKey, _BucketEntry] = {}
        # parameter key -> (bucket key, offset of the parameter in that bucket)
        self._param_loc: dict[int, tuple[BucketKey, int]] = {}
        # tensors replaced at the last commit, reused as the next staged copies (no allocation per step)
        self._spares: dict[tuple[BucketKey, str], Tensor] = {}
        # a two-phase bucket whose phase 1 is in flight; its phase 2 is issued by the next hook call
        self._pending: PendingPhase | None = None
        # per-bucket buffers (send, receive, results), reused every step: large fresh tensors cost page faults
        self._buffers: dict[tuple[BucketKey, str], Any] = {}

    # -------------------------------------------------------------------------------- per-bucket state
    def _entry(self, key: BucketKey, bucket: dist.GradBucket, world_size: int) -> _BucketEntry:
        """The bucket's entry; a new layout inherits its parameters' slices from their old buckets."""
        entry = self._buckets.get(key)
        if entry is not None:
            return entry
        entry = _BucketEntry(numels=tuple(p.numel() for p in bucket.parameters()), world_size=world_size)
        if entry.numel != bucket.buffer().numel():
            raise RuntimeError(
                f"bucket {bucket.index()} holds {bucket.buffer().numel()} elements but its parameters "
                f"{entry.numel}: fastcomm relies on DDP laying parameters out back to back"
            )
        self._inherit(key, entry)
        self._buckets[key] = entry
        return entry

    def _inherit(self, key: BucketKey, entry: _BucketEntry) -> None:
        """Copy each parameter's slices from the bucket that held it before a DDP bucket rebuild.

        A two-phase hook's phase-2 residual covers only this rank's segment of the old bucket; it is folded
        into this rank's phase-1 residual multiplied by the world size, which keeps the mean over ranks of
        what is still owed unchanged, so error feedback loses nothing across the rebuild.
        """
        sources = []
        offset = 0
        for pkey, numel in zip(key, entry.numels, strict=True):
            location = self._param_loc.get(pkey)
            if location is not None and location[0] in self._buckets:
                sources.append((location[0], location[1], offset, numel))
            self._param_loc[pkey] = (key, offset)
            offset += numel
        for old_key, old_offset, new_offset, numel in sources:
            old = self._buckets[old_key]
            for name, tensor in old.tensors.items():
                if name == "server_residual":
                    continue
                target = entry.tensors.setdefault(name, tensor.new_zeros(entry.numel))
                target[new_offset : new_offset + numel] = tensor[old_offset : old_offset + numel]
            server = old.tensors.get("server_residual")
            if server is not None and "residual" in old.tensors:
                start = max(old_offset, old.segment_start)
                stop = min(old_offset + numel, old.segment_start + server.numel())
                if start < stop:
                    target = entry.tensors["residual"]
                    delta = server[start - old.segment_start : stop - old.segment_start] * old.world_size
                    lo, hi = new_offset + start - old_offset, new_offset + stop - old_offset
                    target[lo:hi] = (target[lo:hi].float() + delta).to(target.dtype)
        for old_key in {source[0] for source in sources}:
            if all(self._param_loc[p][0] != old_key for p in old_key):
                del self._buckets[old_key]
                for buffers in (self._spares, self._buffers):
                    for stale in [k for k in buffers if k[0] == old_key]:
                        del buffers[stale]

    def _current(self, entry: _BucketEntry, name: str, like: Tensor, numel: int | None = None) -> Tensor:
        """The committed tensor ``name`` of a bucket, on ``like``'s device and dtype.

        ``numel`` defaults to ``like.numel()``. A missing tensor, or one of another length, starts as zeros;
        one restored from a checkpoint on another device is moved there.
        """
        numel = like.numel() if numel is None else numel
        tensor = entry.tensors.get(name)
        if tensor is None or tensor.numel() != numel:
            tensor = like.new_zeros(numel)
        elif tensor.dtype != like.dtype or tensor.device != like.device:
            tensor = tensor.to(device=like.device, dtype=like.dtype)
        entry.tensors[name] = tensor
        return tensor

    def _stage(self, key: BucketKey, name: str, tensor: Tensor) -> None:
        """Keep ``tensor`` as the bucket's new ``name`` if this iteration turns out finite."""
        self._staged[(key, name)] = tensor

    def _spare(self, key: BucketKey, name: str, current: Tensor) -> Tensor:
        """An uninitialised buffer like ``current`` (the one it replaced last time) for its successor.

        Ops that read the committed tensor and write the new one in the same pass (``residual_source``)
        stage this buffer instead of copying ``current`` first.
        """
        spare = self._spares.pop((key, name), None)
        if (
            spare is None
            or spare.shape != current.shape
            or spare.dtype != current.dtype
            or spare.device != current.device
            or spare.data_ptr() == current.data_ptr()
        ):
            return torch.empty_like(current)
        return spare

    def _wire_buffer(self, key: BucketKey, name: str, like: Tensor, numel: int) -> Tensor:
        """Bucket ``key``'s buffer ``name`` of ``numel`` elements like ``like``, kept for the next step.

        A hook may reuse it from its next call on the same bucket: by then DDP has waited for every
        collective and callback of the previous iteration.
        """
        buffer = self._buffers.get((key, name))
        wanted = (numel, like.dtype, like.device)
        if not isinstance(buffer, Tensor) or (buffer.numel(), buffer.dtype, buffer.device) != wanted:
            buffer = like.new_empty(numel)
            self._buffers[(key, name)] = buffer
        return buffer

    def _scratch(self, key: BucketKey, device: torch.device) -> Callable[[str, int], Tensor]:
        """``scratch(name, numel)``: bucket ``key``'s reusable uint8 buffers for chunked collectives."""
        like = torch.empty(0, dtype=torch.uint8, device=device)

        def scratch(name: str, numel: int) -> Tensor:
            return self._wire_buffer(key, name, like, numel)

        return scratch

    def _commit(self, staged: dict[tuple[BucketKey, str], Tensor]) -> None:
        for (key, name), tensor in staged.items():
            entry = self._buckets.get(key)
            if entry is not None:
                old = entry.tensors.get(name)
                entry.tensors[name] = tensor
                if old is not None and old.data_ptr() != tensor.data_ptr():
                    self._spares[(key, name)] = old

    def _flush_owed(self, key: BucketKey, bucket: dist.GradBucket, world_size: int, buffer: Tensor) -> Tensor:
        """``buffer`` plus what its parameters still owe from compressed steps, for a bucket that goes dense.

        Only after a bucket rebuild put compressed parameters into a bucket below ``min_compress_numel`` do
        such residuals exist; they are sent with the dense allreduce instead of being stranded.
        """
        if not self.error_feedback or not any(pkey in self._param_loc for pkey in key):
            return buffer
        entry = self._entry(key, bucket, world_size)
        owed = entry.tensors.get("residual")
        if owed is None or not bool(owed.any()):
            return buffer
        self._stage(key, "residual", torch.zeros_like(owed))
        return buffer + owed.to(buffer.dtype)

    def _begin_bucket(self, bucket: dist.GradBucket) -> BucketKey:
        if bucket.index() == 0:
            # a last bucket DDP did not mark: its phase 2 must still go out before the new iteration
            self._flush_pending()
        return super()._begin_bucket(bucket)

    def _flush_pending(self) -> None:
        """Issue the phase 2 of the two-phase bucket whose phase 1 is in flight, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()

    def _use_compression(self, numel: int) -> bool:
        return self._steps >= self.start_iter and numel >= max(1, self.min_compress_numel)

    def scale_residuals(self, factor: float) -> None:
        """Multiply every per-bucket tensor (residuals, velocity) by ``factor``.

        Residuals hold gradients in the units they were computed in. Under AMP those are loss-scaled
        gradients, so when ``GradScaler`` changes its scale the owed gradient must be rescaled with it.

        Args:
            factor: ``new_scale / old_scale``.

        Example::

            old = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() != old:
                state.scale_residuals(scaler.get_scale() / old)
        """
        self._finish_iteration()
        for entry in self._buckets.values():
            for tensor in entry.tensors.values():
                tensor.mul_(factor)

    def residual_of(self, param: Tensor) -> Tensor | None:
        """What this rank still owes for ``param``'s gradient (fp32, shaped like ``param``), or ``None``.

        The mean over ranks of ``residual_of(param)`` plus every gradient the hook has returned equals the
        mean over ranks of the sum of raw gradients: the error-feedback invariant. Two-phase hooks fold
        their phase-2 residual in (times the world size), as on a bucket rebuild.
        """
        self._finish_iteration()
        pkey = self._param_keys.get(param)
        if pkey is None or pkey not in self._param_loc:
            return None
        key, offset = self._param_loc[pkey]
        entry = self._buckets[key]
        numel = param.numel()
        residual = entry.tensors.get("residual")
        out = torch.zeros(numel, dtype=torch.float32, device=None if residual is None else residual.device)
        if residual is not None:
            out += residual[offset : offset + numel].float()
        server = entry.tensors.get("server_residual")
        if server is not None:
            start = max(offset, entry.segment_start)
            stop = min(offset + numel, entry.segment_start + server.numel())
            if start < stop:
                out[start - offset : stop - offset] += (
                    server[start - entry.segment_start : stop - entry.segment_start] * entry.world_size
                )
        return out.view_as(param)

    # ------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["buckets"] = [
            {
                "params": list(key),
                "numels": list(entry.numels),
                "world_size": entry.world_size,
                "segment_start": entry.segment_start,
                "tensors": {name: tensor.clone() for name, tensor in entry.tensors.items()},
            }
            for key, entry in self._buckets.items()
        ]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._buckets = {}
        self._param_loc = {}
        for item in state_dict["buckets"]:
            key = tuple(int(p) for p in item["params"])
            entry = _BucketEntry(
                numels=tuple(int(n) for n in item["numels"]),
                world_size=int(item["world_size"]),
                segment_start=int(item["segment_start"]),
                tensors={name: tensor.clone() for name, tensor in item["tensors"].items()},
            )
            self._buckets[key] = entry
            offset = 0
            for pkey, numel in zip(key, entry.numels, strict=True):
                self._param_loc[pkey] = (key, offset)
                offset += numel


class PendingPhase:
    """A bucket whose first collective is in flight and whose second is issued by a later hook call."""

    def finish(self) -> None:
        """Wait for the first collective, then issue the second (from the hook thread, in bucket order)."""
        raise NotImplementedError


def seed_for(base: int, step: int, key: BucketKey, rank: int, phase: int) -> int:
    """A stochastic-rounding seed unique to (seed option, step, bucket, rank, phase), identical on resume."""
    first = key[0] if key else 0
    mixed = ((((base * 1_000_003 + step) * 65_537 + first) * 4_099 + rank) * 4 + phase) % (2**62)
    return mixed


def segment_layout(numel: int, world_size: int, unit: int) -> int:
    """Length of each rank's segment in two-phase hooks: ``ceil(numel / W)`` rounded up to ``unit``."""
    per_rank = max(1, math.ceil(numel / world_size))
    return math.ceil(per_rank / unit) * unit


class Timer:
    """Accumulates wall time of the compression work of one hook call."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._start


_DEFAULT_STATES: dict[type, WeakIdKeyDictionary] = {}
_LAST_NEW_DEFAULT: dict[type, HookState] = {}


def resolve_state(state: HookState | None, bucket: dist.GradBucket, cls: type) -> HookState:
    """The state to use for a hook call: ``state`` itself, or the per-model default when it is ``None``.

    ``ddp.register_comm_hook(None, hook)`` gives hooks no state, so defaults are found through the bucket's
    parameters: a parameter seen before leads to its model's state. A bucket of unseen parameters is either
    bucket 0 of a model's first iteration (a new default state) or a later bucket of that same first
    iteration (DDP reduces buckets in index order), which joins the state started at bucket 0. Two models
    whose *first* backward passes interleave cannot be told apart this way: use ``fastcomm.register``.
    """
    if state is not None:
        if not isinstance(state, cls):
            raise TypeError(f"this hook needs a {cls.__name__} (or None), got {type(state).__name__}")
        return state
    owners = _DEFAULT_STATES.setdefault(cls, WeakIdKeyDictionary())
    params = bucket.parameters()
    found = next((owners[p] for p in params if p in owners), None)
    if found is None:
        if bucket.index() == 0 or cls not in _LAST_NEW_DEFAULT:
            _LAST_NEW_DEFAULT[cls] = cls()
        found = _LAST_NEW_DEFAULT[cls]
    for param in params:
        owners[param] = found
    return found


@dataclass
class CompressedCall:
    """What a compressing hook works with once :func:`begin_compressed` has decided to compress."""

    state: CompressionState
    key: BucketKey
    entry: _BucketEntry
    flat: Tensor
    world_size: int
    rank: int
    bucket_index: int = 0


def begin_compressed(
    state: CompressionState | None, bucket: dist.GradBucket, cls: type
) -> CompressedCall | torch.futures.Future[Tensor]:
    """The common start of the compressing hooks.

    1. Resolve the state (the per-model default when ``None``) and open the iteration at bucket 0.
    2. World size 1: a completed future holding the gradient as is.
    3. Before ``start_iter`` or below ``min_compress_numel``: the dense allreduce's future (a last bucket
       also issues the phase 2 a two-phase bucket before it still owes).
    4. Otherwise the bucket's state entry and everything the hook needs to compress it.

    Returns:
        A :class:`CompressedCall`, or the future to return as is.
    """
    resolved = resolve_state(state, bucket, cls)
    assert isinstance(resolved, CompressionState)
    key = resolved._begin_bucket(bucket)
    buffer = bucket.buffer()
    world_size, rank = world_of(resolved.process_group)
    if world_size == 1:
        return resolved._local(buffer)
    if not resolved._use_compression(buffer.numel()):
        owed = resolved._flush_owed(key, bucket, world_size, buffer)
        future = resolved._dense_allreduce(owed, world_size, bucket.index())
        if bucket.is_last():
            resolved._flush_pending()
        return future
    entry = resolved._entry(key, bucket, world_size)
    return CompressedCall(resolved, key, entry, buffer.reshape(-1), world_size, rank, bucket.index())


def default_state(model: torch.nn.Module, cls: type) -> HookState | None:
    """The state a hook registered with ``state=None`` made for ``model`` (a DDP model or its module).

    Args:
        model: the DDP model, or the module it wraps.
        cls: the hook's state class, e.g. ``fastcomm.TopKState``.

    Returns:
        The state, or ``None`` before the hook first ran for this model.

    Example::

        ddp.register_comm_hook(None, fastcomm.topk_hook)
        ...  # after a backward pass
        print(fastcomm.hooks.default_state(ddp, fastcomm.TopKState).stats())
    """
    module = getattr(model, "module", model)
    owners = _DEFAULT_STATES.get(cls)
    if owners is None:
        return None
    return next((owners[p] for p in module.parameters() if p in owners), None)
