"""A rank that loses a peer fails within a bounded time, with an error that says so; torchrun restarts.

What happens when one rank of a group dies (SIGKILL, OOM, a node lost) or stops (SIGSTOP, a hung GPU, a
swapped-out host):

* **A dead peer** closes its sockets: the survivors' next (or current) collective fails at once with gloo's
  "Connection closed by peer" / "Connection reset by peer" (NCCL: a remote error or the watchdog's timeout).
* **A stopped peer** answers nothing: the survivors' collectives wait until the process group's timeout,
  then fail ("Timed out waiting ...").

Both surface from ``loss.backward()`` (DDP re-raises a failed allreduce or hook future as a ``RuntimeError``),
from an optimizer's or a checkpoint's collective, or from a fastcomm hook as
:class:`~fastcomm.PeerCollectiveError`. So the bound is the process group's timeout, and this module makes
it explicit and short enough to matter:

1. :func:`init_process_group` is ``torch.distributed.init_process_group`` (under torchrun, on a store key
   prefix of its own per restart attempt: see :func:`_attempt_store`) with the timeout taken from the
   argument, else ``FASTCOMM_TIMEOUT`` (seconds), else :data:`DEFAULT_TIMEOUT_S` (300 s, where torch's own
   defaults are 30 min for gloo and 10 min for NCCL). fastcomm's second process groups (the phase-2 lane)
   inherit the same timeout. It must exceed the longest time one rank can legitimately wait for another
   (a checkpoint write, an evaluation on rank 0 alone, the first step's compile).
2. :func:`peer_guard` turns those failures into :class:`PeerLostError`, which names the rank, the timeout
   and the original error, and says what happens next.
3. :func:`exit_on_peer_loss` (around a script's ``main``) prints that error and ends the process at once with
   :data:`PEER_LOST_EXIT_CODE`, without the process-group teardown that can block on a dead peer.
   ``torchrun --max-restarts N`` sees the failed worker, stops the rest of the group and restarts every
   worker; they resume from the last checkpoint (:class:`fastcomm.Checkpointer`).

Example::

    import fastcomm.fault as fault

    @fault.exit_on_peer_loss
    def main():
        fault.init_process_group("gloo")              # FASTCOMM_TIMEOUT or 300 s
        ...
        with fault.peer_guard():
            loss.backward()
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PEER_LOST_EXIT_CODE",
    "PeerLostError",
    "exit_on_peer_loss",
    "init_process_group",
    "is_peer_failure",
    "peer_guard",
    "timeout_seconds",
]

DEFAULT_TIMEOUT_S = 300.0
"""The collective timeout :func:`init_process_group` uses when neither its argument nor ``FASTCOMM_TIMEOUT``
sets one."""

PEER_LOST_EXIT_CODE = 75
"""The exit status :func:`exit_on_peer_loss` ends a process with after a :class:`PeerLostError` (EX_TEMPFAIL:
a restart can succeed)."""

_ENV = "FASTCOMM_TIMEOUT"

# What gloo, NCCL, the TCP store and DDP say when a peer is gone or silent. Matched in the message of any
# exception raised by a collective (DDP re-raises hook and allreduce failures as plain RuntimeErrors).
_PEER_SIGNS = (
    "PeerCollectiveError",
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "Broken pipe",
    "Timed out waiting",
    "timed out",
    "Timeout",
    "NCCL communicator was aborted",
    "remote process exited",
    "DistNetworkError",
    "DistBackendError",
    "Socket Timeout",
    "failed to recv",
    "failed to send",
    "Read error",
    "Write error",
)

_timeout_in_use: float | None = None

F = TypeVar("F", bound=Callable[..., Any])


def timeout_seconds(timeout: float | timedelta | None = None) -> float:
    """The collective timeout to use: ``timeout``, else ``FASTCOMM_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`.

    Raises:
        ValueError: the value (or the environment variable) is not a positive number of seconds.

    Example::

        os.environ["FASTCOMM_TIMEOUT"] = "60"
        timeout_seconds()   # 60.0
    """
    if timeout is None:
        text = os.environ.get(_ENV)
        if text is None or not text.strip():
            return DEFAULT_TIMEOUT_S
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{_ENV}={text!r} is not a number of seconds") from None
        where = _ENV
    else:
        value = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        where = "timeout"
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{where} must be a positive, finite number of seconds, got {value!r}")
    return value


def init_process_group(backend: str | None = None, *, timeout: float | timedelta | None = None,
                       **kwargs: Any) -> float:
    """``torch.distributed.init_process_group`` with a bounded, stated collective timeout.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ... (default: torch's choice for the device).
        timeout: seconds or a ``timedelta`` (default: ``FASTCOMM_TIMEOUT``, else 300 s).
        **kwargs: passed on (``init_method``, ``rank``, ``world_size``, ``device_id``, ...).

    Returns:
        The timeout in seconds.

    Example::

        fastcomm.fault.init_process_group("gloo", timeout=60)   # under torchrun: env:// rendezvous
    """
    global _timeout_in_use
    seconds = timeout_seconds(timeout)
    if "store" not in kwargs and kwargs.get("init_method") in (None, "env://"):
        store = _attempt_store(seconds)
        if store is not None:
            kwargs.pop("init_method", None)
            kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=seconds), **kwargs)
    _timeout_in_use = seconds
    return seconds


def _attempt_store(seconds: float) -> dist.Store | None:
    """Under torchrun, the rendezvous store with a prefix of its own for this restart attempt; else None.

    torchrun's agent keeps one TCP store for all restart attempts, and the workers of attempt ``n`` write
    their gloo addresses under the same keys as attempt ``n - 1``'s. A restarted worker can then read a dead
    worker's address and fail in ``connectFullMesh`` ("Connection refused", measured with torch 2.13 and
    ``--standalone``), costing restarts. A prefix per ``TORCHELASTIC_RESTART_COUNT`` keeps attempts apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    needed = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    if attempt is None or not all(os.environ.get(k) for k in needed):
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
        is_master=not agent_store and rank == 0, timeout=timedelta(seconds=seconds),
        multi_tenant=not agent_store,
    )
    return dist.PrefixStore(f"fastcomm/attempt_{attempt}", store)


class PeerLostError(RuntimeError):
    """This rank's collective failed because a peer rank died, stopped past the timeout, or its link dropped.

    Args:
        rank: this rank.
        timeout: the process group's timeout in seconds, if known.
        cause: the original exception.

    Example::

        try:
            with peer_guard():
                loss.backward()
        except PeerLostError as error:
            print(error)   # names the rank, the timeout, the cause
            raise
    """

    def __init__(self, rank: int, timeout: float | None, cause: BaseException) -> None:
        self.rank, self.timeout, self.cause = rank, timeout, cause
        bound = f"the {timeout:g} s collective timeout" if timeout is not None else "the collective timeout"
        text = " ".join(str(cause).split())
        if len(text) > 700:
            text = text[:350] + " ... " + text[-350:]
        super().__init__(
            f"rank {rank}: a peer rank is gone (killed, crashed, or silent for longer than {bound}; "
            f"{_ENV} sets it) or its link dropped, so this rank cannot continue. Under torchrun "
            f"--max-restarts the group is restarted and resumes from the last checkpoint. "
            f"Cause: {type(cause).__name__}: {text}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.rank, self.timeout, self.cause)


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is a collective failing on a lost or silent peer.

    Example::

        is_peer_failure(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500"))   # True
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PeerLostError):
            return True
        dist_error = getattr(dist, "DistError", None)
        if dist_error is not None and isinstance(current, dist_error):
            return True
        text = f"{type(current).__name__}: {current}"
        if any(sign in text for sign in _PEER_SIGNS):
            return True
        current = current.__cause__ or current.__context__
    return False


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextmanager
def peer_guard() -> Iterator[None]:
    """Raise :class:`PeerLostError` (chained to the original) where a collective fails on a lost peer.

    Other exceptions pass through unchanged.

    Example::

        with peer_guard():
            loss = ddp(x).sum()
            loss.backward()
            optimizer.step()
    """
    try:
        yield
    except PeerLostError:
        raise
    except Exception as error:
        if is_peer_failure(error):
            raise PeerLostError(_rank(), _timeout_in_use, error) from error
        raise


def exit_on_peer_loss(fn: F) -> F:
    """Decorate a script's ``main``: on :class:`PeerLostError`, print it and ``os._exit`` at once.

    Python's normal exit would run the process group's teardown, which can block on the dead peer; the
    restart does not need it. Exits with :data:`PEER_LOST_EXIT_CODE`.

    Example::

        @exit_on_peer_loss
        def main():
            ...
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PeerLostError as error:
            traceback.print_exc(file=sys.stderr)
            print(f"fastcomm.fault: {error}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(PEER_LOST_EXIT_CODE)

    return wrapper  # type: ignore[return-value]
