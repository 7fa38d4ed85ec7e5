"""Triton kernels for CUDA tensors, one kernel family per file.

:func:`register_cuda_kernels` is called once by :mod:`fastcomm.ops` when CUDA is present; it raises
``ImportError`` when triton is not installed, which ``ops`` reports through ``fastcomm.backend()``.
"""
