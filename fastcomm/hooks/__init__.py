"""DDP communication hooks, one family per file, each with its State class beside its hook function."""

from fastcomm.hooks._state import CompressionState, HookState, default_state
from fastcomm.hooks.cast import CastState, cast_hook
from fastcomm.hooks.quantize import QuantState, quantize_hook
from fastcomm.hooks.registry import HOOKS, HookName, register
from fastcomm.hooks.sign import SignState, sign_hook
from fastcomm.hooks.topk import TopKState, topk_hook

__all__ = [
    "HOOKS",
    "CastState",
    "CompressionState",
    "HookName",
    "HookState",
    "QuantState",
    "SignState",
    "TopKState",
    "cast_hook",
    "default_state",
    "quantize_hook",
    "register",
    "sign_hook",
    "topk_hook",
]
