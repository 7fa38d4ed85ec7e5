"""The small control collectives (auto's probes and agreement, fastcomm.ft's settings check) on an NCCL group.

NCCL takes CUDA tensors only: a control tensor left on the CPU fails there, where gloo (every other test of
this suite) takes it. Needs a CUDA device; ``benchmarks/gpu_check.sh`` runs this file on one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fastcomm.hooks.auto import _trial_medians, measured_figures

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs a CUDA device and NCCL"
)


@pytest.fixture(scope="module")
def nccl(tmp_path_factory):
    """A world of one rank over NCCL (NCCL refuses two ranks on one GPU)."""
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_cpu_tensor_is_refused_by_the_group(nccl):
    """What the other tests guard against: this group refuses a control tensor on the CPU."""
    with pytest.raises((RuntimeError, ValueError)):
        dist.all_reduce(torch.ones(2), group=nccl)


def test_auto_measures_and_agrees_on_cuda_tensors(nccl):
    link, rates = measured_figures(None, "cuda", ("quantize8",), 1 << 16, nccl)
    assert link.bandwidth_Bps > 0 and link.alpha_s >= 0
    assert rates.rates and all(rate > 0 for rate in rates.rates.values())


def test_auto_judges_its_trial_on_cuda_tensors(nccl):
    periods = {"chosen": [3.0, 1.0, 2.0], "dense": [9.0, 5.0, 4.0, 6.0]}
    assert _trial_medians(periods, nccl, torch.device("cuda")) == (2.0, 5.0)  # the first dense left out


def test_ft_settings_check_on_cuda_tensors(nccl):
    pytest.importorskip("torchft")
    from fastcomm.ft.exchange import ManagedExchange

    exchange = object.__new__(ManagedExchange)  # the check alone: no Manager, the group given
    exchange.fingerprint, exchange.device, exchange._checked = "quantize bits=8", torch.device("cuda"), None
    exchange.check(nccl)
    assert exchange._checked is nccl
