"""Triton kernels for top-k selection with error feedback, bit for bit ``reference.topk_select``.

The k-th largest magnitude key ``t`` (the bits of ``|float32(x + residual)|`` read as an int32) is found
without sorting, by a radix select on the device: digits of 11, 10 and 10 bits, most significant first;
for each, a histogram of the keys whose higher digits match those chosen so far, then a one-program kernel
that picks the digit holding the k-th key. Only the first digit is taken over every key: one pass then
gathers the keys that share it (about 1% of a gradient when k is 1%) and counts per span of elements those
above it, and the other digits are chosen among the gathered keys. The approximate mode runs the select on
a hashed sample (``reference`` defines its positions) for the sample's ``ceil(m * k / n)``-th key instead.

A scan over the spans' counts (torch ops on the device) gives each span its output offset and how many of
its ties it takes (the lowest indices first, as the reference breaks ties); the last pass writes the values,
the int32 indices and the new residual (``acc`` with the sent entries zeroed), reading ``x`` and the
residual's source a third time. Keys need no arithmetic beyond ``x + residual`` in ``x``'s dtype, so every
output is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastcomm import reference
from fastcomm.triton import _common
from fastcomm.triton._common import load_accumulated, to_float32

__all__ = ["topk_select"]

# (shift, digit bits) of the radix passes over the 31 bits of a magnitude key, most significant first.
_DIGITS = ((20, 11), (10, 10), (0, 10))
_KEY_MAX = 0x7FFFFFFF  # NaN with every payload bit set: no key lies above it


@dataclass(frozen=True)
class _Spans:
    """Launch shape: ``tiles`` tiles of ``block`` elements per program (a span), and the warps."""

    block: int
    tiles: int
    num_warps: int

    @property
    def span(self) -> int:
        return self.block * self.tiles


def _spans(n: int, tiles: int) -> _Spans:
    """The one place that sizes top-k's programs: ``tiles`` tiles of up to 1024 elements each."""
    block = min(1024, max(16, triton.next_power_of_2(n)))
    return _Spans(block=block, tiles=tiles, num_warps=max(1, min(8, block // 128)))


@triton.jit
def _keys(acc):
    """int32 keys whose order is the order of ``|float32(acc)|`` (NaN above inf), as the reference's."""
    return to_float32(acc).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _load_keys(x_ptr, source_ptr, index, mask, KEYS: tl.constexpr):
    """The keys at ``index``: read from ``x_ptr`` when it holds keys (``KEYS``), else of ``x + source``."""
    if KEYS:
        key = tl.load(x_ptr + index, mask=mask, other=0)
    else:
        key = _keys(load_accumulated(x_ptr, source_ptr, index, mask))
    return key


@triton.jit
def _span_tile(tile, n, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """Indices of tile ``tile`` of this program's span, and which exist."""
    index = (tl.program_id(0).to(tl.int64) * TILES + tile) * BLOCK + tl.arange(0, BLOCK)
    return index, index < n


@triton.jit
def _histogram_kernel(
    x_ptr, source_ptr, state_ptr, hist_ptr, n,
    SHIFT: tl.constexpr, DIGIT_BITS: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
    KEYS: tl.constexpr,
):  # fmt: skip
    """Adds to ``hist`` the digit ``(key >> SHIFT) & (2**DIGIT_BITS - 1)`` of the keys whose higher bits
    are the prefix ``state[0]`` chosen by the earlier passes."""
    prefix = tl.load(state_ptr)
    bins = tl.arange(0, 1 << DIGIT_BITS)
    counts = tl.zeros([1 << DIGIT_BITS], tl.int32)
    others = tl.zeros([BLOCK], tl.int32)
    for tile in range(TILES):
        index, mask = _span_tile(tile, n, BLOCK, TILES)
        key = _load_keys(x_ptr, source_ptr, index, mask, KEYS)
        match = mask & ((key >> (SHIFT + DIGIT_BITS)) == prefix)
        digit = tl.where(match, (key >> SHIFT) & ((1 << DIGIT_BITS) - 1), 0)
        counts += tl.histogram(digit, 1 << DIGIT_BITS)
        others += (~match).to(tl.int32)
    # Keys that do not match were counted in bin 0 (histogram's mask argument is not in every triton).
    counts -= tl.where(bins == 0, tl.sum(others, axis=0), 0)
    tl.atomic_add(hist_ptr + bins, counts, mask=counts > 0)


@triton.jit
def _choose_digit_kernel(hist_ptr, state_ptr, DIGIT_BITS: tl.constexpr):
    """One program: the digit holding the ``state[1]``-th largest matching key, appended to the prefix.

    ``above[d]`` counts the matching keys with a larger digit; the chosen ``d`` has ``above[d] < k <=
    above[d] + hist[d]``, and ``k`` becomes the rank among the keys with that digit.
    """
    bins = tl.arange(0, 1 << DIGIT_BITS)
    hist = tl.load(hist_ptr + bins).to(tl.int64)
    prefix = tl.load(state_ptr)
    k = tl.load(state_ptr + 1)
    above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)
    chosen = (above < k) & (above + hist >= k)
    digit = tl.max(tl.where(chosen, bins, -1), axis=0)
    tl.store(state_ptr, (prefix << DIGIT_BITS) | digit)
    tl.store(state_ptr + 1, k - tl.sum(tl.where(bins == digit, above, 0), axis=0))


@triton.jit
def _count_kernel(
    x_ptr, source_ptr, state_ptr, above_ptr, tied_ptr, n, BLOCK: tl.constexpr, TILES: tl.constexpr
):  # fmt: skip
    """Per span: how many keys lie above the threshold ``state[0]``, and how many equal it."""
    threshold = tl.load(state_ptr)
    above = tl.zeros([BLOCK], tl.int32)
    tied = tl.zeros([BLOCK], tl.int32)
    for tile in range(TILES):
        index, mask = _span_tile(tile, n, BLOCK, TILES)
        key = _keys(load_accumulated(x_ptr, source_ptr, index, mask))
        above += (mask & (key > threshold)).to(tl.int32)
        tied += (mask & (key == threshold)).to(tl.int32)
    tl.store(above_ptr + tl.program_id(0), tl.sum(above, axis=0))
    tl.store(tied_ptr + tl.program_id(0), tl.sum(tied, axis=0))


@triton.jit
def _gather_kernel(
    x_ptr, source_ptr, state_ptr, above_ptr, keys_ptr, index_ptr, count_ptr, n,
    SHIFT: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """Per span: how many keys lie above the first digit ``state[0]`` (``key >> SHIFT``); the keys with
    that digit and their indices are appended to the candidates (in any order, ``count`` is their end)."""
    digit = tl.load(state_ptr)
    above = tl.zeros([BLOCK], tl.int32)
    for tile in range(TILES):
        index, mask = _span_tile(tile, n, BLOCK, TILES)
        key = _keys(load_accumulated(x_ptr, source_ptr, index, mask))
        above += (mask & ((key >> SHIFT) > digit)).to(tl.int32)
        candidate = (mask & ((key >> SHIFT) == digit)).to(tl.int32)
        found = tl.sum(candidate, axis=0)
        first = tl.atomic_add(count_ptr, found, mask=found > 0)
        position = first + tl.cumsum(candidate, axis=0) - candidate
        tl.store(keys_ptr + position, key, mask=candidate != 0)
        tl.store(index_ptr + position, index.to(tl.int32), mask=candidate != 0)
    tl.store(above_ptr + tl.program_id(0), tl.sum(above, axis=0))


@triton.jit
def _candidate_counts_kernel(
    keys_ptr, index_ptr, state_ptr, above_ptr, tied_ptr, count, SPAN: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """Adds each candidate above the threshold ``state[0]``, or equal to it, to its span's count."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = at < count
    key = tl.load(keys_ptr + at, mask=ok, other=0)
    span = tl.load(index_ptr + at, mask=ok, other=0) // SPAN
    threshold = tl.load(state_ptr)
    one = tl.full([BLOCK], 1, tl.int32)
    tl.atomic_add(above_ptr + span, one, mask=ok & (key > threshold))
    tl.atomic_add(tied_ptr + span, one, mask=ok & (key == threshold))


@triton.jit
def _write_kernel(
    x_ptr, source_ptr, target_ptr, state_ptr, offset_ptr, taken_ptr, values_ptr, indices_ptr, n,
    BLOCK: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """Writes a span's selected values and indices at its offset, in index order, and its new residual.

    Selected: every key above the threshold, and the span's first ``taken`` keys equal to it.
    """
    threshold = tl.load(state_ptr)
    written = tl.load(offset_ptr + tl.program_id(0))
    ties_left = tl.load(taken_ptr + tl.program_id(0))
    for tile in range(TILES):
        index, mask = _span_tile(tile, n, BLOCK, TILES)
        acc = load_accumulated(x_ptr, source_ptr, index, mask)
        key = _keys(acc)
        tied = (mask & (key == threshold)).to(tl.int32)
        tie_rank = tl.cumsum(tied, axis=0) - tied
        take = (mask & (key > threshold)) | ((tied != 0) & (tie_rank < ties_left))
        chosen = take.to(tl.int32)
        position = written + tl.cumsum(chosen, axis=0) - chosen
        tl.store(values_ptr + position, acc, mask=take)
        tl.store(indices_ptr + position, index.to(tl.int32), mask=take)
        if target_ptr is not None:
            tl.store(target_ptr + index, tl.where(take, tl.zeros_like(acc), acc), mask=mask)
        written += tl.sum(chosen, axis=0)
        ties_left -= tl.sum(tied, axis=0)


@triton.jit
def _sample_kernel(
    x_ptr, source_ptr, sample_ptr, m, stride, BLOCK: tl.constexpr
):  # fmt: skip
    """``acc`` at one hashed position per stratum of ``stride`` elements: ``reference._approx_threshold``'s
    sample (``strata * stride + hash32(strata, 0) % stride``)."""
    strata = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = strata < m
    h = strata.to(tl.uint32) * 0x9E3779B1
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    position = strata * stride + (h.to(tl.int64) % stride)
    tl.store(sample_ptr + strata, load_accumulated(x_ptr, source_ptr, position, ok), mask=ok)


def _select_digits(
    keys: torch.Tensor, source: torch.Tensor | None, state: torch.Tensor, hists: torch.Tensor,
    digits: range, keys_given: bool,
) -> None:  # fmt: skip
    """Radix passes ``digits`` (positions in ``_DIGITS``) over ``keys``: each narrows ``state`` by a digit."""
    n = keys.numel()
    spans = _spans(n, tiles=16)
    grid = (triton.cdiv(n, spans.span),)
    for position in digits:
        shift, bits = _DIGITS[position]
        first = sum(1 << b for _, b in _DIGITS[:position])
        hist = hists[first : first + (1 << bits)]
        _histogram_kernel[grid](
            keys, source, state, hist, n, SHIFT=shift, DIGIT_BITS=bits, BLOCK=spans.block,
            TILES=spans.tiles, KEYS=keys_given, num_warps=spans.num_warps,
        )  # fmt: skip
        _choose_digit_kernel[(1,)](hist, state, DIGIT_BITS=bits, num_warps=4)


def _new_state(rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A radix select's state ``[prefix, rank]`` and its zeroed histograms, one per digit."""
    state = torch.tensor([0, rank], dtype=torch.int64, device=device)
    return state, torch.zeros(sum(1 << bits for _, bits in _DIGITS), dtype=torch.int32, device=device)


def _radix_select(flat: torch.Tensor, source: torch.Tensor | None, rank: int) -> torch.Tensor:
    """The device state ``[t, ties]``: the ``rank``-th largest key ``t`` of ``flat + source`` and how many
    keys equal to ``t`` the top ``rank`` hold (``1 <= rank <= flat.numel()``)."""
    state, hists = _new_state(rank, flat.device)
    _select_digits(flat, source, state, hists, range(len(_DIGITS)), keys_given=False)
    return state


def _counts(
    flat: torch.Tensor, source: torch.Tensor | None, state: torch.Tensor, spans: _Spans
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per span: the keys above the threshold ``state[0]`` and equal to it (one pass over ``x``)."""
    n = flat.numel()
    programs = triton.cdiv(n, spans.span)
    above = torch.empty(programs, dtype=torch.int32, device=flat.device)
    tied = torch.empty_like(above)
    if programs:
        _count_kernel[(programs,)](
            flat,
            source,
            state,
            above,
            tied,
            n,
            BLOCK=spans.block,
            TILES=spans.tiles,
            num_warps=spans.num_warps,
        )
    return above, tied


def _exact(
    flat: torch.Tensor, source: torch.Tensor | None, k: int, spans: _Spans
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact threshold state and the per-span counts, reading ``x`` three times in all (with the write).

    1. The first digit's histogram (one pass); its count of the digit holding the k-th key is read back.
    2. One pass counts per span the keys above that digit and gathers the keys with it (the candidates,
       about 1% of a gradient for k = 1%); the other digits are selected among the candidates only, and
       the candidates above or at the threshold are added to their spans' counts.

    When more than a quarter of the keys share the first digit (ties, a constant tensor), the candidates
    would cost more than they save: every digit and the counts then read ``x`` again.
    """
    n = flat.numel()
    state, hists = _new_state(k, flat.device)
    _select_digits(flat, source, state, hists, range(1), keys_given=False)
    candidates = int(hists[: 1 << _DIGITS[0][1]][state[0]])  # the one read-back of the exact mode
    if candidates > n // 4:
        _select_digits(flat, source, state, hists, range(1, len(_DIGITS)), keys_given=False)
        return (state, *_counts(flat, source, state, spans))
    programs = triton.cdiv(n, spans.span)
    above = torch.empty(programs, dtype=torch.int32, device=flat.device)
    tied = torch.zeros_like(above)
    keys = torch.empty(candidates, dtype=torch.int32, device=flat.device)
    where = torch.empty_like(keys)
    found = torch.zeros(1, dtype=torch.int32, device=flat.device)
    _gather_kernel[(programs,)](
        flat, source, state, above, keys, where, found, n, SHIFT=_DIGITS[0][0], BLOCK=spans.block,
        TILES=spans.tiles, num_warps=spans.num_warps,
    )  # fmt: skip
    _select_digits(keys, None, state, hists, range(1, len(_DIGITS)), keys_given=True)
    block = _spans(candidates, tiles=1)
    _candidate_counts_kernel[(triton.cdiv(candidates, block.block),)](
        keys, where, state, above, tied, candidates, SPAN=spans.span, BLOCK=block.block,
        num_warps=block.num_warps,
    )  # fmt: skip
    return state, above, tied


def _approximate_state(flat: torch.Tensor, source: torch.Tensor | None, k: int) -> torch.Tensor:
    """The state ``[t, n]`` of the approximate mode: every key ``>= t`` is sent (all ties taken)."""
    n = flat.numel()
    m = reference.approx_sample_size(n, k)
    sample = torch.empty(m, dtype=flat.dtype, device=flat.device)
    spans = _spans(m, tiles=1)
    _sample_kernel[(triton.cdiv(m, spans.block),)](
        flat, source, sample, m, n // m, BLOCK=spans.block, num_warps=spans.num_warps
    )
    state = _radix_select(sample, None, max(1, -(-m * k // n)))
    state[1] = n
    return state


def topk_select(
    x: torch.Tensor,
    k: int,
    residual: torch.Tensor | None = None,
    exact: bool = True,
    residual_source: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`fastcomm.reference.topk_select` (same arguments, same bits out).

    1. The threshold and, per span, how many keys lie above it and at it: exact, by a radix select whose
       first digit is taken over all keys and the others over the candidates that share it (see
       :func:`_exact`: two passes over ``x`` and the residual's source); approximate, the same select on
       the reference's hashed sample, then one counting pass (falling back to exact where the reference
       does). Torch scans the counts into each span's offset and share of the ties.
    2. One pass writes the values, the ascending int32 indices and the new residual ``acc`` with the sent
       entries zeroed (``residual_source``, when given, is read in place of ``residual``).

    Each mode reads one count back to the host (the candidates; the approximate mode's output size).
    ``x`` and ``residual`` may have any strides (a strided residual is updated through a contiguous copy).

    Raises:
        ValueError: ``residual_source`` is given without ``residual``.

    Example::

        >>> g = torch.randn(1_000_003, device="cuda"); r = torch.zeros_like(g)
        >>> values, indices = topk_select(g, 10_000, residual=r)
    """
    operands = _common.residual_operands(residual, residual_source)
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    use_exact = exact or reference.approx_sample_size(n, k) * 2 > n
    with _common.device_guard(flat):
        spans = _spans(n, tiles=4)
        programs = triton.cdiv(n, spans.span)
        if k <= 0 or n == 0:
            state = torch.tensor([_KEY_MAX, 0], dtype=torch.int64, device=flat.device)
            above, tied = _counts(flat, operands.source, state, spans)
        elif use_exact:
            state, above, tied = _exact(flat, operands.source, k, spans)
        else:
            state = _approximate_state(flat, operands.source, k)
            above, tied = _counts(flat, operands.source, state, spans)
        tied_before = torch.cumsum(tied, 0, dtype=torch.int64) - tied
        taken = torch.minimum((state[1] - tied_before).clamp_(min=0), tied)
        chosen = above + taken
        offset = torch.cumsum(chosen, 0, dtype=torch.int64) - chosen
        count = max(k, 0) if use_exact or n == 0 else int(chosen.sum())
        values = torch.empty(count, dtype=flat.dtype, device=flat.device)
        indices = torch.empty(count, dtype=torch.int32, device=flat.device)
        if programs:
            _write_kernel[(programs,)](
                flat, operands.source, operands.target, state, offset, taken, values, indices, n,
                BLOCK=spans.block, TILES=spans.tiles, num_warps=spans.num_warps,
            )  # fmt: skip
    operands.finish()
    return values, indices
