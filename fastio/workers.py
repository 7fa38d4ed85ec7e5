"""The two ways a :class:`fastio.StreamLoader` makes batches ahead of its consumer.

* :class:`ThreadPipeline`: threads call the producer; the native gather releases the GIL, so threads are
  the fast path for shards and tar members. Batches land in the producer's ring of reused buffers.
* :class:`ProcessPipeline`: forked processes call the producer (for Python transforms, collates and
  Datasets that hold the GIL). Each process writes the tensors of its batch into a ring slot that is a
  plain file in a private temp directory (``$FASTIO_WORKER_DIR`` or the system temp dir, never ``/dev/shm``),
  mapped shared by both sides; only a small description (offsets, dtypes, shapes, and non-tensor leaves
  such as keys) goes through a pipe. Tensors are never pickled.

Both hand out batch ``j`` only in order, keep at most ``slots`` batches in flight, and refill slot
``j % slots`` only after the consumer has asked for batch ``j - slots + 1``: a yielded batch stays valid
until the next one is requested. An exception in a worker is re-raised in the consumer; a worker that dies
raises ``RuntimeError`` (never a hang).

Example::

    pipeline = ThreadPipeline(produce, n_batches=100, num_workers=2, slots=4)
    ok, (batch, size) = pipeline.get(0)
    pipeline.stop()
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch

__all__ = ["ProcessPipeline", "ThreadPipeline"]

_ALIGN = 64


class ThreadPipeline:
    """Worker threads running ``produce(job)`` ahead of the consumer (see the module docstring).

    Example::

        pipeline = ThreadPipeline(lambda j: (j, 1), n_batches=3, num_workers=2, slots=2)
        assert pipeline.get(0) == (True, (0, 1))
    """

    def __init__(self, produce: Callable[[int], Any], n_batches: int, num_workers: int, slots: int) -> None:
        self.produce, self.n_batches, self.slots = produce, n_batches, slots
        self.cond = threading.Condition()
        self.next_job = 0
        self.released = 0
        self.results: dict[int, tuple[bool, Any]] = {}
        self.stopped = False
        self.threads = [
            threading.Thread(target=self._work, name=f"fastio-worker-{w}", daemon=True)
            for w in range(num_workers)
        ]
        for t in self.threads:
            t.start()

    def _work(self) -> None:
        while True:
            with self.cond:
                while (
                    not self.stopped
                    and self.next_job < self.n_batches
                    and self.next_job >= self.released + self.slots
                ):
                    self.cond.wait()
                if self.stopped or self.next_job >= self.n_batches:
                    return
                job = self.next_job
                self.next_job += 1
            try:
                result = (True, self.produce(job))
            except BaseException as exc:  # handed to the consumer, which re-raises it
                result = (False, exc)
            with self.cond:
                self.results[job] = result
                self.cond.notify_all()

    def get(self, job: int) -> tuple[bool, Any]:
        """``(True, produce(job))`` or ``(False, exception)``; blocks until batch ``job`` is made."""
        with self.cond:
            self.released = job  # the consumer moved past job - 1: its slot may be refilled
            self.cond.notify_all()
            while job not in self.results:
                if not any(t.is_alive() for t in self.threads):
                    return False, RuntimeError(f"fastio: worker threads exited before batch {job}")
                self.cond.wait(timeout=1.0)
            return self.results.pop(job)

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class _TensorRef:
    """Where a tensor of a batch lies in its slot file."""

    __slots__ = ("dtype", "nbytes", "offset", "shape")

    def __init__(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.offset, self.nbytes, self.dtype, self.shape = offset, nbytes, dtype, shape


def _collect(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _TensorRef(-1, 0, value.dtype, tuple(value.shape))
    if isinstance(value, dict):
        return {k: _collect(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_collect(v, tensors) for v in value)
    return value


def _rebuild(value: Any, region: mmap.mmap) -> Any:
    if isinstance(value, _TensorRef):
        if value.nbytes == 0:
            return torch.empty(value.shape, dtype=value.dtype)
        flat = torch.frombuffer(region, dtype=torch.uint8, count=value.nbytes, offset=value.offset)
        return flat.view(value.dtype).view(value.shape)
    if isinstance(value, dict):
        return {k: _rebuild(v, region) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, region) for v in value)
    return value


class _SlotFile:
    """One ring slot: a file both processes map shared; the writer grows it when a batch needs more."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = 0
        self.region: mmap.mmap | None = None

    def ensure(self, nbytes: int, grow: bool) -> mmap.mmap:
        if grow and nbytes > os.path.getsize(self.path):
            os.truncate(self.path, max(nbytes, 1) * 5 // 4 + _ALIGN)
        actual = os.path.getsize(self.path)
        if self.region is None or self.size != actual:
            if self.region is not None:
                try:
                    self.region.close()
                except BufferError:
                    pass  # tensors of an earlier batch still view it; it is unmapped when they are freed
            with open(self.path, "r+b") as fh:
                self.region = mmap.mmap(fh.fileno(), actual, access=mmap.ACCESS_WRITE)
            self.size = actual
        return self.region


def _worker_main(produce: Callable[[int], Any], conn: Any, slot_paths: list[str], times: Any) -> None:
    torch.set_num_threads(1)
    slots = [_SlotFile(p) for p in slot_paths]
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        before = (dict(times.seconds), times.bytes)
        try:
            batch, size = produce(job)
            tensors: list[torch.Tensor] = []
            layout = _collect(batch, tensors)
            refs: list[_TensorRef] = []
            _gather_refs(layout, refs)
            offset = 0
            for ref, tensor in zip(refs, tensors, strict=True):
                ref.offset, ref.nbytes = offset, tensor.numel() * tensor.element_size()
                offset += (ref.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            region = slots[job % len(slots)].ensure(offset, grow=True)
            for ref, tensor in zip(refs, tensors, strict=True):
                if ref.nbytes:
                    target = torch.frombuffer(region, dtype=torch.uint8, count=ref.nbytes, offset=ref.offset)
                    target.copy_(tensor.contiguous().view(-1).view(torch.uint8))
            deltas = ({k: v - before[0][k] for k, v in times.seconds.items()}, times.bytes - before[1])
            conn.send((job, True, (layout, size, deltas)))
        except BaseException as exc:
            try:
                pickle.loads(pickle.dumps(exc))
                error: BaseException = exc
            except Exception:
                error = RuntimeError(f"fastio worker process: {type(exc).__name__}: {exc}")
            error.__cause__ = None
            detail = "".join(traceback.format_exception(exc))
            conn.send((job, False, (error, detail)))


def _gather_refs(value: Any, refs: list[_TensorRef]) -> None:
    if isinstance(value, _TensorRef):
        refs.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _gather_refs(v, refs)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _gather_refs(v, refs)


class ProcessPipeline:
    """Forked worker processes running ``produce(job)``, batches handed over through slot files.

    ``times`` (a :class:`fastio.sources.StageTimes`) receives each worker's per-batch stage times.

    Example::

        pipeline = ProcessPipeline(produce, n_batches=100, num_workers=2, slots=4, times=StageTimes())
    """

    def __init__(
        self, produce: Callable[[int], Any], n_batches: int, num_workers: int, slots: int, times: Any
    ) -> None:
        self.n_batches, self.slots, self.times = n_batches, slots, times
        self.directory = tempfile.mkdtemp(prefix="fastio-workers-", dir=os.environ.get("FASTIO_WORKER_DIR"))
        paths = [os.path.join(self.directory, f"slot-{k}.bin") for k in range(slots)]
        for p in paths:
            open(p, "wb").close()
        self.slot_files = [_SlotFile(p) for p in paths]
        context = multiprocessing.get_context("fork")
        self.conns, self.procs = [], []
        for w in range(num_workers):
            parent, child = context.Pipe(duplex=True)
            proc = context.Process(
                target=_worker_main,
                args=(produce, child, paths, times),
                name=f"fastio-worker-{w}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.dispatched = 0
        self.results: dict[int, tuple[bool, Any]] = {}
        self.stopped = False

    def get(self, job: int) -> tuple[bool, Any]:
        """``(True, (batch, size))`` or ``(False, exception)``; blocks until batch ``job`` is made."""
        try:
            while self.dispatched < min(self.n_batches, job + self.slots):
                self.conns[self.dispatched % len(self.conns)].send(self.dispatched)
                self.dispatched += 1
        except OSError:
            pass  # a worker is gone: reported below
        live = list(self.conns)
        while job not in self.results:
            ready = wait(live, timeout=1.0) if live else []
            for conn in ready:
                try:
                    done, ok, payload = conn.recv()
                except (EOFError, OSError):
                    live.remove(conn)
                    continue
                self.results[done] = (ok, payload)
            if job in self.results:
                break
            dead = [p for p in self.procs if not p.is_alive()]
            if dead or not live:
                name, code = (dead[0].name, dead[0].exitcode) if dead else ("?", None)
                return False, RuntimeError(
                    f"fastio: worker process {name} exited (code {code}) before batch {job}"
                )
        ok, payload = self.results.pop(job)
        if not ok:
            error, detail = payload
            error.add_note(f"in a fastio worker process:\n{detail}")
            return False, error
        layout, size, (seconds, nbytes) = payload
        for stage, value in seconds.items():
            self.times.add(stage, value)
        self.times.add("read", 0.0, nbytes)
        region = self.slot_files[job % self.slots].ensure(0, grow=False)
        return True, (_rebuild(layout, region), size)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=1.0)
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        shutil.rmtree(self.directory, ignore_errors=True)
