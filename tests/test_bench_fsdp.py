"""benchmarks/bench_fsdp.py: its rows and notes on made-up outcomes (nothing is trained), its methods."""

from __future__ import annotations

import inspect

import pytest

import fastcomm
import fastcomm.fsdp
from benchmarks import bench_fsdp

LOSS = {"dense": {"val_loss": 2.0}, "q8": {"val_loss": 2.004}, "sign-ef": {"val_loss": 2.1}}
SPEEDS = {
    "loopback": {"dense": {"step_s": 1.0, "params": 9}, "q8": {"step_s": 1.05, "params": 9}},
    "1gbit": {"dense": {"step_s": 3.0, "params": 9}, "q8": {"step_s": 2.0, "params": 9},
              "q8-qwz": {"step_s": 1.25, "params": 9}},
}  # fmt: skip


def test_speed_rows_are_ratios_to_dense():
    rows = bench_fsdp._speed_rows(SPEEDS["1gbit"], "speed-1gbit")
    expected = {"dense": 1.0, "q8": 2 / 3, "q8-qwz": 1.25 / 3}
    assert {r.backend: r.ratio for r in rows} == pytest.approx(expected)


def test_notes_say_which_targets_were_met():
    notes = bench_fsdp._notes(LOSS, SPEEDS)
    assert any(n.startswith("q8 validation loss +0.20%") and "meets" in n for n in notes), notes
    assert any(n.startswith("sign-ef validation loss +5.00%") and "misses" in n for n in notes), notes
    assert "1gbit: q8-qwz is 2.40x dense's speed (target 2x (1 Gbit/s))" in notes
    assert "loopback: q8 is 0.95x dense's speed (target 1/1.1x (loopback))" in notes


@pytest.mark.parametrize("method", sorted(m for m, options in bench_fsdp.METHODS.items() if options))
def test_every_method_is_a_compressor_and_compress_options(method):
    options = dict(bench_fsdp.METHODS[method])
    name = options.pop("compressor")
    own = {k: options.pop(k) for k in ("bits", "block", "stochastic", "chunk") if k in options}
    assert isinstance(fastcomm.hooks.compressor_of(name, own), fastcomm.compress.Compressor)
    accepted = inspect.signature(fastcomm.fsdp.compress).parameters
    assert set(options) <= set(accepted), sorted(set(options) - set(accepted))
