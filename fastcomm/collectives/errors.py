"""The error raised when a collective with the other ranks fails, and the helper that raises it.

Compressed collectives (:mod:`fastcomm.collectives`) and the DDP hooks built on them raise it. A hook
returns a future; DDP waits on it at the end of backward. A callback chained with ``then`` must read
its input with ``value()``: that is what re-raises a failed collective (gloo's "Connection closed by peer",
"Timed out waiting ...") in the callback, which then fails the hook's future, so the backward that waited on
it raises instead of training on with stale buffers.

DDP re-raises a failed hook future from ``loss.backward()`` as a ``RuntimeError`` whose message holds
``PeerCollectiveError: ...`` (the Python type does not survive DDP's C++ reducer); a failure seen inside the
hook call itself (a phase 1 waited for by the next bucket's hook call) propagates with its type.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PeerCollectiveError", "collective_value"]


class PeerCollectiveError(RuntimeError):
    """A fastcomm collective failed: a peer died, was stopped past the timeout, or the link dropped.

    Args:
        where: the state (or function) and collective that failed, e.g. ``"TopKState all-gather"``.
        bucket: the DDP bucket index, or ``None`` outside a hook (:mod:`fastcomm.collectives`).
        reason: the original error (also chained as ``__cause__`` where raised with ``from``).

    Example::

        try:
            loss.backward()
        except RuntimeError as error:
            if "PeerCollectiveError" in str(error):
                ...  # restart from the last checkpoint
    """

    def __init__(self, where: str, bucket: int | None, reason: BaseException) -> None:
        self.where, self.bucket, self.reason = where, bucket, reason
        on = "" if bucket is None else f" on bucket {bucket}"
        super().__init__(
            f"fastcomm {where}: a collective with the other ranks failed (a peer died, was stopped past the "
            f"process group's timeout, or the network dropped){on}: {type(reason).__name__}: {reason}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.where, self.bucket, self.reason)


def collective_value(future: torch.futures.Future, where: str, bucket: int | None) -> Any:
    """``future.value()``, a failure raised as :class:`PeerCollectiveError` chained to the original error.

    Example::

        def finish(future):
            result = collective_value(future, "CastState allreduce", bucket.index())[0]
            ...
    """
    try:
        return future.value()
    except PeerCollectiveError:
        raise
    except Exception as error:
        raise PeerCollectiveError(where, bucket, error) from error
