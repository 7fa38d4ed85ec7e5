"""fastcomm.fsdp on FSDP2 models over 2 gloo ranks: each case's results within the compressor's bound of
the exact mean, the gradients FSDP assigns equal to them, the traffic and the residual's memory as stated.

The ranks run every case of ``_fsdp_workers.cases`` in one process group (a module fixture); each case is
its own test here. The arguments' checks run in this process.
"""

import gc
import json
import sys
import weakref
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

import fastcomm.fsdp
from fastcomm.compress import PowerSGDCompressor, TopKCompressor
from fastcomm.fsdp._feedback import ErrorFeedback

sys.path.insert(0, str(Path(__file__).parent))
import _fsdp_workers as workers  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Case -> per-rank outcome ("ok" or the traceback)."""
    workdir = tmp_path_factory.mktemp("fsdp")
    workers.spawn_preloaded(workdir, WORLD, workers.run_all, str(workdir))
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


# ---------------------------------------------------------------------------- error feedback store (local)
def _residual(case: str, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case, numel)).encode()))
    return torch.randn(numel, generator=gen) * 3


@pytest.mark.parametrize("numel", [1, 7, 1001])
def test_a_bf16_residual_keeps_half_the_bytes_and_round_trips(numel):
    feedback = ErrorFeedback(torch.bfloat16)
    residual = feedback.lend()
    residual.worker = _residual("bf16", numel)  # what an exchange leaves behind
    feedback.keep()
    assert residual.worker is None and feedback.nbytes() == 2 * numel
    restored = ErrorFeedback(torch.bfloat16)
    restored.load_state_dict(feedback.state_dict())
    worker = restored.lend().worker
    assert worker.dtype == torch.float32
    assert torch.equal(worker, _residual("bf16", numel).to(torch.bfloat16).float())


def test_a_full_precision_residual_is_lent_as_is():
    feedback = ErrorFeedback()
    residual = feedback.lend()
    residual.worker = _residual("fp32", 13)
    feedback.keep()
    assert feedback.lend() is residual and feedback.nbytes() == 4 * 13
    restored = ErrorFeedback()
    restored.load_state_dict(feedback.state_dict())
    assert torch.equal(restored.lend().worker, _residual("fp32", 13))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_keep_lets_go_of_the_finished_exchange_and_its_code_buffers(dtype):
    feedback = ErrorFeedback(dtype)
    residual = feedback.lend()
    residual.worker = _residual("settle", 11)
    codes = torch.zeros(1 << 10, dtype=torch.uint8)  # a code buffer the exchange's future still holds
    exchange: torch.futures.Future = torch.futures.Future()
    exchange.set_result(codes)
    residual._pending = exchange  # what an async exchange leaves on the residual until it is settled
    watcher = weakref.ref(codes)
    del codes, exchange
    feedback.keep()
    gc.collect()
    assert watcher() is None
    assert feedback.nbytes() == (4 if dtype is None else 2) * 11


def test_a_state_without_error_feedback_refuses_one_with_it():
    with_ef = fastcomm.fsdp.CompressedReduceScatter(fastcomm.compress.QuantCompressor(bits=8))
    without = fastcomm.fsdp.CompressedReduceScatter(
        fastcomm.compress.QuantCompressor(bits=8), error_feedback=False
    )
    with pytest.raises(ValueError, match="error_feedback"):
        without.load_state_dict(with_ef.state_dict())


def test_the_step_seed_follows_the_restored_step_counter():
    saved = fastcomm.fsdp.CompressedReduceScatter(fastcomm.compress.QuantCompressor(bits=8), seed=5, index=2)
    saved.traffic.add(sent=10, dense=40)
    restored = fastcomm.fsdp.CompressedReduceScatter(
        fastcomm.compress.QuantCompressor(bits=8), seed=5, index=2
    )
    assert restored.step_seed() != saved.step_seed()
    restored.load_state_dict(saved.state_dict())
    assert restored.step_seed() == saved.step_seed() and restored.traffic == saved.traffic
