"""Which kernels of fastio are live: the native module ``fastio._C`` or the torch fallbacks, chosen once at
import.

``FASTIO_NO_NATIVE=1`` skips the native module at import (as it skips it at build time); otherwise a module
that fails to load (``ImportError``/``OSError`` only) leaves the torch fallback in place, and
:func:`backend` says which is live and why, as data (:class:`Backend`, the same fields as
``fastcomm.backend()``'s). The code that calls the kernels (the gathers, the tar header scan) imports this
module and reads ``_C`` from here at each call (so a test can switch it off); this module imports none of it.

Example::

    import fastio
    print(fastio.backend())   # "fastio: native C++ (fastio._C): gather_rows, ..." or "fastio: fallbacks (..)"
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch  # noqa: F401  (loads the libraries fastio._C links against: libc10, libtorch)

__all__ = ["Backend", "backend", "default_threads", "native"]

_C = None
_REASON: str | None = None
if os.environ.get("FASTIO_NO_NATIVE", "0") == "1":
    _REASON = "FASTIO_NO_NATIVE=1 is set"
else:
    try:
        from fastio import _C  # type: ignore[no-redef]
    except (ImportError, OSError) as exc:
        _REASON = (
            f"fastio._C failed to load ({type(exc).__name__}: {exc}); rebuild with "
            "`python setup.py build_ext --inplace` (without FASTIO_NO_NATIVE=1)"
        )

# kernel of fastio._C -> what runs it without the native module
_FALLBACKS = {"gather_rows": "torch", "gather_ranges": "torch", "scan_tar": "python tarfile"}


@dataclass(frozen=True, eq=False)
class Backend(Mapping[str, str]):
    """What fastio's kernels run on; a mapping of kernel name to its implementation.

    The fields are those of ``fastcomm.backend()``'s ``Backend`` (each package defines its own: neither
    imports the other); fastio's ops are one choice, all native or all fallbacks, so their values are
    plain words.

    Attributes:
        package: ``"fastio"``.
        native: whether ``fastio._C`` is loaded and used.
        reason: why it is not (``None`` when it is).
        ops: kernel name -> ``"native-cpp"``, or its fallback (``"torch"``, ``"python tarfile"``).

    Example::

        >>> report = fastio.backend()
        >>> report.native, report["gather_rows"]
        (True, 'native-cpp')
        >>> print(report)
        fastio: native C++ (fastio._C): gather_rows, gather_ranges, scan_tar
    """

    package: str
    native: bool
    reason: str | None
    ops: Mapping[str, str]

    def __getitem__(self, op: str) -> str:
        return self.ops[op]

    def __iter__(self) -> Iterator[str]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Backend):
            return self.to_dict() == other.to_dict()
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]  (a mapping of kernels, compared by value)

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and strings, for ``json.dumps``."""
        return {"package": self.package, "native": self.native, "reason": self.reason, "ops": dict(self.ops)}

    def __str__(self) -> str:
        head = "native C++ (fastio._C)" if self.native else f"fallbacks ({self.reason})"
        return f"{self.package}: {head}: {', '.join(self.ops)}"


def backend() -> Backend:
    """Which kernels are live (``fastio._C`` or the fallbacks) and why, as a :class:`Backend`.

    Example::

        report = fastio.backend()
        threads = 4 if report.native else 1
        print(report)   # one line: the choice, why, the kernels
    """
    ops = {op: ("native-cpp" if _C is not None else fallback) for op, fallback in _FALLBACKS.items()}
    return Backend("fastio", _C is not None, _REASON, ops)


def native() -> bool:
    """True when ``fastio._C`` is loaded and used.

    Example::

        threads = 4 if fastio.native() else 1
    """
    return _C is not None


def default_threads() -> int:
    """Threads one gather may use: the CPUs this process may run on, capped at 8 (memcpy saturates early).

    Example::

        n = default_threads()
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))
