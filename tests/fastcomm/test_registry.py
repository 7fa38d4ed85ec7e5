"""``fastcomm.hooks.HOOKS`` is the one table of names: one name, one state class, one hook (one gloo rank)."""

from __future__ import annotations

import pytest
import torch

import fastcomm
from fastcomm.hooks import HOOKS, HookName


def test_every_built_in_name_is_a_row():
    assert {name.value for name in HookName} <= set(HOOKS)


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_a_name_registers_its_rows_state_and_hook(small_ddp, name):
    ddp = small_ddp()
    state = fastcomm.register(ddp, name)
    assert type(state) is HOOKS[name].state
    assert fastcomm.hooks.registry.hook_of(state) is HOOKS[name].hook


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_a_state_object_registers_with_its_rows_hook(small_ddp, name):
    state = fastcomm.hooks.registry.build_state(name, {})[0]
    assert fastcomm.register(small_ddp(), state) is state


def test_powersgd_by_name_is_the_documented_powersgd_state(small_ddp):
    state = fastcomm.register(small_ddp(), "powersgd", rank=2, start_iter=3)
    assert type(state) is fastcomm.PowerSGDState
    assert (state.rank, state.start_iter) == (2, 3)
    assert HOOKS["powersgd"].hook is fastcomm.powersgd_hook


def test_a_hook_name_member_resolves_as_its_value(small_ddp):
    assert type(fastcomm.register(small_ddp(), HookName.POWERSGD)) is fastcomm.PowerSGDState


def test_an_added_compressor_lands_in_the_same_table():
    from fastcomm.compress import QuantCompressor

    fastcomm.hooks.add_compressor("registry_test_q8", QuantCompressor)
    row = HOOKS["registry_test_q8"]
    assert (row.state, row.hook, row.compressor) == (
        fastcomm.hooks.CompressorState,
        fastcomm.hooks.compressor_hook,
        QuantCompressor,
    )
    fastcomm.hooks.add_compressor("registry_test_q8", QuantCompressor)  # the same factory again: kept
    with pytest.raises(ValueError, match="already registered"):
        fastcomm.hooks.add_compressor("registry_test_q8", lambda: None)
    with pytest.raises(ValueError, match="built-in"):
        fastcomm.hooks.add_compressor("powersgd", QuantCompressor)


def test_an_unknown_name_lists_the_table(small_ddp):
    with pytest.raises(ValueError, match=r"unknown hook 'nope'; known hooks: .*'powersgd'.*'cast16'"):
        fastcomm.register(small_ddp(), "nope")


def test_a_powersgd_checkpoint_saved_as_a_compressor_state_loads_into_powersgd_state(small_ddp):
    # register(ddp, "powersgd") built a CompressorState before the one table; its checkpoints still load
    from fastcomm.compress.cast import CastCompressor
    from fastcomm.compress.powersgd import PowerSGDCompressor
    from fastcomm.hooks import CompressorState, PowerSGDState

    ddp = small_ddp()
    old = CompressorState(PowerSGDCompressor(2, True, "qr"))
    fastcomm.register(ddp, old)
    for _ in range(3):
        ddp(torch.randn(4, 8)).square().sum().backward()
    saved = old.state_dict()
    assert saved["type"] == "CompressorState"
    state = PowerSGDState(rank=2)
    state.load_state_dict(saved)
    assert state.stats()["steps"] == old.stats()["steps"] == 3
    merged, _ = PowerSGDState.merge_state_dicts([saved], world_size=1, rank=0)
    assert merged["type"] == "PowerSGDState" and merged["options"]["rank"] == 2
    with pytest.raises(ValueError, match="CompressorState"):
        PowerSGDState().load_state_dict(CompressorState(CastCompressor()).state_dict())


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("quantize", {"bits": 4}, "QuantCompressor(bits=4"),
        ("sign", {"chunk": 64}, "SignCompressor(chunk=64"),
        ("cast", {}, "CastCompressor(dtype=torch.bfloat16"),
        ("powersgd", {"rank": 2}, "PowerSGDCompressor(rank=2"),
        ("cast16", {"dtype": torch.float16}, "CastCompressor(dtype=torch.float16"),
    ],
)
def test_compressor_of_gives_the_named_exchange(name, options, expected):
    assert repr(fastcomm.hooks.compressor_of(name, options)).startswith(expected)


def test_compressor_of_topk_says_what_to_use():
    with pytest.raises(ValueError, match="TopKCompressor"):
        fastcomm.hooks.compressor_of("topk", {})


def test_compressor_of_an_unknown_option_names_the_compressor():
    with pytest.raises(TypeError, match="'quantize'"):
        fastcomm.hooks.compressor_of("quantize", {"ratio": 0.1})
