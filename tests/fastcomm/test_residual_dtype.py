"""``residual_dtype``: error feedback kept narrow between steps, the same option in every mode.

The DDP hooks on 2 gloo ranks (one spawned group, :mod:`_residual_dtype_workers`): bf16 residuals equal a
simulation that rounds them to bf16 between steps, take half the bytes of fp32 ones, keep the
error-feedback invariant within the bound bf16 storage derives, and survive a checkpoint bit for bit. In
this process: the option's checks, with the text FSDP's option has. DiLoCo's cases run with its own
simulation (test_diloco.py).
"""

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

import fastcomm
import fastcomm.fsdp

sys.path.insert(0, str(Path(__file__).parent))
import _hooks_workers  # noqa: E402
import _residual_dtype_workers as workers  # noqa: E402


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Check id -> per-rank outcome ("ok" or the traceback)."""
    workdir = tmp_path_factory.mktemp("residual_dtype")
    _hooks_workers.spawn(workdir, 2, workers.run_all, str(workdir), timeout_s=240)
    per_rank = [json.loads((workdir / f"results_{r}.json").read_text()) for r in range(2)]
    return {key: [ranks[key] for ranks in per_rank] for key in per_rank[0]}


@pytest.mark.parametrize("check", sorted(workers.checks(2)))
def test_hooks_keep_bf16_residuals(outcomes, check):
    failures = [text for text in outcomes[check] if text != "ok"]
    assert not failures, failures[0]


@pytest.mark.parametrize(
    "make",
    [
        lambda dtype: fastcomm.QuantState(residual_dtype=dtype),
        lambda dtype: fastcomm.TopKState(residual_dtype=dtype),
        lambda dtype: fastcomm.fsdp.CompressedReduceScatter(
            fastcomm.compressor("quantize"), residual_dtype=dtype
        ),
    ],
    ids=["hooks-quantize", "hooks-topk", "fsdp"],
)
@pytest.mark.parametrize("bad", ["bf16", torch.int8, float])
def test_a_bad_residual_dtype_is_refused_alike_everywhere(make, bad):
    with pytest.raises(ValueError, match=r"residual_dtype must be a floating-point dtype or None, got"):
        make(bad)


def test_residual_dtype_needs_error_feedback_in_the_hooks_as_in_fsdp():
    with pytest.raises(ValueError, match="residual_dtype needs error_feedback=True"):
        fastcomm.SignState(error_feedback=False, residual_dtype=torch.bfloat16)


def test_the_option_reaches_the_flat_and_hierarchical_stores_and_survives_pickling():
    state = pickle.loads(pickle.dumps(fastcomm.SignState(residual_dtype=torch.bfloat16)))
    assert state.options()["residual_dtype"] == torch.bfloat16
    assert state.store.residual_dtype == state.hierarchy.store.residual_dtype == torch.bfloat16
