"""Fixtures shared by the fastcomm tests that need a process group in the test process itself."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A 1-rank gloo default group for the module's tests, destroyed after them."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def small_ddp(one_rank):
    """A fresh 3-layer DDP model (8 -> 16 -> 3) on the 1-rank group: call it for each model a test needs."""
    return lambda: DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)))
