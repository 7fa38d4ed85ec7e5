"""The one table of compressor names: each name gives one compressor factory (:func:`compressor`).

DDP hooks (``fastcomm.register``), FSDP (``fastcomm.fsdp.compress``), DiLoCo and the collectives all look
compressor names up here, so a name means the same compressor everywhere. A user's compressor is one call
to :func:`add_compressor`. A name that was renamed keeps working for one release, with a
``DeprecationWarning`` that names its successor.

Example::

    q4 = fastcomm.compressor("quantize", bits=4)
    fastcomm.add_compressor("half", HalfCompressor)
    half = fastcomm.compressor("half")
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fastcomm.compress.cast import CastCompressor
from fastcomm.compress.powersgd import PowerSGDCompressor
from fastcomm.compress.protocol import AllreduceCompressor, Compressor
from fastcomm.compress.quantize import QuantCompressor
from fastcomm.compress.sign import SignCompressor
from fastcomm.compress.sparseloco import SparseLoCoCompressor
from fastcomm.compress.topk import TopKCompressor

__all__ = [
    "BUILT_IN",
    "LABELLED_BY",
    "RENAMED",
    "RESERVED",
    "CompressorFactory",
    "add_compressor",
    "compressor",
    "compressor_of",
    "factory_of",
    "label",
    "names",
]

CompressorFactory = Callable[..., Compressor | AllreduceCompressor]

# the vocabulary: name -> factory (the class itself: its keyword arguments are the name's options)
BUILT_IN: Mapping[str, CompressorFactory] = {
    "topk": TopKCompressor,
    "quantize": QuantCompressor,
    "sign": SignCompressor,
    "cast": CastCompressor,
    "powersgd": PowerSGDCompressor,
    "sparseloco": SparseLoCoCompressor,
}

# old name -> its successor; the old name is served, with a DeprecationWarning, until the next release
RENAMED: Mapping[str, str] = {"cast16": "cast"}

# names the layers above give another meaning, so no compressor may take them: register's hooks
# ("auto": the measured choice; "compressor": any compressor object) and DiLoCo's "none" (no compression)
RESERVED = frozenset({"auto", "compressor", "none"})

# the option that tells apart the compressors of one name, always in its label: name -> (option, prefix)
# (topk's "ratio" is the hooks' option: the compressor takes a k, which the hooks derive from it)
LABELLED_BY: Mapping[str, tuple[str, str]] = {
    "topk": ("ratio", ""),
    "quantize": ("bits", ""),
    "cast": ("dtype", "_"),
    "powersgd": ("rank", "_r"),
}

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}

_added: dict[str, CompressorFactory] = {}


def names() -> tuple[str, ...]:
    """Every name :func:`compressor` takes today: the built-in vocabulary, then the added ones in order.

    Renamed names are left out (they still resolve, with a warning).

    Example::

        >>> fastcomm.compress.registry.names()[:5]
        ('topk', 'quantize', 'sign', 'cast', 'powersgd')
    """
    return (*BUILT_IN, *_added)


def factory_of(name: str, stacklevel: int = 2) -> tuple[str, CompressorFactory]:
    """``(current name, factory)`` of ``name``; a renamed one warns (``DeprecationWarning``) and resolves.

    Args:
        name: a compressor's name.
        stacklevel: where the warning points (2: at the caller of this function).

    Raises:
        ValueError: no compressor has this name; the message lists the names there are.

    Example::

        >>> fastcomm.compress.registry.factory_of("sign")
        ('sign', <class 'fastcomm.compress.sign.SignCompressor'>)
    """
    if isinstance(name, str) and name in RENAMED:
        new = RENAMED[name]
        warnings.warn(
            f"the compressor name {name!r} is deprecated and goes in the next release: use {new!r} "
            f"(fastcomm.compressor({new!r}, ...))",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        name = new
    factory = (BUILT_IN.get(name) or _added.get(name)) if isinstance(name, str) else None
    if factory is None:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(map(repr, names()))}")
    return name, factory


def _build(
    name: str, factory: CompressorFactory, options: Mapping[str, Any]
) -> Compressor | AllreduceCompressor:
    try:
        return factory(**options)
    except TypeError as error:
        try:
            takes = ", ".join(inspect.signature(factory).parameters) or "none"
        except (TypeError, ValueError):  # a builtin or C callable without a signature
            takes = "see its factory"
        raise TypeError(f"compressor {name!r}: {error}; its options: {takes}") from error


def compressor(name: str, **options: Any) -> Compressor | AllreduceCompressor:
    """The compressor called ``name``, built from ``options``.

    The names, their options and payloads are the table in :mod:`fastcomm.compress`.

    Args:
        name: a built-in name, one added by :func:`add_compressor`, or a renamed one (warns).
        **options: the compressor's own options.

    Raises:
        ValueError: an unknown name (listing the known ones), or an option's bad value.
        TypeError: an option the compressor does not take (listing the ones it does).

    Example::

        q4 = fastcomm.compressor("quantize", bits=4)
        payload = torch.empty(q4.wire_bytes(1024, torch.float32), dtype=torch.uint8)
    """
    name, factory = factory_of(name, stacklevel=3)
    return _build(name, factory, options)


def compressor_of(name: str, options: Mapping[str, Any]) -> Compressor | AllreduceCompressor:
    """:func:`compressor` with the options as one mapping (for callers that carry them as a dict).

    Example::

        compressor = fastcomm.compress.compressor_of("quantize", {"bits": 4})
    """
    name, factory = factory_of(name, stacklevel=3)
    return _build(name, factory, options)


def _text(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return _DTYPES.get(value, str(value).removeprefix("torch."))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _defaults(factory: CompressorFactory) -> dict[str, Any]:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return {}
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def label(name: str, **options: Any) -> str:
    """The short name of the compressor ``name`` built from ``options``: one label per configuration.

    The advisor's rows (``fastcomm.advise.METHODS``), the "auto" hook's candidates and its ``stats()`` keys
    and the benchmarks' rows are named by it. The label is the name, then the value of the option that
    tells its compressors apart (:data:`LABELLED_BY`; its default when not given), then each other option
    that differs from its default as ``_<option>=<value>``, in alphabetical order. Options equal to their
    defaults are left out, so equal configurations get equal labels.

    Args:
        name: a compressor's name (a renamed one warns and gives its successor's label).
        **options: its options (the compressor's own, or topk's ``ratio``).

    Raises:
        ValueError: no compressor has this name.

    Example::

        >>> label("quantize", bits=8), label("quantize", bits=4, block=128), label("topk", ratio=0.01)
        ('quantize8', 'quantize4_block=128', 'topk0.01')
        >>> label("cast"), label("cast", dtype=torch.float16), label("powersgd", rank=4), label("sign")
        ('cast_bf16', 'cast_fp16', 'powersgd_r4', 'sign')
    """
    name, factory = factory_of(name, stacklevel=3)
    defaults = _defaults(factory)
    head, prefix = LABELLED_BY.get(name, ("", ""))
    text = name
    if head in options or head in defaults:
        text += prefix + _text(options.get(head, defaults.get(head)))
    for key in sorted(options):
        if key != head and not (key in defaults and options[key] == defaults[key]):
            text += f"_{key}={_text(options[key])}"
    return text


def add_compressor(name: str, factory: CompressorFactory) -> None:
    """Give ``factory`` (a compressor class, or a callable returning one) the name ``name``, everywhere.

    Then ``fastcomm.compressor(name, **options)``, ``fastcomm.register(ddp, name, **options)`` (served by
    ``compressor_hook``), ``fastcomm.fsdp.compress(model, name)`` and ``DiLoCo(..., compressor=name)`` all
    build ``factory(**options)``. Adding the same factory under the same name again changes nothing.

    Raises:
        ValueError: ``name`` is a built-in, renamed or reserved one (``"auto"``, ``"compressor"``,
            ``"none"``), or another factory already has it.

    Example::

        fastcomm.add_compressor("half", HalfCompressor)
        state = fastcomm.register(ddp, "half", min_compress_numel=0)
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a compressor's name is a non-empty str, got {name!r}")
    if name in BUILT_IN or name in RENAMED or name in RESERVED:
        raise ValueError(f"{name!r} is a built-in name; pick another for your compressor")
    if not callable(factory):
        raise ValueError(f"factory must be callable (a compressor class or function), got {factory!r}")
    taken = _added.get(name)
    if taken is not None and taken is not factory:
        raise ValueError(f"a compressor is already registered as {name!r}: {taken!r}")
    _added[name] = factory
