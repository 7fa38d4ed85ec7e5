"""The seeds of stochastic rounding and random-k: one formula, for the DDP hooks, FSDP, DiLoCo and a call.

A compressed exchange draws its randomness from one integer, :func:`exchange_seed` of a *stream* (which
tensor at which step: the same on every rank), the rank and the phase (1: what a rank sends, 2: the
reduced segment it sends back), and then one per piece of it (:func:`piece_seed`). Each mode names its
stream from what it knows, so that a resume, on any rank, draws the same numbers again:

=================================  ===========================================================================
mode                               stream
=================================  ===========================================================================
DDP hooks                          :func:`bucket_stream` (seed option, step, the bucket's first parameter)
FSDP (a parameter group's call)    :func:`group_stream` (seed option, group index, calls so far)
DiLoCo (a fragment's all-reduce)   the outer step
a plain ``fastcomm.collectives``   the call's ``seed`` argument
=================================  ===========================================================================

Example::

    seed = exchange_seed(bucket_stream(0, step, key[0]), rank, phase=1)
"""

from __future__ import annotations

__all__ = ["bucket_stream", "exchange_seed", "group_stream", "piece_seed"]

_MODULUS = 2**62


def exchange_seed(stream: int, rank: int, phase: int) -> int:
    """The seed of ``rank``'s compression in ``phase`` (1 or 2) of an exchange of ``stream``.

    Example::

        >>> exchange_seed(5, 1, 2)
        81986
    """
    return ((stream * 4_099 + rank) * 4 + phase) % _MODULUS


def bucket_stream(seed: int, step: int, first_param: int) -> int:
    """A DDP hook's stream: its ``seed`` option, the step, and the key of the bucket's first parameter.

    Example::

        >>> bucket_stream(0, 3, 7)
        196618
    """
    return ((seed * 1_000_003 + step) * 65_537 + first_param) % _MODULUS


def group_stream(seed: int, index: int, calls: int) -> int:
    """An FSDP reduction's stream: its ``seed`` option, its parameter group's index and its calls so far.

    Example::

        >>> group_stream(0, 1, 2)
        1000005
    """
    return ((seed * 7_919 + index) * 1_000_003 + calls) % (2**61)


def piece_seed(base: int, index: int) -> int:
    """The seed of piece ``index`` of an exchange seeded ``base`` (:func:`exchange_seed`).

    Example::

        >>> piece_seed(0, 0)
        0
    """
    return (base ^ (index * 0x9E3779B97F4A7C15)) % _MODULUS
