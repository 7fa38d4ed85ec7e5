"""Triton kernels for CUDA tensors, one kernel family per file.

:func:`register_cuda_kernels` is called once by :mod:`fastcomm.ops` when CUDA is present; it raises
``ImportError`` when triton is not installed, which ``ops`` reports through ``fastcomm.backend()``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import torch

__all__ = ["register_cuda_kernels"]


def register_cuda_kernels(lib: torch.library.Library, modules: Mapping[str, str]) -> tuple[str, ...]:
    """Register the Triton host functions as the ``CUDA`` kernels of their ``fastcomm`` ops.

    Which ops have one comes from :data:`fastcomm.ops.OP_SPECS`, which :mod:`fastcomm.ops` hands over as
    ``modules``: an op mapped to ``"sign"`` has its kernel in ``fastcomm.triton.sign``, the host function of
    the op's name. The schemas (including ``residual``'s in-place ``Tensor(a!)?`` annotation) and the fake
    kernels are declared there too; this only adds the ``CUDA`` implementations, so ``torch.compile`` sees
    the same opaque custom ops on every device. An op that already has a ``CUDA`` kernel (``fastcomm._C``'s
    C++ top-k, registered first) keeps it: its Triton twin is then reached through its module directly.

    Args:
        lib: the ``fastcomm`` ``DEF`` library from :mod:`fastcomm.ops`.
        modules: op name -> the module of ``fastcomm.triton`` that holds its kernel.

    Returns:
        The names of the ops whose ``CUDA`` kernel is now the Triton one.

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
    registered = tuple(
        name
        for name in kernels
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{lib.ns}::{name}", "CUDA")
    )
    for name in registered:
        lib.impl(name, kernels[name], "CUDA")
    return registered
