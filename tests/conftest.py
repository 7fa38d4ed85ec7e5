"""Test-session set-up shared by every test file.

Without a CUDA device the Triton kernels run under Triton's interpreter on CPU tensors. The switch must be
set before any ``@triton.jit`` function is defined, so it is set here, before test modules are imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests share 2 cores with each other's worker processes; more intra-op threads than cores only thrash.
# `make test` sets FASTLIB_TEST_THREADS=1 (see the Makefile); test_ops.py varies the count itself.
torch.set_num_threads(int(os.environ.get("FASTLIB_TEST_THREADS", min(2, os.cpu_count() or 1))))


# `make test` runs the suite on three pytest-xdist workers, a file to a worker (--dist loadfile), in the order
# collected: these files take 15 s to 1 min of wall each on 2 cores (--durations=0, summed per file, and the
# CPU of their ranks), so they start first, longest first, and the short files fill in around them. Only the
# order changes; a run without xdist runs them first too.
LONG_FIRST = (
    "tests/test_fault_tolerance.py",
    "tests/test_fault_checkpoints.py",
    "tests/fastio/test_remote_parts.py",
    "tests/fastcomm/test_clean_exit.py",
    "tests/fastcomm/test_hooks_stress.py",
    "tests/test_examples.py",
    "tests/test_fault_elastic.py",
    "tests/test_fault_survivor.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.nodeid.split("::", 1)[0]
        return LONG_FIRST.index(path) if path in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: the rest keep their collected order
