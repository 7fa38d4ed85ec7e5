"""Type and range checks of the hook states' constructor options, each error naming the option and the value.

Types are checked, not only values: ``bits=8.0`` or ``chunk=True`` would pass a range check and fail later,
inside backward, with an error that names neither. ``bool`` is a subclass of ``int`` in Python, so every
integer check rejects it explicitly; a float never stands in for an int. A wrong type raises
:class:`OptionTypeError`, both a ``TypeError`` and a ``ValueError``: the states document ``ValueError`` for
a bad option, and code catching that keeps working.

Example::

    >>> require_int("block", 256, minimum=1)
    256
    >>> require_int("block", 256.0, minimum=1)
    Traceback (most recent call last):
    ...
    fastcomm.hooks.engine.options.OptionTypeError: block must be an int, got 256.0 (float)
"""

from __future__ import annotations

import numbers
from typing import TypeGuard

__all__ = ["OptionTypeError", "is_real", "require_bool", "require_int", "require_real"]


class OptionTypeError(TypeError, ValueError):
    """A state option of the wrong type (a ``ValueError`` too, as every bad option is)."""


def _got(value: object) -> str:
    return f"got {value!r} ({type(value).__name__})"


def require_bool(name: str, value: object) -> bool:
    """``value`` if it is a ``bool``; else :class:`OptionTypeError` naming ``name``."""
    if not isinstance(value, bool):
        raise OptionTypeError(f"{name} must be a bool (True or False), {_got(value)}")
    return value


def require_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool, not a float) of at least ``minimum``.

    Raises:
        OptionTypeError: not an integer.
        ValueError: below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionTypeError(f"{name} must be an int, {_got(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def is_real(value: object) -> TypeGuard[numbers.Real]:
    """Whether ``value`` is a real number: an int or a float (any ``numbers.Real``), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def require_real(name: str, value: object) -> float:
    """``value`` as a ``float`` if it is a real number (an int or a float, not a bool).

    Range checks stay with the caller, whose interval (open or closed) is part of the option's meaning.

    Raises:
        OptionTypeError: not a real number.
    """
    if not is_real(value):
        raise OptionTypeError(f"{name} must be a real number, {_got(value)}")
    return float(value)
