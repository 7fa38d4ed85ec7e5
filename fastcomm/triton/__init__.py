"""Triton kernels for CUDA tensors, one kernel family per file.

:func:`register_cuda_kernels` is called once by :mod:`fastcomm.ops` when CUDA is present; it raises
``ImportError`` when triton is not installed, which ``ops`` reports through ``fastcomm.backend()``.
"""

from __future__ import annotations

import torch

__all__ = ["register_cuda_kernels"]


def register_cuda_kernels(lib: torch.library.Library) -> None:
    """Register the Triton host functions as the ``CUDA`` kernels of their ``fastcomm`` ops.

    The schemas (including ``residual``'s in-place ``Tensor(a!)?`` annotation) and the fake kernels are
    declared once in :mod:`fastcomm.ops`; this only adds the ``CUDA`` implementations, so ``torch.compile``
    sees the same opaque custom ops on every device.

    Args:
        lib: the ``fastcomm`` ``DEF`` library from :mod:`fastcomm.ops`.

    Raises:
        ImportError: triton is not installed (``fastcomm.backend()`` then reports the reference on CUDA).

    Example::

        >>> register_cuda_kernels(torch.library.Library("fastcomm", "DEF"))  # done by fastcomm.ops
    """
    from fastcomm.triton import quantize, sign  # imports triton; ImportError when it is missing

    kernels = {
        "quantize_blockwise": quantize.quantize_blockwise,
        "dequantize_blockwise": quantize.dequantize_blockwise,
        "dequantize_blockwise_into": quantize.dequantize_blockwise_into,
        "sign_compress": sign.sign_compress,
        "sign_decompress": sign.sign_decompress,
        "sign_decompress_into": sign.sign_decompress_into,
    }
    for name, kernel in kernels.items():
        lib.impl(name, kernel, "CUDA")
