"""The one table of hook names: each name gives one state class and one hook (:data:`HOOKS`).

A built-in hook is a row naming its state class; a compressor served by
:func:`~fastcomm.hooks.compressor.compressor_hook` is a row naming its factory, and
:func:`add_compressor` adds such rows. :func:`fastcomm.register`, ``CompressedAdam``'s hook and the
Lightning callback all read this table, so a name means the same thing everywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fastcomm.compress.cast import CastCompressor
from fastcomm.compress.powersgd import PowerSGDCompressor
from fastcomm.compress.protocol import AllreduceCompressor, Compressor
from fastcomm.compress.quantize import QuantCompressor
from fastcomm.compress.sign import SignCompressor
from fastcomm.hooks.auto import AutoState, auto_hook
from fastcomm.hooks.cast import CastState, cast_hook
from fastcomm.hooks.compressor import CompressorState, compressor_hook
from fastcomm.hooks.engine.state import HookState
from fastcomm.hooks.powersgd import PowerSGDState, powersgd_hook
from fastcomm.hooks.quantize import QuantState, quantize_hook
from fastcomm.hooks.sign import SignState, sign_hook
from fastcomm.hooks.topk import TopKState, topk_hook

__all__ = ["HOOKS", "HookName", "Registered", "add_compressor", "build_state", "compressor_of", "hook_of"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
CompressorFactory = Callable[..., Compressor | AllreduceCompressor]


class HookName(str, enum.Enum):
    """The built-in hooks :func:`fastcomm.register` knows, by name."""

    TOPK = "topk"
    QUANTIZE = "quantize"
    SIGN = "sign"
    CAST = "cast"
    POWERSGD = "powersgd"
    AUTO = "auto"


# the options a compressor row's CompressorState takes; the others go to the compressor's factory
_STATE_OPTIONS = frozenset((*CompressorState._OPTIONS, "process_group")) - {"compressor"}


@dataclass(frozen=True)
class Registered:
    """What a name resolves to: its state class and hook, and for a compressor row its factory."""

    state: type[HookState]
    hook: Hook
    compressor: CompressorFactory | None = None
    # a built-in hook's exchange as a compressor of flat tensors (fastcomm.collectives), from its options
    flat: CompressorFactory | None = None

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


def _quantize(bits: int = 8, block: int = 256, stochastic: bool = True) -> QuantCompressor:
    return QuantCompressor(bits, block, stochastic)


def _sign(chunk: int = 2048) -> SignCompressor:
    return SignCompressor(chunk)


def _cast(dtype: torch.dtype = torch.bfloat16) -> CastCompressor:
    return CastCompressor(dtype)


def _powersgd(rank: int = 4, warm_start: bool = True, orthogonalization: str = "qr") -> PowerSGDCompressor:
    return PowerSGDCompressor(rank, warm_start, orthogonalization)


HOOKS: dict[str, Registered] = {
    HookName.TOPK.value: Registered(TopKState, topk_hook),
    HookName.QUANTIZE.value: Registered(QuantState, quantize_hook, flat=_quantize),
    HookName.SIGN.value: Registered(SignState, sign_hook, flat=_sign),
    HookName.CAST.value: Registered(CastState, cast_hook, flat=_cast),
    HookName.POWERSGD.value: Registered(PowerSGDState, powersgd_hook, flat=_powersgd),
    HookName.AUTO.value: Registered(AutoState, auto_hook),
    # cast_hook's bf16/fp16 as a compressor: error feedback, node_size
    "cast16": Registered(CompressorState, compressor_hook, CastCompressor),
}


def add_compressor(name: str, factory: CompressorFactory) -> None:
    """Make ``fastcomm.register(ddp, name, **options)`` serve ``factory(**options)`` by ``compressor_hook``.

    Args:
        name: the name to register under (not a built-in hook's).
        factory: the compressor class (or any callable returning a :class:`~fastcomm.compress.Compressor`).

    Raises:
        ValueError: ``name`` is a built-in hook's or already taken by another factory.

    Example::

        fastcomm.hooks.add_compressor("half", HalfCompressor)
        state = fastcomm.register(ddp, "half", min_compress_numel=0)
    """
    if name in {h.value for h in HookName}:
        raise ValueError(f"{name!r} is a built-in hook's name")
    taken = HOOKS.get(name)
    if taken is not None and taken.compressor is not factory:
        raise ValueError(f"a compressor is already registered as {name!r}: {taken.compressor!r}")
    HOOKS[name] = Registered(CompressorState, compressor_hook, factory)


def build_state(name: str, options: dict[str, Any]) -> tuple[HookState, Hook]:
    """The state built from ``options`` and the hook that ``name`` stands for.

    Raises:
        ValueError: ``name`` is in no row, listing the names there are.
        TypeError: an option the state (or the compressor) does not take.
    """
    key = name.value if isinstance(name, HookName) else name
    registered = HOOKS.get(key) if isinstance(key, str) else None
    if registered is None:
        known = ", ".join(repr(n) for n in HOOKS)
        raise ValueError(f"unknown hook {name!r}; known hooks: {known}")
    return registered.build(key, options), registered.hook


def compressor_of(name: str | HookName, options: dict[str, Any]) -> Compressor | AllreduceCompressor:
    """The compressor of flat tensors that ``name`` stands for (for :mod:`fastcomm.collectives` users).

    A built-in hook gives its exchange's compressor from its compression options (``"quantize"``:
    ``bits``, ``block``, ``stochastic``; ``"sign"``: ``chunk``; ``"cast"``: ``dtype``; ``"powersgd"``:
    ``rank``, ``warm_start``, ``orthogonalization``); a compressor row, its factory's.

    Raises:
        ValueError: ``name`` is in no row, or is ``"topk"`` (its k is a fraction of a bucket).
        TypeError: an option the compressor does not take, naming ``name``.

    Example::

        compressor = fastcomm.hooks.compressor_of("quantize", {"bits": 4})
    """
    key = name.value if isinstance(name, HookName) else name
    registered = HOOKS.get(key) if isinstance(key, str) else None
    if registered is None:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(repr(n) for n in HOOKS)}")
    factory = registered.compressor or registered.flat
    if factory is None:
        raise ValueError(
            f"{key!r} has no compressor of flat tensors (top-k keeps a fraction of each bucket): pass "
            f"fastcomm.compress.TopKCompressor(k=...) itself"
        )
    try:
        return factory(**options)
    except TypeError as error:
        raise TypeError(f"compressor {key!r}: {error}") from error


def hook_of(state: HookState) -> Hook:
    """The hook that serves ``state``, by its exact class; ``TypeError`` when no row's class is it."""
    hook = next((row.hook for row in HOOKS.values() if type(state) is row.state), None)
    if hook is None:
        raise TypeError(f"no fastcomm hook takes a {type(state).__name__}")
    return hook
