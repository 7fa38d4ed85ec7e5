"""Worker processes making batches ahead of the consumer (for Python transforms, collates and Datasets that
hold the GIL); forked, or started by ``"spawn"``/``"forkserver"`` from a picklable factory. Each process
writes the tensors of its batch into a ring slot: a file in ``$FASTIO_WORKER_DIR`` (or the system temp dir,
never ``/dev/shm``) that is unlinked as it is created, so it has no path and never outlives the processes
that map it. Both sides map it shared; only a small description (offsets, dtypes, shapes, and non-tensor
leaves such as keys) goes through a pipe. Tensors are never pickled.

Batch ``j`` is handed out in order (or, with :meth:`ProcessPipeline.get_ready`, whichever of the batches in
flight is made first), at most ``slots`` batches in flight. A yielded batch is
never overwritten while anything still views it (the batch, a slice, a numpy view): before a slot
is refilled the consumer checks whether its mapping is still viewed, and if so gives the slot a new file
(sent to the worker over the pipe) and leaves the old mapping to whoever holds it. ``reuse=False`` gives
every batch fresh memory. An exception in a worker is re-raised in the consumer; a worker that dies raises
``RuntimeError`` (never a hang). A worker process exits when its parent dies, even mid-batch
(``PR_SET_PDEATHSIG`` on Linux, with the pipe and a parent-pid check as the fallback elsewhere). Linux sends
that signal when the *thread* that forked exits, so start the iteration (``iter(loader)``) in a thread that
outlives it; if that thread ends first, the next batch raises the dead-worker ``RuntimeError``.

Example::

    pipeline = ProcessPipeline(produce, n_batches=100, num_workers=2, slots=4, times=StageTimes())
    ok, (batch, size) = pipeline.get(0)
    pipeline.stop()
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import torch

from fastio.assembly.structure import map_structure
from fastio.errors import WorkerTimeoutError
from fastio.sources import storage_refs

__all__ = ["Inherited", "ProcessPipeline"]

_ALIGN = 64
_COPY_AT_MOST = 64 << 10  # tensors this small leave a slot as copies
_PR_SET_PDEATHSIG = 1
_PARENT_POLL_S = 0.5  # how often an idle worker process checks that its parent is still there


class _TensorRef:
    """Where a tensor of a batch lies in its slot file."""

    __slots__ = ("dtype", "nbytes", "offset", "shape")

    def __init__(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.offset, self.nbytes, self.dtype, self.shape = offset, nbytes, dtype, shape


def _collect(batch: Any) -> tuple[Any, list[tuple[_TensorRef, torch.Tensor]]]:
    """The batch's layout (tensors replaced by refs at packed, aligned offsets) and the refs with their
    tensors."""
    pairs: list[tuple[_TensorRef, torch.Tensor]] = []

    def place(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        offset = (pairs[-1][0].offset + pairs[-1][0].nbytes + _ALIGN - 1) // _ALIGN * _ALIGN if pairs else 0
        ref = _TensorRef(offset, value.numel() * value.element_size(), value.dtype, tuple(value.shape))
        pairs.append((ref, value))
        return ref

    return map_structure(batch, place), pairs


def _rebuild(layout: Any, base: torch.Tensor | None) -> Any:
    """The batch: its large tensors views of ``base`` (the slot's mapping, so that the slot knows it is held),
    its small ones (labels, lengths) copied out, so that keeping only those never holds a whole slot."""

    def view(value: Any) -> Any:
        if not isinstance(value, _TensorRef):
            return value
        if value.nbytes == 0:
            return torch.empty(value.shape, dtype=value.dtype)
        tensor = base[value.offset : value.offset + value.nbytes].view(value.dtype).view(value.shape)
        return tensor.clone() if value.nbytes <= _COPY_AT_MOST else tensor

    return map_structure(layout, view)


class _SlotFile:
    """One ring slot: an unlinked file (an fd, no path) that both processes map shared; the writer grows it
    when a batch needs more. ``base`` is a uint8 tensor over the whole mapping: every tensor handed out from
    the slot is a view of it, so its storage's use count says whether anyone still holds one."""

    def __init__(self, fd: int) -> None:
        self.fd, self.size = fd, 0
        self.base: torch.Tensor | None = None

    @classmethod
    def create(cls) -> _SlotFile:
        with tempfile.TemporaryFile(dir=os.environ.get("FASTIO_WORKER_DIR")) as fh:  # unlinked at once
            return cls(os.dup(fh.fileno()))

    def mapped(self, nbytes: int = 0) -> torch.Tensor | None:
        """The mapping (None while the file is empty), the file first grown to ``nbytes`` if smaller."""
        if nbytes > os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, nbytes * 5 // 4 + _ALIGN)
        actual = os.fstat(self.fd).st_size
        if actual != self.size:
            self.base = _map_shared(self.fd, actual) if actual else None  # the old mapping lives in its views
            self.size = actual
        return self.base

    def held(self) -> bool:
        return self.base is not None and storage_refs(self.base) > 1

    def close(self) -> None:
        self.base = None  # unmapped when its last view is freed
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1  # a second close must not hit a descriptor since reused elsewhere


def _map_shared(fd: int, size: int) -> torch.Tensor:
    """A uint8 tensor over the first ``size`` bytes of file ``fd``, mapped shared and unmapped with its last
    view. On Linux through ``/proc/self/fd``, so that the mapping keeps no descriptor open: batches a user
    keeps cost no file descriptors. (Never ``mmap.close()`` one: ``torch.frombuffer`` keeps the mmap object
    alive without holding a buffer export, so close() would unmap under a kept batch.)"""
    proc_path = f"/proc/self/fd/{fd}"
    if os.path.exists(proc_path):
        return torch.from_file(proc_path, shared=True, size=size, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_WRITE), dtype=torch.uint8)


def _write(slot: _SlotFile, pairs: list[tuple[_TensorRef, torch.Tensor]]) -> None:
    end = max((ref.offset + ref.nbytes for ref, _ in pairs), default=0)
    base = slot.mapped(end)
    for ref, tensor in pairs:
        if ref.nbytes:
            base[ref.offset : ref.offset + ref.nbytes].copy_(tensor.contiguous().view(-1).view(torch.uint8))


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux), and exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the parent-pid check of the receive loop still notices
    if os.getppid() != parent_pid:  # the parent died between fork and prctl
        os._exit(0)


class _NextPass:
    """Tells a kept worker process what the next pass is (``produce.retarget(update)``)."""

    __slots__ = ("update",)

    def __init__(self, update: Any) -> None:
        self.update = update


class Inherited:
    """What a forked worker process makes batches with: the parent's own ``produce``, ``times`` and
    ``worker_init``, inherited by the fork (never pickled). A spawned one gets instead a picklable factory
    that builds the same three in the new process (:mod:`fastio.pipeline.spawn`).

    Example::

        produce, times, worker_init = Inherited(produce, times, None)()
    """

    def __init__(self, produce: Callable[[int], Any], times: Any, worker_init: Callable[[int], None] | None):
        self.made = (produce, times, worker_init)

    def __call__(self) -> tuple[Callable[[int], Any], Any, Callable[[int], None] | None]:
        return self.made


def _worker_main(
    factory: Callable[[], tuple[Callable[[int], Any], Any, Callable[[int], None] | None]],
    conn: Any,
    slot_fds: list[int],
    worker_id: int,
    parent_pid: int | None,
    inherited: list[Any],
) -> None:
    if parent_pid is not None:  # forkserver: the parent is the server; the pipe's end says the loader died
        _die_with_parent(parent_pid)
    for other in inherited:  # other workers' pipe ends: holding them would hide their parent's death
        other.close()
    torch.set_num_threads(1)
    slots = [_SlotFile(fd) for fd in slot_fds]
    failed: tuple[BaseException, str] | None = None
    try:
        produce, times, worker_init = factory()
        if worker_init is not None:
            worker_init(worker_id)
    except Exception as exc:  # answered to every batch asked, so the consumer raises it
        failed = (_picklable(exc), "".join(traceback.format_exception(exc)))
    while True:
        while not conn.poll(_PARENT_POLL_S):
            if parent_pid is not None and os.getppid() != parent_pid:
                return
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        if isinstance(message, _NextPass):  # persistent workers: the same process serves the next pass
            produce.retarget(message.update)  # type: ignore[attr-defined]
            continue
        job, new_file = message
        if failed is not None:
            conn.send((job, False, failed))
            continue
        if new_file:  # the consumer still holds this slot's last batch: write into the file it sends
            slots[job % len(slots)].close()
            slots[job % len(slots)] = _SlotFile(recv_handle(conn))
        before = (dict(times.seconds), times.bytes)
        try:
            batch, size = produce(job)
            layout, pairs = _collect(batch)
            _write(slots[job % len(slots)], pairs)
            del batch, pairs
            deltas = ({k: v - before[0][k] for k, v in times.seconds.items()}, times.bytes - before[1])
            conn.send((job, True, (layout, size, deltas)))
        except BaseException as exc:
            conn.send((job, False, (_picklable(exc), "".join(traceback.format_exception(exc)))))


def _picklable(exc: BaseException) -> BaseException:
    """``exc``, or a ``RuntimeError`` naming it where it does not survive the pipe."""
    try:
        pickle.loads(pickle.dumps(exc))
        error = exc
    except Exception:
        error = RuntimeError(f"fastio worker process: {type(exc).__name__}: {exc}")
    error.__cause__ = None
    return error


class ProcessPipeline:
    """Worker processes running ``produce(job)``, batches handed over through slot files.

    ``times`` (a :class:`fastio.sources.StageTimes`) receives each worker's per-batch stage times;
    ``worker_init(worker_id)``, when given, runs first in each process; ``reuse=False`` writes every batch
    into a new file; ``timeout > 0``: :meth:`get` gives :class:`fastio.errors.WorkerTimeoutError` when a
    batch takes longer than that many seconds. ``start_method``: ``"fork"`` (the processes inherit
    ``produce``), or ``"spawn"``/``"forkserver"``, where each process calls ``factory()`` (pickled) for its
    own ``(produce, times, worker_init)`` and receives every slot file over its pipe.

    Example::

        pipeline = ProcessPipeline(produce, n_batches=100, num_workers=2, slots=4, times=StageTimes())
    """

    def __init__(
        self,
        produce: Callable[[int], Any],
        n_batches: int,
        num_workers: int,
        slots: int,
        times: Any,
        worker_init: Callable[[int], None] | None = None,
        reuse: bool = True,
        timeout: float = 0.0,
        *,
        start_method: str = "fork",
        factory: Callable[[], Any] | None = None,
    ) -> None:
        self.n_batches, self.slots, self.times, self.reuse = n_batches, slots, times, reuse
        self.timeout = timeout
        # One file more than batches in flight: the consumer still holds the last batch while asking for
        # the next, so the file refilled then is one it has dropped, and the fast path never makes files.
        self.slot_files = [_SlotFile.create() for _ in range(slots + 1)]
        self.generation = [0] * len(self.slot_files)
        forked = start_method == "fork"
        # Per worker, per slot: the file generation it has. Spawned workers inherit no file: each is sent.
        self.known = [[0 if forked else -1] * len(self.slot_files) for _ in range(num_workers)]
        self.conns, self.procs = [], []
        self.dispatched = 0
        self.pending = [0] * num_workers  # per worker, batches sent and not yet answered
        self.results: dict[int, tuple[bool, Any]] = {}
        self.stopped = False
        self.hint = (
            ""
            if start_method == "fork"
            else f" (multiprocessing_context={start_method!r}: a worker imports the main module and "
            "unpickles what it needs; its error is on stderr above)"
        )
        context = multiprocessing.get_context(start_method)
        made = Inherited(produce, times, worker_init) if forked else factory
        fds = [s.fd for s in self.slot_files] if forked else [-1] * len(self.slot_files)
        parent_pid = None if start_method == "forkserver" else os.getpid()
        for w in range(num_workers):
            parent, child = context.Pipe(duplex=True)
            inherited = list(self.conns) if forked else []
            proc = context.Process(
                target=_worker_main,
                args=(made, child, fds, w, parent_pid, inherited),
                name=f"fastio-worker-{w}",
                daemon=True,
            )
            try:
                proc.start()
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                self.stop()
                raise TypeError(
                    f"multiprocessing_context={start_method!r}: a worker process gets what it needs pickled "
                    f"(the Dataset or source, transform, collate_fn, worker_init_fn), and this failed: {exc}."
                    " Define them at module level, importable by the worker, or use "
                    "multiprocessing_context='fork'"
                ) from exc
            finally:
                child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def next_pass(self, update: Any, n_batches: int, times: Any) -> bool:
        """Serve another pass with the same processes (``persistent_workers=True``): the answers still due
        from the last pass are drained, then every worker calls ``produce.retarget(update)``. False (and
        nothing changed) when a worker is gone or, with a timeout, does not answer in time: build a new
        pipeline then.

        Example::

            if not pipeline.next_pass((epoch, indices, None), n_batches, times):
                pipeline.stop()
        """
        if self.stopped or not all(proc.is_alive() for proc in self.procs):
            return False
        wait_s = self.timeout if self.timeout > 0 else None
        try:
            for w, conn in enumerate(self.conns):
                while self.pending[w]:
                    if not conn.poll(wait_s):
                        return False
                    conn.recv()
                    self.pending[w] -= 1
            for conn in self.conns:
                conn.send(_NextPass(update))
        except (EOFError, OSError):
            return False
        self.n_batches, self.times, self.dispatched, self.results = n_batches, times, 0, {}
        return True

    def _dispatch(self, job: int) -> None:
        k, w = job % len(self.slot_files), job % len(self.conns)
        slot = self.slot_files[k]
        if slot.held() or (not self.reuse and job >= len(self.slot_files)):
            self.slot_files[k] = _SlotFile.create()
            self.generation[k] += 1
            slot.close()  # kept views keep their mapping (and the file's blocks) alive on their own
        new_file = self.known[w][k] != self.generation[k]
        self.conns[w].send((job, new_file))
        self.pending[w] += 1
        if new_file:
            send_handle(self.conns[w], self.slot_files[k].fd, self.procs[w].pid)
            self.known[w][k] = self.generation[k]

    def get(self, job: int) -> tuple[bool, Any]:
        """``(True, (batch, size))`` or ``(False, exception)``; blocks until batch ``job`` is made."""
        return self._wait(job, ready=False)[1:]

    def get_ready(self, first: int) -> tuple[int, bool, Any]:
        """``(job, ok, value)`` of whichever batch from ``first`` on (the first not yet handed out) is made
        first (DataLoader's ``in_order=False``); at most ``slots`` batches from ``first`` are in flight."""
        return self._wait(first, ready=True)

    def _wait(self, job: int, ready: bool) -> tuple[int, bool, Any]:
        try:
            while self.dispatched < min(self.n_batches, job + self.slots):
                self._dispatch(self.dispatched)
                self.dispatched += 1
        except ConnectionError:
            pass  # a worker is gone: reported below (a slot file that cannot be made raises here)
        live = list(self.conns)
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        while not (self.results if ready else job in self.results):
            if deadline is not None and time.monotonic() >= deadline:
                return (
                    job,
                    False,
                    WorkerTimeoutError(f"fastio: batch {job} not made within timeout={self.timeout} s"),
                )
            poll = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            for conn in wait(live, timeout=poll) if live else []:
                try:
                    done, ok, payload = conn.recv()
                except (EOFError, OSError):
                    live.remove(conn)
                    continue
                self.pending[self.conns.index(conn)] -= 1
                self.results[done] = (ok, payload)
            if self.results if ready else job in self.results:
                break
            dead = [p for p in self.procs if not p.is_alive()]
            if dead or not live:
                name, code = (dead[0].name, dead[0].exitcode) if dead else ("?", None)
                error = f"fastio: worker process {name} exited (code {code}) before batch {job}{self.hint}"
                return job, False, RuntimeError(error)
        job = min(self.results) if ready else job
        ok, payload = self.results.pop(job)
        if not ok:
            error, detail = payload
            error.add_note(f"in a fastio worker process:\n{detail}")
            return job, False, error
        layout, size, (seconds, nbytes) = payload
        for stage, value in seconds.items():
            self.times.add(stage, value)
        self.times.add("read", 0.0, nbytes)
        base = self.slot_files[job % len(self.slot_files)].mapped()
        return job, True, (_rebuild(layout, base), size)

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
            if not proc.is_alive():
                proc.close()  # its sentinel pipes
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        for slot in self.slot_files:
            slot.close()
