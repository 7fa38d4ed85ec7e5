"""Plain-PyTorch twins of every fastcomm op: the specification the native and Triton kernels are held to.

Each function here is also registered as the default kernel of its op (see ``fastcomm.ops``), so an op runs
on any device that has no native kernel, and it is the one home of its op's signature, defaults and
documentation: the public ``fastcomm.ops.<name>`` checks its arguments, then dispatches, under this
function's signature and docstring. Called directly, a twin checks nothing.

PowerSGD's three matrix passes have their twins in :mod:`fastcomm.reference_powersgd`, the sparse payloads'
sums in :mod:`fastcomm.reference_sparse`; both re-exported here.

The definitions are written so that a native kernel can reproduce them bit for bit: every float operation
below is a single fp32 IEEE operation that C++ and Triton perform in the same order.

Shared conventions:

* Inputs are flattened (``x.reshape(-1)``); outputs are 1-D.
* Magnitude order for top-k is the order of the *bit pattern* of ``|float32(v)|`` read as an integer. For
  finite values this is the numeric order; NaN ranks above +inf, so a non-finite gradient is always sent.
* Ties at the k-th magnitude are broken by the lower index; selected indices are returned ascending.
* Stochastic rounding draws ``u`` in ``[0, 1)`` from a counter-based hash of ``(element index, seed)``
  (:func:`uniform_hash`), so the result depends on neither the thread count nor the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastcomm.reference_powersgd import powersgd_back_project, powersgd_expand, powersgd_project
from fastcomm.reference_sparse import sparse_accumulate, sparse_mean

__all__ = [
    "FLOAT_DTYPES",
    "QUANT_BITS",
    "approx_sample_size",
    "dequantize_blockwise",
    "dequantize_blockwise_into",
    "pack_codes",
    "powersgd_back_project",
    "powersgd_expand",
    "powersgd_project",
    "quantize_blockwise",
    "sign_compress",
    "sign_decompress",
    "sign_decompress_into",
    "sparse_accumulate",
    "sparse_mean",
    "topk_select",
    "uniform_hash",
    "unpack_codes",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANT_BITS = (8, 4, 2)

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B1


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def _hash32(index: Tensor, seed: int) -> Tensor:
    """``fmix32((index * golden) mod 2**32 XOR seed32)``: a bijection of the low 32 bits of ``index``."""
    seed32 = (seed ^ (seed >> 32)) & _MASK32
    return _fmix32(((index & _MASK32) * _GOLDEN32 & _MASK32) ^ seed32)


def uniform_hash(index: Tensor, seed: int) -> Tensor:
    """Uniform fp32 numbers in ``[0, 1)`` on a 2**-24 grid, one per element index, from ``seed``."""
    return (_hash32(index, seed) >> 8).to(torch.float32) * (2.0**-24)


def _magnitude_keys(acc: Tensor) -> Tensor:
    """int32 keys whose integer order is the order of ``|float32(acc)|`` (NaN above inf)."""
    return acc.float().abs().view(torch.int32)


def approx_sample_size(n: int, k: int) -> int:
    """How many elements approximate top-k samples: enough that ~1000 of them lie above the threshold."""
    if k <= 0:
        return 0
    return min(n, max(65536, -(-1000 * n // k)))


def _approx_threshold(keys: Tensor, k: int) -> Tensor:
    """The magnitude key that about ``k`` of ``keys`` reach, estimated from a hashed stratified sample.

    One sample per stratum of ``n // m`` elements at a hashed offset (seed 0), as Deep Gradient Compression
    samples to estimate its threshold; the threshold is the sample's ``ceil(m * k / n)``-th largest key.
    """
    n = keys.numel()
    m = approx_sample_size(n, k)
    stride = n // m
    strata = torch.arange(m, dtype=torch.int64, device=keys.device)
    positions = strata * stride + _hash32(strata, 0) % stride
    rank = max(1, -(-m * k // n))
    return torch.topk(keys[positions], rank).values[-1]


def _residual_source(residual: Tensor | None, residual_source: Tensor | None) -> Tensor | None:
    """The buffer ``acc = x + source`` reads: ``residual_source`` if given, else the residual itself."""
    if residual_source is None:
        return residual
    if residual is None:
        raise ValueError("residual_source needs residual: acc - sent is written to residual")
    return residual_source


def topk_select(
    x: Tensor,
    k: int,
    residual: Tensor | None = None,
    exact: bool = True,
    residual_source: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Select the k largest-magnitude entries of ``x + residual``, with error feedback.

    1. ``acc = x + residual`` in ``x``'s dtype (or ``x`` when there is no residual). With
       ``residual_source`` as well, ``acc = x + residual_source`` and ``residual`` is only written: the bits
       of ``residual.copy_(residual_source)`` followed by the in-place call, without the copy (so two
       buffers can alternate between steps).
    2. Exact: the k-th largest magnitude key ``t``; every entry above ``t`` is selected, then entries equal
       to ``t`` by ascending index until there are k. The native kernels find ``t`` by a 16-bit radix
       histogram: two passes over ``x``, O(n) and no sort (``torch.topk`` sorts candidates).
    3. Approximate (``exact=False``): ``t`` is estimated from a hashed sample of :func:`approx_sample_size`
       (about ``1000 * n / k``) elements, as in Deep Gradient Compression, and every entry with key
       ``>= t`` is sent: one pass over ``x``, about k entries (within a few percent), never fewer than one.
    4. ``residual`` becomes ``acc`` with the selected entries set to zero, so
       ``scatter(values) + residual == x + old_residual`` exactly.

    Args:
        x: fp32/fp16/bf16 tensor of any shape (flattened).
        k: how many entries to send, ``0 <= k <= x.numel()``.
        residual: error-feedback buffer like ``x``, updated in place; ``None`` for no feedback.
        exact: exactly k entries (True) or about k entries for one pass less (False).
        residual_source: last step's residual, like ``x``, read but not written; needs ``residual``, and
            must be ``residual`` itself or not overlap it. ``None``: ``residual`` is its own source.

    Returns:
        ``(values, indices)``: values in ``x.dtype``, int32 indices into ``x.reshape(-1)``, ascending.

    Example::

        >>> g = torch.randn(1000); r = torch.zeros_like(g)
        >>> values, indices = topk_select(g, 10, residual=r)
        >>> bool((g.index_put((indices.long(),), torch.zeros(10)) == r).all())
        True
        >>> r_next = torch.empty_like(g)  # double-buffered: r is read, r_next written
        >>> values, indices = topk_select(g, 10, residual=r_next, exact=False, residual_source=r)
        >>> bool((r_next.index_put((indices.long(),), values) == g + r).all())
        True
    """
    source = _residual_source(residual, residual_source)
    flat = x.reshape(-1)
    acc = flat + source.reshape(-1) if source is not None else flat
    n = acc.numel()
    if k <= 0 or n == 0:
        indices = torch.empty(0, dtype=torch.int64, device=x.device)
    else:
        keys = _magnitude_keys(acc)
        use_exact = exact or approx_sample_size(n, k) * 2 > n
        if use_exact:
            threshold = torch.topk(keys, k).values[-1]
            above = torch.nonzero(keys > threshold).reshape(-1)
            tied = torch.nonzero(keys == threshold).reshape(-1)[: k - above.numel()]
            indices = torch.sort(torch.cat([above, tied])).values
        else:
            indices = torch.nonzero(keys >= _approx_threshold(keys, k)).reshape(-1)
    values = acc[indices]
    if residual is not None:
        new_residual = acc.clone()
        new_residual[indices] = 0
        residual.copy_(new_residual.view_as(residual))
    return values, indices.to(torch.int32)


def _block_absmax(flat32: Tensor, block: int) -> Tensor:
    """Per-block max |x|; NaN for a block holding any inf or NaN (so its dequantized values are NaN)."""
    n = flat32.numel()
    nblocks = -(-n // block)
    padded = torch.nn.functional.pad(flat32, (0, nblocks * block - n)).view(nblocks, block)
    absmax = padded.abs().amax(dim=1)
    return torch.where(torch.isfinite(padded).all(dim=1), absmax, float("nan"))


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack unsigned ``bits``-wide codes, ``p = 8 // bits`` a byte: element ``i`` at bit ``(i % p) * bits``
    of byte ``i // p``."""
    per_byte = 8 // bits
    n = codes.numel()
    padded = torch.nn.functional.pad(codes.to(torch.int32), (0, (-n) % per_byte))
    shifts = torch.arange(per_byte, dtype=torch.int32, device=codes.device) * bits
    return (padded.view(-1, per_byte) << shifts).sum(dim=1).to(torch.uint8)


def unpack_codes(packed: Tensor, bits: int, numel: int) -> Tensor:
    """The first ``numel`` codes of ``packed``, as :func:`pack_codes` lays them out (int32)."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.reshape(-1).to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel]


def quantize_blockwise(
    x: Tensor,
    bits: int = 8,
    block: int = 256,
    stochastic: bool = False,
    seed: int = 0,
    residual: Tensor | None = None,
    residual_source: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Quantize to ``bits``-wide signed codes with one absmax fp32 scale per block, packed into bytes.

    With ``qmax = 2**(bits-1) - 1`` and ``x`` replaced by ``acc = x + residual`` (rounded in ``x``'s dtype)
    when a residual is given, or ``acc = x + residual_source`` when that is given too (``residual`` is then
    only written: the bits of ``residual.copy_(residual_source)`` followed by the in-place call, without the
    copy, so two buffers can alternate between steps), for each block of ``block`` elements:

    1. ``absmax = max |x|`` (NaN if the block holds inf/NaN, so the block dequantizes to NaN and an AMP
       GradScaler still sees the overflow); ``scale = absmax / qmax`` (fp32).
    2. ``inv = qmax / absmax`` when absmax is finite and positive and the quotient finite (a subnormal
       absmax overflows it), else 0; ``v = x * inv`` (0 where inv is 0).
    3. ``code = clamp(trunc(v + (qmax + u)), 0, 2*qmax) + 1`` with ``u = 0.5`` (round to nearest) or, when
       ``stochastic``, ``u = uniform_hash(i, seed)``, which makes ``floor(v + u)`` unbiased: E[deq] = x.
       Codes ``1 .. 2*qmax+1`` stand for ``-qmax .. qmax`` (code 0 is unused), packed 8/bits per byte.
    4. With a residual (error feedback), it becomes ``acc - dequantize(codes)`` computed in fp32 and rounded
       once to ``x``'s dtype, in place, in the same pass.

    Args:
        x: fp32/fp16/bf16 tensor of any shape (flattened).
        bits: 8, 4 or 2.
        block: elements per scale.
        stochastic: stochastic (unbiased) instead of nearest rounding.
        seed: stochastic rounding seed (an int64); the same seed gives the same codes on every backend.
        residual: error-feedback buffer like ``x``, updated in place; ``None`` for no feedback.
        residual_source: last step's residual, like ``x``, read but not written; needs ``residual``, and
            must be ``residual`` itself or not overlap it. ``None``: ``residual`` is its own source.

    Returns:
        ``(codes uint8 of ceil(numel * bits / 8), scales float32 of ceil(numel / block))``.

    Example::

        >>> codes, scales = quantize_blockwise(torch.randn(1000), bits=8)
        >>> dequantize_blockwise(codes, scales, 1000).shape
        torch.Size([1000])
        >>> g = torch.randn(1000); r = [torch.zeros_like(g), torch.zeros_like(g)]  # double-buffered
        >>> for step in range(2):
        ...     codes, scales = quantize_blockwise(g, residual=r[step % 2], residual_source=r[1 - step % 2])
    """
    source = _residual_source(residual, residual_source)
    acc = x.reshape(-1)
    if source is not None:
        acc = acc + source.reshape(-1)
    flat = acc.float()
    n = flat.numel()
    qmax = float(2 ** (bits - 1) - 1)
    absmax = _block_absmax(flat, block)
    # Tensor-by-tensor division: one correctly rounded fp32 division, as the kernels do (``qmax / t``
    # would run as ``t.reciprocal() * qmax``, two roundings).
    qmax_t = torch.full_like(absmax, qmax)
    scales = absmax / qmax_t
    usable = torch.isfinite(absmax) & (absmax > 0)
    inv = torch.where(usable, qmax_t / absmax, torch.zeros_like(absmax))
    usable = usable & torch.isfinite(inv)
    inv = torch.where(usable, inv, torch.zeros_like(inv))
    block_of = torch.arange(n, device=x.device) // block
    v = torch.where(usable[block_of], flat * inv[block_of], torch.zeros_like(flat))
    if stochastic:
        u = uniform_hash(torch.arange(n, dtype=torch.int64, device=x.device), seed)
    else:
        u = torch.full_like(flat, 0.5)
    w = v + (qmax + u)
    codes = torch.clamp(w, 0.0, 2 * qmax).to(torch.int32) + 1
    packed = pack_codes(codes, bits)
    if residual is not None:
        sent = dequantize_blockwise(packed, scales, n, bits, block, torch.float32)
        residual.copy_((flat - sent).to(x.dtype).view_as(residual))
    return packed, scales


def dequantize_blockwise(
    codes: Tensor,
    scales: Tensor,
    numel: int,
    bits: int = 8,
    block: int = 256,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Inverse of :func:`quantize_blockwise`: ``numel`` values ``(code - qmax - 1) * scale`` in ``dtype``.

    Example::

        >>> x = torch.randn(7)
        >>> (dequantize_blockwise(*quantize_blockwise(x), numel=7) - x).abs().max() < x.abs().max() / 127
        tensor(True)
    """
    qmax = 2 ** (bits - 1) - 1
    signed = unpack_codes(codes, bits, numel) - (qmax + 1)
    block_of = torch.arange(numel, device=codes.device) // block
    return (signed.to(torch.float32) * scales.reshape(-1)[block_of]).to(dtype)


def _prefix(payload: Tensor, numel: int) -> Tensor:
    """The first ``numel`` elements of a payload that may carry zero padding after them."""
    return payload.reshape(-1)[:numel]


def _decode_into(out: Tensor, decoded: Tensor, accumulate: bool) -> Tensor:
    """``out = decoded`` or, accumulating, ``out = out + decoded`` added in fp32 and rounded once."""
    view = out.view(-1)
    if accumulate:
        view.copy_(view.float() + decoded)
    else:
        view.copy_(decoded)
    return out


def dequantize_blockwise_into(
    out: Tensor, codes: Tensor, scales: Tensor, bits: int = 8, block: int = 256, accumulate: bool = False
) -> Tensor:
    """:func:`dequantize_blockwise` straight into a caller's buffer, optionally adding to what it holds.

    1. ``numel = out.numel()``; only the first ``ceil(numel * bits / 8)`` codes and ``ceil(numel / block)``
       scales are read, so a zero-padded payload decodes into an unpadded buffer.
    2. ``accumulate=False``: ``out`` gets the bits of ``dequantize_blockwise(codes, scales, numel, bits,
       block, out.dtype)``. ``accumulate=True``: ``out = (out.float() + dequantized_fp32).to(out.dtype)``,
       one fp32 addition rounded once (for fp32 exactly ``out.add_(dequantized)``).

    Args:
        out: contiguous fp32/fp16/bf16 tensor of any shape, written in place.
        codes: uint8 codes from :func:`quantize_blockwise`, at least ``ceil(out.numel() * bits / 8)``.
        scales: fp32 scales, at least ``ceil(out.numel() / block)``.
        bits: 8, 4 or 2.
        block: elements per scale.
        accumulate: add to ``out`` instead of overwriting it.

    Returns:
        ``out``.

    Example::

        >>> g = torch.randn(1000); total = torch.zeros(1000)
        >>> codes, scales = quantize_blockwise(g, bits=4)
        >>> dequantize_blockwise_into(total, codes, scales, bits=4, accumulate=True).shape
        torch.Size([1000])
    """
    n = out.numel()
    dtype = torch.float32 if accumulate else out.dtype
    decoded = dequantize_blockwise(
        _prefix(codes, -(-n * bits // 8)), _prefix(scales, -(-n // block)), n, bits, block, dtype
    )
    return _decode_into(out, decoded, accumulate)


def sign_compress(
    x: Tensor, residual: Tensor | None = None, chunk: int = 2048, residual_source: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """1-bit sign compression with one fp32 scale (mean magnitude) per chunk and error feedback.

    This is the compressor of EF-SignSGD and 1-bit Adam.

    1. ``acc = x + residual`` in ``x``'s dtype, or ``x + residual_source`` when that is given (``residual``
       is then only written: the bits of ``residual.copy_(residual_source)`` followed by the in-place call,
       without the copy; ``residual_source`` may be ``residual`` itself).
    2. Per chunk of ``chunk`` elements: ``scale = mean |acc|`` (summed in fp64, rounded to fp32 once);
       bit ``1`` where ``acc >= 0``, packed 8 per byte, element ``i`` at bit ``i % 8``.
    3. ``residual = acc - scale * sign`` (in ``x``'s dtype), in place: what the sign did not carry, so
       ``sent + residual == acc`` up to one rounding.

    Args:
        x: fp32/fp16/bf16 tensor of any shape (flattened).
        residual: error-feedback buffer like ``x``, updated in place; ``None`` for no feedback.
        chunk: elements per scale.
        residual_source: last step's residual, like ``x``, read but not written; needs ``residual``, and
            must be ``residual`` itself or not overlap it. ``None``: ``residual`` is its own source.

    Returns:
        ``(packed uint8 of ceil(numel / 8), scales float32 of ceil(numel / chunk))``.

    Example::

        >>> g = torch.randn(5000); r = torch.zeros_like(g)
        >>> packed, scales = sign_compress(g, r)
        >>> sign_decompress(packed, scales, g.numel()).shape
        torch.Size([5000])
        >>> r_next = torch.empty_like(g)  # double-buffered: r is read, r_next written
        >>> packed, scales = sign_compress(g, r_next, residual_source=r)
    """
    source = _residual_source(residual, residual_source)
    flat = x.reshape(-1)
    acc = flat + source.reshape(-1) if source is not None else flat
    n = acc.numel()
    nchunks = -(-n // chunk)
    acc64 = acc.double()
    padded = torch.nn.functional.pad(acc64.abs(), (0, nchunks * chunk - n)).view(nchunks, chunk)
    counts = torch.full((nchunks,), float(chunk), dtype=torch.float64, device=x.device)
    if nchunks:
        counts[-1] = n - (nchunks - 1) * chunk
    scales = (padded.sum(dim=1) / counts).float()
    positive = acc >= 0
    packed = pack_codes(positive.to(torch.int32), 1)
    if residual is not None:
        chunk_of = torch.arange(n, device=x.device) // chunk
        sent = torch.where(positive, scales[chunk_of], -scales[chunk_of])
        residual.copy_((acc.float() - sent).to(x.dtype).view_as(residual))
    return packed, scales


def sign_decompress(
    packed: Tensor, scales: Tensor, numel: int, chunk: int = 2048, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`sign_compress`: ``numel`` values of ``dtype``, ``+scale`` for bit 1, else ``-scale``.

    Example::

        >>> packed, scales = sign_compress(torch.tensor([1.0, -3.0]))
        >>> sign_decompress(packed, scales, 2)
        tensor([ 2., -2.])
    """
    bits = unpack_codes(packed, 1, numel).bool()
    magnitude = scales.reshape(-1)[torch.arange(numel, device=packed.device) // chunk]
    return torch.where(bits, magnitude, -magnitude).to(dtype)


def sign_decompress_into(
    out: Tensor, packed: Tensor, scales: Tensor, chunk: int = 2048, accumulate: bool = False
) -> Tensor:
    """:func:`sign_decompress` straight into a caller's buffer, optionally adding to what it holds.

    1. ``numel = out.numel()``; only the first ``ceil(numel / 8)`` bytes and ``ceil(numel / chunk)`` scales
       are read, so a zero-padded payload decodes into an unpadded buffer.
    2. ``accumulate=False``: ``out`` gets the bits of ``sign_decompress(packed, scales, numel, chunk,
       out.dtype)``. ``accumulate=True``: ``out = (out.float() + (±scale)).to(out.dtype)``, one fp32
       addition rounded once.

    Args:
        out: contiguous fp32/fp16/bf16 tensor of any shape, written in place.
        packed: uint8 sign bits from :func:`sign_compress`, at least ``ceil(out.numel() / 8)``.
        scales: fp32 scales, at least ``ceil(out.numel() / chunk)``.
        chunk: elements per scale.
        accumulate: add to ``out`` instead of overwriting it.

    Returns:
        ``out``.

    Example::

        >>> packed, scales = sign_compress(torch.tensor([1.0, -3.0]))
        >>> sign_decompress_into(torch.ones(2), packed, scales, accumulate=True)
        tensor([ 3., -1.])
    """
    n = out.numel()
    dtype = torch.float32 if accumulate else out.dtype
    decoded = sign_decompress(_prefix(packed, -(-n // 8)), _prefix(scales, -(-n // chunk)), n, chunk, dtype)
    return _decode_into(out, decoded, accumulate)
