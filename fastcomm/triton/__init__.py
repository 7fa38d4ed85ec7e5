"""Triton kernels for CUDA tensors, one kernel family per file.

:func:`register_cuda_kernels` is called once by :mod:`fastcomm.ops` when CUDA is present; it raises
``ImportError`` when triton is not installed, which ``ops`` reports through ``fastcomm.backend()``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import torch

__all__ = ["register_cuda_kernels"]


def register_cuda_kernels(lib: torch.library.Library, modules: Mapping[str, str]) -> None:
    """Register the Triton host functions as the ``CUDA`` kernels of their ``fastcomm`` ops.

    Which ops have one comes from :data:`fastcomm.ops.OP_SPECS`, which :mod:`fastcomm.ops` hands over as
    ``modules``: an op mapped to ``"sign"`` has its kernel in ``fastcomm.triton.sign``, the host function of
    the op's name. The schemas (including ``residual``'s in-place ``Tensor(a!)?`` annotation) and the fake
    kernels are declared there too; this only adds the ``CUDA`` implementations, so ``torch.compile`` sees
    the same opaque custom ops on every device.

    Args:
        lib: the ``fastcomm`` ``DEF`` library from :mod:`fastcomm.ops`.
        modules: op name -> the module of ``fastcomm.triton`` that holds its kernel.

    Raises:
        ImportError: triton is not installed (``fastcomm.backend()`` then reports the reference on CUDA).

    Example::

        >>> register_cuda_kernels(lib, {"quantize_blockwise": "quantize"})  # done by fastcomm.ops
    """
    # Every module is imported before anything is registered, so a missing triton registers nothing.
    kernels = {
        name: getattr(importlib.import_module(f"fastcomm.triton.{module}"), name)
        for name, module in modules.items()
    }
    for name, kernel in kernels.items():
        lib.impl(name, kernel, "CUDA")
