"""SparseLoCo's compressor (fastcomm/compress/sparseloco.py): top-k per chunk, 2-bit values, decaying error
feedback; its name in the one registry, and its use through the compressed all-reduce and DiLoCo."""

import zlib

import pytest
import torch
from torch import nn

import fastcomm
from fastcomm.collectives import Residual, all_reduce
from fastcomm.compress import SparseLoCoCompressor
from fastcomm.diloco.fragments import Exchange


def _generator(case: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def _roundtrip(compressor, x, residual_in):
    payload = torch.empty(compressor.wire_bytes(x.numel(), x.dtype), dtype=torch.uint8)
    residual_out = torch.empty_like(x)
    compressor.compress_into(payload, x, residual_out, residual_in, seed=0)
    out = torch.full_like(x, 7.0)
    compressor.decompress_into(out, payload, x.numel())
    return out, residual_out, payload


@pytest.mark.parametrize("numel", [1, 7, 64, 1000, 4099])
def test_sent_plus_owed_is_the_input_plus_the_decayed_residual(numel):
    generator = _generator(("roundtrip", numel))
    x, residual = torch.randn(numel, generator=generator), torch.randn(numel, generator=generator)
    compressor = SparseLoCoCompressor(k=8, chunk=64, decay=0.5)
    out, owed, _ = _roundtrip(compressor, x, residual)
    torch.testing.assert_close(out + owed, x + 0.5 * residual, rtol=0, atol=1e-6)
    chunks = -(-numel // 64)
    last = numel - (chunks - 1) * 64
    assert int((out != 0).sum()) == (chunks - 1) * 8 + min(8, last)  # k per chunk, none from the padding


def test_each_chunk_sends_its_k_largest_as_one_of_four_levels_of_its_absmax():
    x = torch.tensor([0.1, -4.0, 0.2, 3.0, 0.0, 1.0, -0.3, 0.05])
    out, _, _ = _roundtrip(SparseLoCoCompressor(k=2, chunk=4, decay=1.0), x, None)
    # chunk 0: -4 and 3 of absmax 4 -> -4 and 4 (3/4 is nearest to 1 of -1, -1/3, 1/3, 1); chunk 1: 1 and
    # -0.3 of absmax 1 -> 1 and -1/3
    expected = torch.tensor([0.0, -4.0, 0.0, 4.0, 0.0, 1.0, -1.0 / 3.0, 0.0])
    torch.testing.assert_close(out, expected)


def test_the_payload_is_500x_smaller_than_fp32_gradients_per_step_at_h10_and_decodes_added_and_divided():
    compressor = fastcomm.compressor("sparseloco")  # 120 of 4096 (2.9%)
    numel = 4096 * 50
    assert 10 * 4 * numel / compressor.wire_bytes(numel, torch.float32) > 500
    x = torch.randn(300, generator=_generator("divided"))
    small = SparseLoCoCompressor(k=4, chunk=32)
    once, _, payload = _roundtrip(small, x, None)
    out = torch.ones(300)
    small.decompress_into(out, payload, 300, accumulate=True, divisor=2)
    torch.testing.assert_close(out, 1.0 + once / 2)
    assert small.payload_finite(payload[None], 300, torch.float32)


@pytest.mark.parametrize(
    ("options", "match"),
    [({"k": 0}, "k must"), ({"chunk": 1 << 17}, "chunk must"), ({"k": 9, "chunk": 8}, "at most chunk"),
     ({"decay": 0.0}, "decay"), ({"decay": 1.5}, "decay"), ({"rescale": 1}, "rescale")],
)
def test_bad_options_raise_value_error_naming_them(options, match):
    with pytest.raises(ValueError, match=match):
        SparseLoCoCompressor(**options)


def test_the_rescaled_mean_gives_an_entry_its_senders_mean_measured_from_the_exchange():
    compressor = SparseLoCoCompressor(k=4, chunk=64)
    x = torch.randn(2, 128, generator=_generator("rescale"))
    x[1].copy_(x[0].roll(16))  # the two ranks pick disjoint entries (the top-4 of each chunk moved by 16)
    sent = [_roundtrip(compressor, x[rank], None)[0] for rank in range(2)]
    mean = (sent[0] + sent[1]) / 2  # what the all-gathered mean of two ranks is
    assert compressor.mean_scale(mean) == 2.0  # 16 entries in the union, 8 sent by each rank
    torch.testing.assert_close(mean * compressor.mean_scale(mean), sent[0] + sent[1])
    assert compressor.mean_scale(sent[0]) == 1.0  # identical picks (one rank): the mean as it is
    assert compressor.mean_scale(torch.zeros(128)) == 1.0  # nothing sent: at least 1


def test_the_compressed_all_reduce_sends_k_per_chunk_and_keeps_the_rest_owed(one_rank):
    compressor = SparseLoCoCompressor(k=4, chunk=64, decay=1.0)
    x = torch.randn(640, generator=_generator("all_reduce"))
    tensor, residual = x.clone(), Residual()
    all_reduce(tensor, compressor, residual=residual)
    assert int((tensor != 0).sum()) == 40
    again = torch.zeros(640)
    all_reduce(again, compressor, residual=residual)  # nothing new: the owed entries come through
    sent = tensor != 0
    assert int((again != 0).sum()) == 40 and not (again != 0)[sent].any()


def test_diloco_takes_the_papers_outer_step_unless_told_otherwise(one_rank):
    model = nn.Linear(64, 64)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = fastcomm.DiLoCo(model, inner, sync_every=2, compressor="sparseloco", k=16, chunk=256)
    assert (outer.outer_lr, outer.outer_momentum, outer.keep_unsent) == (1.0, 0.0, True)
    assert outer.compressor.rescale and not fastcomm.compressor("sparseloco", rescale=False).rescale
    mine = fastcomm.DiLoCo(model, inner, sync_every=2, compressor="sparseloco", outer_lr=0.8,
                           outer_momentum=0.3)  # fmt: skip
    assert (mine.outer_lr, mine.outer_momentum) == (0.8, 0.3)
    with pytest.raises(ValueError, match="keep_unsent needs"):
        fastcomm.DiLoCo(model, inner, sync_every=2, compressor="quantize", keep_unsent=True)
    for _ in range(4):
        inner.zero_grad()
        model(torch.randn(8, 64, generator=_generator("diloco"))).square().mean().backward()
        outer.step()
    assert outer.syncs == 2 and outer.stats()["inner_steps"] == 4


def test_keep_unsent_restarts_each_replica_from_the_global_weights_minus_its_decayed_residual(one_rank):
    model = nn.Linear(32, 8)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = fastcomm.DiLoCo(model, inner, sync_every=1, compressor="sparseloco", k=4, chunk=64, decay=0.5)
    inner.zero_grad()
    model(torch.randn(4, 32, generator=_generator("keep"))).square().mean().backward()
    inner.step()
    before = outer.fragments[0].local_weights()
    start = outer.fragments[0].global_weights.clone()
    outer.after_inner_step()
    fragment = outer.fragments[0]
    sent = start - fragment.global_weights  # outer lr 1, one rank: the decoded payload
    owed = (start - before) - sent
    torch.testing.assert_close(fragment.local_weights(), fragment.global_weights - 0.5 * owed)
    assert not fragment.residual.owed().any()  # the owed part lives in the local weights now


def test_an_exchange_rescales_its_mean_once_when_it_settles():
    class _Done:
        def wait(self) -> None:
            pass

    exchange = Exchange(0, 1, 1, torch.ones(4), None, work=_Done(), divide_by=2, scale_of=lambda mean: 3.0)
    exchange.settle()
    exchange.settle()  # settled: nothing more
    torch.testing.assert_close(exchange.mean, torch.full((4,), 1.5))
