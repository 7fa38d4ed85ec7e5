"""The table of hook names: each name gives one state class and one hook (:data:`HOOKS`).

What is hook-specific lives here: the built-in hooks by name (:class:`HookName`), each with its state class
and hook function. Compressor names live in :mod:`fastcomm.compress.registry`, the only table that knows
them; a compressor name without a hook of its own (one added by :func:`fastcomm.add_compressor`) is served
by :func:`~fastcomm.hooks.compressor.compressor_hook` with a
:class:`~fastcomm.hooks.compressor.CompressorState`, and :data:`HOOKS` shows it as such a row, read from that
table. :func:`fastcomm.register`, ``CompressedAdam``'s hook and the Lightning callback all read
:data:`HOOKS`, so a name means the same thing everywhere.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fastcomm.compress import registry
from fastcomm.compress.registry import CompressorFactory
from fastcomm.hooks.auto import AutoState, auto_hook
from fastcomm.hooks.cast import CastState, cast_hook
from fastcomm.hooks.compressor import CompressorState, compressor_hook
from fastcomm.hooks.engine.state import HookState
from fastcomm.hooks.powersgd import PowerSGDState, powersgd_hook
from fastcomm.hooks.quantize import QuantState, quantize_hook
from fastcomm.hooks.sign import SignState, sign_hook
from fastcomm.hooks.topk import TopKState, topk_hook

__all__ = ["HOOKS", "HookName", "Registered", "build_state", "hook_of"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class HookName(str, enum.Enum):
    """The built-in hooks :func:`fastcomm.register` knows, by name."""

    TOPK = "topk"
    QUANTIZE = "quantize"
    SIGN = "sign"
    CAST = "cast"
    POWERSGD = "powersgd"
    AUTO = "auto"
    COMPRESSOR = "compressor"  # any compressor object: register(ddp, "compressor", compressor=...)


# the options a compressor row's CompressorState takes; the others go to the compressor's factory
_STATE_OPTIONS = frozenset((*CompressorState._OPTIONS, "process_group")) - {"compressor"}


@dataclass(frozen=True)
class Registered:
    """What a name resolves to: its state class and hook, and for a compressor's name its factory."""

    state: type[HookState]
    hook: Hook
    compressor: CompressorFactory | None = None

    def build(self, name: str, options: dict[str, Any]) -> HookState:
        """The state for ``register(ddp, name, **options)``; a bad option: ``TypeError`` naming ``name``."""
        if self.compressor is None:
            valid = (*self.state._OPTIONS, "process_group")
            unknown = sorted(set(options) - set(valid))
            if unknown:
                raise TypeError(
                    f"register(ddp, {name!r}): {self.state.__name__} takes no option "
                    f"{', '.join(map(repr, unknown))}; its options: {', '.join(valid)}"
                )
            return self.state(**options)
        state_options = {k: v for k, v in options.items() if k in _STATE_OPTIONS}
        compressor_options = {k: v for k, v in options.items() if k not in _STATE_OPTIONS}
        try:
            compressor = self.compressor(**compressor_options)
        except TypeError as error:
            raise TypeError(
                f"register(ddp, {name!r}): {error}; its options: the compressor's own and "
                f"{', '.join(sorted(_STATE_OPTIONS))}"
            ) from error
        return CompressorState(compressor, **state_options)


_HOOK_ROWS: dict[str, Registered] = {
    HookName.TOPK.value: Registered(TopKState, topk_hook),
    HookName.QUANTIZE.value: Registered(QuantState, quantize_hook),
    HookName.SIGN.value: Registered(SignState, sign_hook),
    HookName.CAST.value: Registered(CastState, cast_hook),
    HookName.POWERSGD.value: Registered(PowerSGDState, powersgd_hook),
    HookName.AUTO.value: Registered(AutoState, auto_hook),
    HookName.COMPRESSOR.value: Registered(CompressorState, compressor_hook),
}


def _key(name: Any) -> Any:
    return name.value if isinstance(name, HookName) else name


class _HookTable(Mapping[str, Registered]):
    """The hook rows, then one row per compressor name that has no hook of its own (read, not copied)."""

    def __getitem__(self, name: str) -> Registered:
        key = _key(name)
        row = _HOOK_ROWS.get(key) if isinstance(key, str) else None
        if row is not None:
            return row
        if isinstance(key, str) and key in registry.names():
            return Registered(CompressorState, compressor_hook, registry.factory_of(key)[1])
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        yield from _HOOK_ROWS
        yield from (name for name in registry.names() if name not in _HOOK_ROWS)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"HOOKS({', '.join(map(repr, self))})"


HOOKS: Mapping[str, Registered] = _HookTable()


def _renamed_row(key: str) -> Registered:
    """The row of a renamed compressor name (``"cast16"``): its compressor through ``compressor_hook``."""
    new = registry.RENAMED[key]
    message = (
        f"register(ddp, {key!r}) is deprecated and goes in the next release: use "
        f"register(ddp, fastcomm.compressor({new!r}, ...), **options), which serves that compressor by "
        f"compressor_hook as {key!r} did"
    )
    if new in _HOOK_ROWS:
        message += f" (register(ddp, {new!r}) is {_HOOK_ROWS[new].hook.__name__}, another exchange)"
    # stacklevel 4: the caller of register(), which called build_state
    warnings.warn(message, DeprecationWarning, stacklevel=4)
    return Registered(CompressorState, compressor_hook, registry.factory_of(new)[1])


def build_state(name: str, options: dict[str, Any]) -> tuple[HookState, Hook]:
    """The state built from ``options`` and the hook that ``name`` stands for.

    Raises:
        ValueError: ``name`` is in no row, listing the names there are.
        TypeError: an option the state (or the compressor) does not take.
    """
    key = _key(name)
    registered = HOOKS.get(key) if isinstance(key, str) else None
    if registered is None and isinstance(key, str) and key in registry.RENAMED:
        registered = _renamed_row(key)
    if registered is None:
        known = ", ".join(repr(n) for n in HOOKS)
        raise ValueError(f"unknown hook {name!r}; known hooks: {known}")
    return registered.build(key, options), registered.hook


def hook_of(state: HookState) -> Hook:
    """The hook that serves ``state``, by its exact class; ``TypeError`` when no row's class is it."""
    hook = next((row.hook for row in HOOKS.values() if type(state) is row.state), None)
    if hook is None:
        raise TypeError(f"no fastcomm hook takes a {type(state).__name__}")
    return hook
