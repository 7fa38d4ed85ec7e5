"""Test-session set-up shared by every test file.

Without a CUDA device the Triton kernels run under Triton's interpreter on CPU tensors. The switch must be
set before any ``@triton.jit`` function is defined, so it is set here, before test modules are imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests share 2 cores with each other's worker processes; more intra-op threads than cores only thrash.
torch.set_num_threads(min(2, os.cpu_count() or 1))
