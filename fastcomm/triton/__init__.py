"""Triton kernels for CUDA tensors, one kernel family per file.

:func:`register_cuda_kernels` is called once by :mod:`fastcomm.ops` when CUDA is present; it raises
``ImportError`` when triton is not installed, which ``ops`` reports through ``fastcomm.backend()``.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["register_cuda_kernels"]


def register_cuda_kernels(lib: torch.library.Library) -> None:
    """Register the Triton host functions as the ``CUDA`` kernels of their ``fastcomm`` ops.

    Which ops have one comes from :data:`fastcomm.ops.OP_SPECS`: a row with ``triton="sign"`` has its kernel
    in ``fastcomm.triton.sign``, the host function of the op's name. The schemas (including ``residual``'s
    in-place ``Tensor(a!)?`` annotation) and the fake kernels are declared there too; this only adds the
    ``CUDA`` implementations, so ``torch.compile`` sees the same opaque custom ops on every device.

    Args:
        lib: the ``fastcomm`` ``DEF`` library from :mod:`fastcomm.ops`.

    Raises:
        ImportError: triton is not installed (``fastcomm.backend()`` then reports the reference on CUDA).

    Example::

        >>> register_cuda_kernels(torch.library.Library("fastcomm", "DEF"))  # done by fastcomm.ops
    """
    from fastcomm.ops import OP_SPECS  # fastcomm.ops calls this once its table is built

    # Every module is imported before anything is registered, so a missing triton registers nothing.
    kernels = {
        spec.name: getattr(importlib.import_module(f"fastcomm.triton.{spec.triton}"), spec.name)
        for spec in OP_SPECS
        if spec.triton is not None
    }
    for name, kernel in kernels.items():
        lib.impl(name, kernel, "CUDA")
