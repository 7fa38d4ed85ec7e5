"""How close does each fastcomm op come to memcpy on this GPU?

Every op runs through ``torch.ops.fastcomm`` on a CUDA tensor (Triton kernels for quantize/sign, CUDA C++
for top-k, whatever ``fastcomm.backend()`` reports). For each op the table gives its time, the bytes any
implementation must move (inputs read once, outputs written once), the GB/s that traffic reaches, and that
as a fraction of device-to-device memcpy (read + write) measured in the same run: the gap to the
memory-bound limit. ``torch.topk(x.abs(), k)`` is timed beside top-k as the sort-based baseline.

Run: ``python -m benchmarks.gpu_ops_timing [--numel N] [--repeat R]`` (needs CUDA).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import fastcomm
from benchmarks.harness import Row, markdown_table, time_call, write_results
from fastcomm import ops

__all__ = ["main"]


def _seconds(fn: Callable[[], object], repeat: int, inner: int) -> float:
    """Median seconds of one ``fn()``: ``inner`` back-to-back launches per timed run hide the sync cost."""

    def batch() -> None:
        for _ in range(inner):
            fn()

    return time_call(batch, repeat=repeat, warmup=1, sync=torch.cuda.synchronize) / inner


def _cases(x: torch.Tensor, k: int) -> list[tuple[str, str, int, Callable[[], object]]]:
    """(case, op, bytes moved at minimum, call) for an fp32 ``x``."""
    n = x.numel()
    residual = torch.randn_like(x) * 0.01
    q8, s8 = ops.quantize_blockwise(x, bits=8)
    q4, s4 = ops.quantize_blockwise(x, bits=4)
    packed, sign_scales = ops.sign_compress(x)
    scale_bytes = 4 * -(-n // 256)
    return [
        ("topk_select exact 1%", "topk_select", 4 * n + 8 * k, lambda: ops.topk_select(x, k)),
        ("topk_select approx 1%", "topk_select", 4 * n + 8 * k, lambda: ops.topk_select(x, k, exact=False)),
        (
            "topk_select exact 1% +residual",
            "topk_select",
            12 * n + 8 * k,
            lambda: ops.topk_select(x, k, residual=residual),
        ),
        ("torch.topk(x.abs(), k) baseline", "", 4 * n + 8 * k, lambda: torch.topk(x.abs(), k)),
        ("quantize 8-bit", "quantize_blockwise", 5 * n + scale_bytes, lambda: ops.quantize_blockwise(x, 8)),
        (
            "quantize 8-bit stochastic",
            "quantize_blockwise",
            5 * n + scale_bytes,
            lambda: ops.quantize_blockwise(x, 8, 256, True, 1),
        ),
        (
            "quantize 4-bit",
            "quantize_blockwise",
            4 * n + n // 2 + scale_bytes,
            lambda: ops.quantize_blockwise(x, 4),
        ),
        (
            "quantize 2-bit",
            "quantize_blockwise",
            4 * n + n // 4 + scale_bytes,
            lambda: ops.quantize_blockwise(x, 2),
        ),
        (
            "dequantize 8-bit",
            "dequantize_blockwise",
            5 * n + scale_bytes,
            lambda: ops.dequantize_blockwise(q8, s8, n, 8),
        ),
        (
            "dequantize 4-bit",
            "dequantize_blockwise",
            4 * n + n // 2 + scale_bytes,
            lambda: ops.dequantize_blockwise(q4, s4, n, 4),
        ),
        ("sign_compress", "sign_compress", 4 * n + n // 8, lambda: ops.sign_compress(x)),
        ("sign_compress +residual", "sign_compress", 12 * n + n // 8, lambda: ops.sign_compress(x, residual)),
        (
            "sign_decompress",
            "sign_decompress",
            4 * n + n // 8,
            lambda: ops.sign_decompress(packed, sign_scales, n),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 25, help="fp32 elements (default 32M, 128 MiB)")
    parser.add_argument("--ratio", type=float, default=0.01, help="top-k fraction")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--inner", type=int, default=10, help="launches per timed run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_ops_timing needs a CUDA device")

    x = torch.randn(args.numel, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    k = max(1, int(args.numel * args.ratio))
    copy = torch.empty_like(x)
    memcpy_s = _seconds(lambda: copy.copy_(x), args.repeat, args.inner)
    memcpy_gbps = 8 * args.numel / memcpy_s / 1e9
    backends = fastcomm.backend()
    rows = [
        Row(
            "memcpy (read + write)",
            "torch",
            "time",
            memcpy_s * 1e3,
            "ms",
            1.0,
            "memcpy GB/s",
            {"GB/s": f"{memcpy_gbps:.0f}"},
        )
    ]
    for case, op, traffic, call in _cases(x, k):
        seconds = _seconds(call, args.repeat, args.inner)
        gbps = traffic / seconds / 1e9
        backend = backends[op].cuda.implementation if op else "torch"
        rows.append(
            Row(
                case,
                backend,
                "time",
                seconds * 1e3,
                "ms",
                gbps / memcpy_gbps,
                "memcpy GB/s",
                {"GB/s": f"{gbps:.0f}"},
            )
        )
    notes = [
        f"{args.numel:,} fp32 elements on {torch.cuda.get_device_name(0)}; k = {k:,}.",
        "GB/s counts the bytes any implementation must move (inputs once, outputs once); ratio is that over "
        "memcpy's read+write GB/s, so 1.0 is the memory-bound limit.",
    ]
    print(markdown_table(rows))
    print("\n".join(notes))
    try:
        write_results("gpu_ops_timing", rows, notes=notes, plot_metric="time")
    except ImportError as exc:  # matplotlib is optional on a bare GPU machine; the table is printed above
        print(f"results not written: {exc}")


if __name__ == "__main__":
    main()
