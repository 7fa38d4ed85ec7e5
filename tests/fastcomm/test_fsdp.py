"""fastcomm.fsdp on FSDP2 models over 2 gloo ranks: each case's results within the compressor's bound of
the exact mean, the gradients FSDP assigns equal to them, the traffic and the residual's memory as stated.

The ranks run every case of ``_fsdp_workers.cases`` in one process group (a module fixture); each case is
its own test here. The arguments' checks run in this process.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fastcomm.fsdp
from fastcomm.compress import PowerSGDCompressor, TopKCompressor

sys.path.insert(0, str(Path(__file__).parent))
import _fsdp_workers as workers  # noqa: E402
import _hooks_workers  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Case -> per-rank outcome ("ok" or the traceback)."""
    workdir = tmp_path_factory.mktemp("fsdp")
    _hooks_workers.spawn(workdir, WORLD, workers.run_all, str(workdir), timeout_s=300)
    per_rank = [json.loads((workdir / f"results_{r}.json").read_text()) for r in range(WORLD)]
    return {key: [ranks[key] for ranks in per_rank] for key in per_rank[0]}


@pytest.mark.parametrize("case", sorted(workers.cases(WORLD)))
def test_fsdp_case(outcomes, case):
    failures = [text for text in outcomes[case] if text != "ok"]
    assert not failures, failures[0]


def test_every_case_ran(outcomes):
    assert sorted(outcomes) == sorted(workers.cases(WORLD))


# ---------------------------------------------------------------------------- argument checks (no group)
def test_compress_refuses_a_model_without_fully_shard():
    with pytest.raises(TypeError, match="fully_shard"):
        fastcomm.fsdp.compress(nn.Linear(3, 5), "quantize", bits=8)


def test_compress_refuses_powersgd():
    with pytest.raises(TypeError, match="PowerSGD"):
        fastcomm.fsdp.CompressedReduceScatter(PowerSGDCompressor(rank=2))


def test_reduce_scatter_refuses_a_non_blockwise_compressor():
    with pytest.raises(TypeError, match="blockwise"):
        fastcomm.fsdp.CompressedReduceScatter(TopKCompressor(k=3))


def test_residual_dtype_needs_error_feedback():
    with pytest.raises(ValueError, match="error_feedback"):
        fastcomm.fsdp.CompressedReduceScatter(
            fastcomm.compress.QuantCompressor(bits=8), error_feedback=False, residual_dtype=torch.bfloat16
        )


def test_options_go_with_a_name_only():
    with pytest.raises(TypeError, match="options"):
        fastcomm.fsdp.compress(nn.Linear(3, 5), fastcomm.compress.QuantCompressor(bits=8), bits=4)
