"""``fastcomm.register``'s errors name the hook and say what to do (one gloo rank, in this process)."""

from __future__ import annotations

import pytest

import fastcomm


@pytest.mark.parametrize(
    ("hook", "option", "valid"),
    [
        ("sign", "bits", "chunk"),
        ("topk", "bits", "ratio"),
        ("quantize", "ratio", "bits"),
        ("cast", "bits", "dtype"),
    ],
)
def test_an_option_the_hook_lacks_names_the_hook_and_its_options(small_ddp, hook, option, valid):
    with pytest.raises(TypeError) as caught:
        fastcomm.register(small_ddp(), hook, **{option: 8})
    message = str(caught.value)
    assert f"register(ddp, '{hook}')" in message and repr(option) in message, message
    assert valid in message and "process_group" in message, message


def test_a_compressor_option_it_lacks_names_the_compressor(small_ddp):
    with pytest.raises(TypeError, match=r"register\(ddp, 'powersgd'\).*bits"):
        fastcomm.register(small_ddp(), "powersgd", bits=8)


@pytest.mark.parametrize("first", ["topk", "sign", "torch_allreduce"])
def test_a_second_hook_names_the_one_the_model_has(small_ddp, first):
    ddp = small_ddp()
    if first == "torch_allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
        name = "allreduce_hook"
    else:
        fastcomm.register(ddp, first)
        name = f"{first}_hook"
    with pytest.raises(ValueError, match=rf"already has a comm hook registered \({name}\)"):
        fastcomm.register(ddp, "quantize")


def test_a_second_hook_from_compressed_adam_names_the_one_the_model_has(small_ddp):
    ddp = small_ddp()
    fastcomm.register(ddp, "sign")
    optimizer = fastcomm.CompressedAdam(ddp.parameters(), lr=1e-3, warmup_steps=2)
    with pytest.raises(ValueError, match=r"already has a comm hook registered \(sign_hook\)"):
        fastcomm.register(ddp, optimizer)
