"""Which kernels of fastio are live: the native module ``fastio._C`` or the torch fallbacks, chosen once at
import.

``FASTIO_NO_NATIVE=1`` skips the native module at import (as it skips it at build time); otherwise a module
that fails to load (``ImportError``/``OSError`` only) leaves the torch fallback in place, and
:func:`backend` says which is live and why. The code that calls the kernels imports this module and reads
``_C`` from here at each call (so a test can switch it off): the mapped files are :mod:`fastio._mapped`, the
gathers :mod:`fastio._gather`, the tar header scan :mod:`fastio.format.tar.scan`. This module imports none
of them.

Example::

    import fastio
    print(fastio.backend())   # "native: fastio._C (...)" or "torch: <why>"
"""

from __future__ import annotations

import os

import torch  # noqa: F401  (loads the libraries fastio._C links against: libc10, libtorch)

__all__ = ["backend", "default_threads", "native"]

_C = None
if os.environ.get("FASTIO_NO_NATIVE", "0") == "1":
    _REASON = "torch: FASTIO_NO_NATIVE=1 is set"
else:
    try:
        from fastio import _C  # type: ignore[no-redef]

        _REASON = "native: fastio._C (threaded C++ gather, C++ tar scan)"
    except (ImportError, OSError) as exc:
        _REASON = (
            f"torch: fastio._C failed to load ({type(exc).__name__}: {exc}); rebuild with "
            "`python setup.py build_ext --inplace` (without FASTIO_NO_NATIVE=1)"
        )


def backend() -> str:
    """Which gather kernels are live (``"native: ..."`` or ``"torch: ..."``) and why.

    Example::

        assert fastio.backend().split(":")[0] in ("native", "torch")
    """
    return _REASON


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
