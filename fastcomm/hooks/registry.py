"""Hook names and :func:`register`: one call that builds a state and registers its hook on a DDP model."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fastcomm.compress.cast import CastCompressor
from fastcomm.compress.powersgd import PowerSGDCompressor
from fastcomm.compress.protocol import AllreduceCompressor, Compressor
from fastcomm.hooks._base import HookState
from fastcomm.hooks._registered import refuse_second_hook
from fastcomm.hooks.cast import CastState, cast_hook
from fastcomm.hooks.compressor import CompressorState, compressor_hook
from fastcomm.hooks.quantize import QuantState, quantize_hook
from fastcomm.hooks.sign import SignState, sign_hook
from fastcomm.hooks.topk import TopKState, topk_hook
from fastcomm.optim import CompressedAdam

__all__ = ["COMPRESSORS", "HOOKS", "HookName", "add_compressor", "register"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class HookName(str, enum.Enum):
    """The hooks :func:`register` knows, by name."""

    TOPK = "topk"
    QUANTIZE = "quantize"
    SIGN = "sign"
    CAST = "cast"


HOOKS: dict[HookName, tuple[type[HookState], Hook]] = {
    HookName.TOPK: (TopKState, topk_hook),
    HookName.QUANTIZE: (QuantState, quantize_hook),
    HookName.SIGN: (SignState, sign_hook),
    HookName.CAST: (CastState, cast_hook),
}

# compressors served by compressor_hook, by name: a new compressor is its own file plus one line here
COMPRESSORS: dict[str, Callable[..., Compressor | AllreduceCompressor]] = {
    "powersgd": PowerSGDCompressor,
    "cast16": CastCompressor,  # cast_hook's bf16/fp16 as a compressor: error feedback, node_size
}

# the options register() gives the CompressorState of a named compressor; the others go to the compressor
_STATE_OPTIONS = frozenset((*CompressorState._OPTIONS, "process_group")) - {"compressor"}


def add_compressor(name: str, factory: Callable[..., Compressor]) -> None:
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
    if COMPRESSORS.get(name, factory) is not factory:
        raise ValueError(f"a compressor is already registered as {name!r}: {COMPRESSORS[name]!r}")
    COMPRESSORS[name] = factory


def register(
    ddp: DistributedDataParallel, name: str | HookName | HookState | torch.optim.Optimizer, **options: Any
) -> Any:
    """Build the named hook's state from ``options``, bind it to ``ddp``'s model and register the hook.

    1. Resolve ``name`` (a :class:`HookName`, its string value, an existing state object, or a
       :class:`~fastcomm.CompressedAdam`, whose compressed-momentum hook is registered; ``options`` are then
       ``grad_scaler=`` and ``process_group=``).
    2. Build the state (``ValueError`` for a bad option) or take the given one.
    3. Bind the state to the model's parameters (``ValueError`` if it already serves another model).
    4. ``ddp.register_comm_hook(state, hook)`` (``ValueError`` naming the hook ``ddp`` already has).

    Args:
        ddp: the DistributedDataParallel model.
        name: ``"topk"``, ``"quantize"``, ``"sign"`` or ``"cast"``, a name in :data:`COMPRESSORS` (or a
            state to register as is, or a ``fastcomm.CompressedAdam``).
        **options: the state's constructor arguments (not allowed with a state object); for a named
            compressor, the :class:`CompressorState` options and the compressor's own.

    Returns:
        The state, for ``stats()``, ``state_dict()`` and checkpoints.

    Example::

        state = fastcomm.register(ddp, "topk", ratio=0.01, start_iter=10)
        ...
        print(state.stats()["compression_ratio"])
    """
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"register needs a DistributedDataParallel model, got {type(ddp).__name__}")
    if isinstance(name, torch.optim.Optimizer):
        from fastcomm.hooks.momentum import register_optimizer

        if not isinstance(name, CompressedAdam):
            raise TypeError(f"register takes a fastcomm.CompressedAdam optimizer, got {type(name).__name__}")
        refuse_second_hook(ddp)
        return register_optimizer(ddp, name, **options)
    if isinstance(name, HookState):
        if options:
            raise TypeError("options cannot be given together with a state object")
        state = name
        from fastcomm.hooks.powersgd import PowerSGDState, powersgd_hook  # noqa: PLC0415 (imports registry)

        known = [*HOOKS.values(), (CompressorState, compressor_hook), (PowerSGDState, powersgd_hook)]
        hook = next((h for cls, h in known if type(state) is cls), None)
        if hook is None:
            raise TypeError(f"no fastcomm hook takes a {type(state).__name__}")
    elif isinstance(name, str) and name in COMPRESSORS:
        state_options = {k: v for k, v in options.items() if k in _STATE_OPTIONS}
        compressor_options = {k: v for k, v in options.items() if k not in _STATE_OPTIONS}
        try:
            compressor = COMPRESSORS[name](**compressor_options)
        except TypeError as error:
            raise TypeError(
                f"register(ddp, {name!r}): {error}; its options: the compressor's own and "
                f"{', '.join(sorted(_STATE_OPTIONS))}"
            ) from error
        state, hook = CompressorState(compressor, **state_options), compressor_hook
    else:
        try:
            hook_name = HookName(name)
        except ValueError:
            known = ", ".join(repr(n) for n in [*(h.value for h in HookName), *COMPRESSORS])
            raise ValueError(f"unknown hook {name!r}; known hooks: {known}") from None
        cls, hook = HOOKS[hook_name]
        valid = (*cls._OPTIONS, "process_group")
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise TypeError(
                f"register(ddp, {hook_name.value!r}): {cls.__name__} takes no option "
                f"{', '.join(map(repr, unknown))}; its options: {', '.join(valid)}"
            )
        state = cls(**options)
    refuse_second_hook(ddp)
    state.bind(ddp.module)
    ddp.register_comm_hook(state, hook)
    return state
