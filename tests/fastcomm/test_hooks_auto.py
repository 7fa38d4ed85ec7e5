"""The "auto" hook: its choice by the cost model, its options, and (on 2 and 4 ranks, case ``auto-switch`` of
``_collectives_workers.py``) switches that keep ranks in step and pay what a bucket owes."""

import pytest
import torch

import fastcomm
from fastcomm.advise.kernels import KernelRates
from fastcomm.advise.methods import method_of
from fastcomm.advise.model import Link
from fastcomm.hooks.auto import CANDIDATES as CANDIDATE_METHODS
from fastcomm.hooks.auto import AutoState, choose

FAST_CODECS = KernelRates({k: 4e9 for k in (
    "copy", "quantize8", "quantize4", "dequantize8", "dequantize4", "sign_compress", "sign_decompress",
    "topk_select", "powersgd_project", "powersgd_back_project", "powersgd_expand",
)}, 1e9, "cpu", 1, "given")  # fmt: skip
CANDIDATES = ("cast_bf16_two_phase", "quantize8", "quantize4")


def test_a_fast_link_keeps_dense():
    assert choose(6_000_000, 2, Link(5e-6, 300e9), FAST_CODECS, CANDIDATES, 0.1) == "dense"


def test_a_slow_link_takes_the_cheapest_on_the_wire():
    assert choose(6_000_000, 2, Link(1e-4, 12e6), FAST_CODECS, CANDIDATES, 0.1) == "quantize4"


def test_slow_codecs_keep_dense_even_on_a_slow_link():
    slow = FAST_CODECS.scaled(1e-4)
    assert choose(6_000_000, 2, Link(1e-4, 12e6), slow, CANDIDATES, 0.1) == "dense"


def test_no_candidate_within_the_margin_keeps_dense():
    link = Link(1e-4, 1.2e8)
    picked = choose(6_000_000, 2, link, FAST_CODECS, CANDIDATES, 0.0)
    assert picked != "dense"
    assert choose(6_000_000, 2, link, FAST_CODECS, (picked,), 0.99) == "dense"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"candidates": ("quantize3",)}, "candidates: unknown method 'quantize3'; known: cast_bf16_two"),
        ({"candidates": ("topk0.01",)}, "candidates: unknown method 'topk0.01'"),  # not two-phase
        ({"candidates": "quantize8"}, "candidates"),
        ({"margin": 1.0}, "margin"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"link": "1gbit"}, "link"),
    ],
)
def test_auto_state_names_a_bad_option(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AutoState(**options)


def test_register_auto_trains_on_one_rank(small_ddp):
    ddp = small_ddp()
    state = fastcomm.register(ddp, "auto", warmup_steps=1)
    assert isinstance(state, AutoState)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        ddp(torch.randn(16, 8, generator=gen)).square().mean().backward()
    stats = state.stats()
    assert stats["steps"] == 3 and state.choices == {}  # one rank: nothing to measure or choose
    assert all(isinstance(value, (int, float)) for value in stats.values())


@pytest.mark.parametrize(("old", "new"), [("cast16", "cast_bf16_two_phase"), ("quant8", "quantize8"),
                                           ("quant4", "quantize4")])  # fmt: skip
def test_an_old_candidate_name_warns_naming_the_new_one_and_counts_under_it(small_ddp, old, new):
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated .* use '{new}'"):
        state = fastcomm.register(small_ddp(), "auto", candidates=(old, "sign"))
    assert state.candidates == (new, "sign") and state.options()["candidates"] == (new, "sign")
    assert f"auto_{new}_buckets" in state.stats() and f"auto_{old}_buckets" not in state.stats()
    with pytest.warns(DeprecationWarning, match=f"use '{new}'"):
        assert choose(6_000_000, 2, Link(1e-4, 12e6), FAST_CODECS, (old,), 0.1) == new


def test_the_default_candidates_are_the_advisors_methods_at_loss_parity(small_ddp):
    state = fastcomm.register(small_ddp(), "auto")
    assert state.candidates == ("cast_bf16_two_phase", "quantize8", "quantize4")
    assert all(CANDIDATE_METHODS[c] is method_of(c) for c in state.candidates)
    assert {k for k in state.stats() if k.startswith("auto_") and k.endswith("_buckets")} == {
        "auto_dense_buckets", "auto_cast_bf16_two_phase_buckets", "auto_quantize8_buckets",
        "auto_quantize4_buckets",
    }  # fmt: skip


@pytest.mark.parametrize(("chosen", "slower"), [((0.5, 0.45, 0.55), True), ((0.2, 0.25, 0.21), False)])
def test_a_trial_slower_than_dense_reverts(one_rank, chosen, slower):
    from fastcomm.hooks.auto import _trial_medians

    periods = {"dense": [2.0, 0.3, 0.31], "chosen": list(chosen)}  # the first dense period: what was owed
    medians = _trial_medians(periods, None)
    assert medians == (sorted(chosen)[1], 0.31)
    assert (medians[0] > medians[1]) is slower
