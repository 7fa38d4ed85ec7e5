"""The tables of names: compressor names (``fastcomm.compress.registry``, one vocabulary for every mode) and
hook names (``fastcomm.hooks.HOOKS``: one name, one state class, one hook; one gloo rank)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fastcomm
from fastcomm.compress import CastCompressor, PowerSGDCompressor, QuantCompressor, SignCompressor, registry
from fastcomm.hooks import HOOKS, HookName

# options a hook row cannot do without (the generic compressor hook has no default compressor)
_REQUIRED = {"compressor": {"compressor": CastCompressor()}}


# ------------------------------------------------------------------------------------- compressor names
@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("topk", {"k": 5}, "TopKCompressor(k=5, exact=False)"),
        ("quantize", {"bits": 4}, "QuantCompressor(bits=4, block=256, stochastic=True)"),
        ("sign", {"chunk": 64}, "SignCompressor(chunk=64)"),
        ("cast", {}, "CastCompressor(dtype=torch.bfloat16)"),
        ("powersgd", {"rank": 2}, "PowerSGDCompressor(rank=2, warm_start=True, orthogonalization='qr')"),
    ],
)
def test_a_compressor_name_builds_its_compressor(name, options, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert repr(fastcomm.compressor(name, **options)) == expected
        assert repr(fastcomm.compress.compressor_of(name, options)) == expected


def test_the_vocabulary_is_the_documented_one():
    assert registry.names()[:5] == ("topk", "quantize", "sign", "cast", "powersgd")
    for name in registry.names()[:5]:
        assert f"``{name}``" in fastcomm.compress.__doc__


def test_a_renamed_name_warns_naming_its_successor_and_still_works():
    with pytest.warns(DeprecationWarning, match=r"'cast16' is deprecated .* use 'cast'") as record:
        built = fastcomm.compressor("cast16", dtype=torch.float16)
    assert built == CastCompressor(torch.float16)
    assert record[0].filename == __file__  # the warning points at the caller's line
    with pytest.warns(DeprecationWarning, match="'cast16'"):
        assert fastcomm.hooks.compressor_of("cast16", {}) == CastCompressor()


def test_an_unknown_compressor_lists_the_names():
    with pytest.raises(ValueError, match=r"unknown compressor 'nope'; known: 'topk', 'quantize'.*'powersgd'"):
        fastcomm.compressor("nope")


def test_a_bad_option_names_the_compressor_and_its_options():
    with pytest.raises(
        TypeError, match=r"compressor 'quantize': .*'ratio'.*its options: bits, block, stochastic"
    ):
        fastcomm.compressor("quantize", ratio=0.1)
    with pytest.raises(TypeError, match=r"compressor 'topk': .*'k'.*its options: k, exact"):
        fastcomm.compressor("topk")
    with pytest.raises(ValueError, match="bits must be one of"):
        fastcomm.compressor("quantize", bits=3)


def test_one_add_compressor_serves_every_mode():
    assert fastcomm.add_compressor is fastcomm.hooks.add_compressor is registry.add_compressor
    assert fastcomm.hooks.compressor_of is fastcomm.compress.compressor_of
    fastcomm.add_compressor("registry_test_q8", QuantCompressor)
    assert fastcomm.compressor("registry_test_q8", bits=4) == QuantCompressor(bits=4)
    assert "registry_test_q8" in registry.names()
    row = HOOKS["registry_test_q8"]
    assert (row.state, row.hook, row.compressor) == (
        fastcomm.hooks.CompressorState,
        fastcomm.hooks.compressor_hook,
        QuantCompressor,
    )
    fastcomm.add_compressor("registry_test_q8", QuantCompressor)  # the same factory again: kept
    with pytest.raises(ValueError, match="already registered"):
        fastcomm.add_compressor("registry_test_q8", lambda: None)


@pytest.mark.parametrize("name", ["powersgd", "cast16", "auto", "compressor", "none"])
def test_a_built_in_renamed_or_reserved_name_cannot_be_taken(name):
    with pytest.raises(ValueError, match="built-in"):
        fastcomm.add_compressor(name, QuantCompressor)


def test_every_hook_name_is_a_compressor_name_or_reserved():
    # so no compressor a user adds can take a name register() gives to a hook
    assert {name.value for name in HookName} <= set(registry.BUILT_IN) | registry.RESERVED


# ------------------------------------------------------------------------------------------- hook names
def test_every_built_in_hook_name_is_a_row():
    assert [name.value for name in HookName] == list(HOOKS)[: len(HookName)]


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_a_name_registers_its_rows_state_and_hook(small_ddp, name):
    ddp = small_ddp()
    state = fastcomm.register(ddp, name, **_REQUIRED.get(name, {}))
    assert type(state) is HOOKS[name].state
    assert fastcomm.hooks.registry.hook_of(state) is HOOKS[name].hook


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_a_state_object_registers_with_its_rows_hook(small_ddp, name):
    state = fastcomm.hooks.registry.build_state(name, dict(_REQUIRED.get(name, {})))[0]
    assert fastcomm.register(small_ddp(), state) is state


def test_a_compressor_object_registers_through_compressor_hook(small_ddp):
    state = fastcomm.register(small_ddp(), fastcomm.compressor("cast", dtype=torch.float16), start_iter=2)
    assert type(state) is fastcomm.hooks.CompressorState
    assert state.compressor == CastCompressor(torch.float16) and state.start_iter == 2
    with pytest.raises(TypeError, match="multiple values"):
        fastcomm.register(small_ddp(), CastCompressor(), compressor=SignCompressor())


def test_something_else_is_a_type_error_naming_what_register_takes(small_ddp):
    with pytest.raises(TypeError, match="a hook's name, a compressor, a hook state"):
        fastcomm.register(small_ddp(), 8)


def test_the_renamed_hook_name_warns_and_serves_its_compressor_by_compressor_hook(small_ddp):
    with pytest.warns(
        DeprecationWarning, match=r"register\(ddp, 'cast16'\) is deprecated.*compressor\('cast'"
    ):
        state = fastcomm.register(small_ddp(), "cast16", dtype=torch.float16, min_compress_numel=0)
    assert type(state) is fastcomm.hooks.CompressorState
    assert state.compressor == CastCompressor(torch.float16) and state.min_compress_numel == 0


def test_powersgd_by_name_is_the_documented_powersgd_state(small_ddp):
    state = fastcomm.register(small_ddp(), "powersgd", rank=2, start_iter=3)
    assert type(state) is fastcomm.PowerSGDState
    assert (state.rank, state.start_iter) == (2, 3)
    assert HOOKS["powersgd"].hook is fastcomm.powersgd_hook


def test_a_hook_name_member_resolves_as_its_value(small_ddp):
    assert type(fastcomm.register(small_ddp(), HookName.POWERSGD)) is fastcomm.PowerSGDState
    assert HOOKS[HookName.SIGN] is HOOKS["sign"]


def test_an_unknown_name_lists_the_table(small_ddp):
    with pytest.raises(ValueError, match=r"unknown hook 'nope'; known hooks: .*'powersgd'.*'compressor'"):
        fastcomm.register(small_ddp(), "nope")


def test_a_powersgd_checkpoint_saved_as_a_compressor_state_loads_into_powersgd_state(small_ddp):
    # register(ddp, "powersgd") built a CompressorState before the one table; its checkpoints still load
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
