"""How fast is each compression op, against memcpy and torch.topk measured in the same run?

For a 25M-element fp32 gradient (a 100 MB bucket), every op runs on each backend available here: the
dispatched kernel (C++/OpenMP on CPU; Triton or CUDA C++ on a GPU) and the plain-PyTorch reference twin.
Throughput is GB/s of *input* processed (4 bytes per fp32 element). Beside it, each row gives the memory
traffic the kernel must move (its bound: reads + writes) and the GB/s that traffic reaches, next to
memcpy's read+write GB/s, so the gap to the memory-bound limit is visible.

Targets (issue 2): exact top-k of 1% at least 5x faster than ``torch.topk(x.abs(), k)``, approximate at
least 15x; 8-bit quantize and sign compression at least 0.4x memcpy bandwidth.

Run: ``python -m benchmarks.bench_kernels [--device cuda] [--numel N] [--repeat R]``
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.harness import Row, time_call, write_results
from fastcomm import ops
from fastcomm import reference as ref

__all__ = ["main"]


def _cases(x: torch.Tensor, k: int) -> list[tuple[str, float, Callable[..., object], tuple, str | None]]:
    """(name, bytes of traffic per element, function taking the op module, args factory, target)."""
    n = x.numel()
    residual = torch.randn_like(x) * 0.01
    written = torch.empty_like(x)  # residual_source: last step's residual is read, this one written
    codes8, scales8 = ref.quantize_blockwise(x[: min(n, 1 << 20)], 8)  # warm the reference path cheaply
    del codes8, scales8
    q8 = ops.quantize_blockwise(x, bits=8)
    q4 = ops.quantize_blockwise(x, bits=4)
    packed, sign_scales = ops.sign_compress(x)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, n, (2 * k,), generator=g, dtype=torch.int32).to(x.device)
    vals = torch.randn(2 * k, generator=g).to(x.device)
    out = torch.zeros_like(x)
    mean_out = torch.zeros_like(x)
    previous = torch.randint(0, n, (2 * k,), generator=g, dtype=torch.int32).to(x.device)
    into = torch.zeros_like(x)  # a warm buffer the *_into ops decode into
    # PowerSGD's passes over the bucket viewed as matrices of 4096 columns, rank 4
    cols = min(n, 4096)
    rows = n // cols
    matrix = x[: rows * cols].view(rows, cols)
    feedback = residual[: rows * cols].view(rows, cols)
    formed, approx = torch.empty_like(matrix), torch.empty_like(matrix)
    owed = matrix.clone()
    q_t = torch.randn(4, cols, generator=g).to(x.device)
    p_mat = torch.randn(rows, 4, generator=g).to(x.device)
    p_out, q_out = torch.empty_like(p_mat), torch.empty_like(q_t)
    return [
        ("topk_select exact 1%", 8.0, lambda m: m.topk_select(x, k), ">=5x torch.topk"),
        ("topk_select approx 1%", 4.0, lambda m: m.topk_select(x, k, exact=False), ">=15x torch.topk"),
        (
            "topk_select exact 1% +residual",
            16.0,
            lambda m: m.topk_select(x, k, residual=residual.clone()),
            None,
        ),
        (
            "topk_select exact 1% +residual_source",
            16.0,
            lambda m: m.topk_select(x, k, written, True, residual),
            None,
        ),
        (
            "topk_select approx 1% +residual_source",
            12.0,
            lambda m: m.topk_select(x, k, written, False, residual),
            None,
        ),
        ("quantize_blockwise 8-bit", 5.0, lambda m: m.quantize_blockwise(x, bits=8), ">=0.4x memcpy"),
        (
            "quantize_blockwise 8-bit stochastic",
            5.0,
            lambda m: m.quantize_blockwise(x, 8, 256, True, 1),
            None,
        ),
        (
            "quantize_blockwise 8-bit stochastic +residual_source",
            13.0,
            lambda m: m.quantize_blockwise(x, 8, 256, True, 1, written, residual),
            None,
        ),
        ("quantize_blockwise 4-bit", 4.5, lambda m: m.quantize_blockwise(x, bits=4), None),
        (
            "quantize_blockwise 4-bit stochastic +residual_source",
            12.5,
            lambda m: m.quantize_blockwise(x, 4, 256, True, 1, written, residual),
            None,
        ),
        ("quantize_blockwise 2-bit", 4.25, lambda m: m.quantize_blockwise(x, bits=2), None),
        ("dequantize_blockwise 8-bit", 5.0, lambda m: m.dequantize_blockwise(q8[0], q8[1], n, 8), None),
        ("dequantize_blockwise 4-bit", 4.5, lambda m: m.dequantize_blockwise(q4[0], q4[1], n, 4), None),
        (
            "dequantize_blockwise_into 8-bit accumulate",
            9.0,
            lambda m: m.dequantize_blockwise_into(into, q8[0], q8[1], 8, 256, True),
            None,
        ),
        (
            "dequantize_blockwise_into 4-bit accumulate",
            8.5,
            lambda m: m.dequantize_blockwise_into(into, q4[0], q4[1], 4, 256, True),
            None,
        ),
        ("sign_compress", 4.125, lambda m: m.sign_compress(x), ">=0.4x memcpy"),
        ("sign_compress +residual", 12.125, lambda m: m.sign_compress(x, residual.clone()), None),
        (
            "sign_compress +residual_source",
            12.125,
            lambda m: m.sign_compress(x, written, 2048, residual),
            None,
        ),
        ("sign_decompress", 4.125, lambda m: m.sign_decompress(packed, sign_scales, n), None),
        (
            "sign_decompress_into accumulate",
            8.125,
            lambda m: m.sign_decompress_into(into, packed, sign_scales, 2048, True),
            None,
        ),
        (
            "powersgd_project rank 4 +residual",  # x = g + e, P = x Q: reads g, e, writes x
            12.0,
            lambda m: m.powersgd_project(p_out, formed, q_t, matrix, feedback),
            None,
        ),
        ("powersgd_back_project rank 4", 4.0, lambda m: m.powersgd_back_project(q_out, p_mat, matrix), None),
        (
            "powersgd_expand rank 4 +residual",  # mean = P Q^T, residual -= P Q^T: reads e, writes e and mean
            12.0,
            lambda m: m.powersgd_expand(approx, p_mat, q_t, owed),
            None,
        ),
        (
            f"sparse_accumulate {2 * k} entries",
            12.0 * 2 * k / n,
            lambda m: m.sparse_accumulate(out, idx, vals),
            None,
        ),
        (  # top-k's decode into a kept buffer: clear last step's entries, add two ranks' payloads, divide
            f"sparse_mean {2 * k} entries, clearing {2 * k}",
            32.0 * 2 * k / n,
            lambda m: m.sparse_mean(mean_out, idx, vals, 2, clear=previous),
            None,
        ),
    ]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--ratio", type=float, default=0.01, help="top-k fraction")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--reference-repeat", type=int, default=1, help="the reference twins are slow on CPU")
    args = parser.parse_args(argv)

    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else None
    n = args.numel
    k = max(1, int(n * args.ratio))
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    input_gb = n * x.element_size() / 1e9

    dst = torch.empty_like(x)
    memcpy_s = time_call(lambda: dst.copy_(x), repeat=args.repeat, sync=sync)
    memcpy_traffic = 2 * input_gb / memcpy_s
    topk_s = time_call(lambda: torch.topk(x.abs(), k), repeat=max(2, args.repeat // 2), sync=sync)
    rows = [
        Row(
            "memcpy (Tensor.copy_)",
            "torch",
            "throughput",
            input_gb / memcpy_s,
            "GB/s input",
            extra={"ms": round(memcpy_s * 1e3, 2), "traffic GB/s": round(memcpy_traffic, 2)},
        ),
        Row(
            f"torch.topk(x.abs(), {k})",
            "torch",
            "throughput",
            input_gb / topk_s,
            "GB/s input",
            extra={"ms": round(topk_s * 1e3, 2)},
        ),
    ]
    backends: list[tuple[str, object, int]] = []
    if device == "cpu" and ops.native_error() is not None:
        print(f"native CPU kernels not loaded ({ops.native_error()}): benchmarking the reference only")
    else:
        backends.append(("native" if device == "cpu" else "cuda kernels", ops, args.repeat))
    backends.append(("reference", ref, args.reference_repeat))

    notes = [
        f"{n:,} fp32 elements ({input_gb * 1e3:.0f} MB), k = {k:,} ({args.ratio:.0%}), device {device}",
        f"memcpy: {input_gb / memcpy_s:.2f} GB/s of input = {memcpy_traffic:.2f} GB/s read+write",
        "traffic = bytes the op must read and write per call; 'traffic GB/s' / memcpy's is the share of the "
        "memory-bound limit reached",
    ]
    for name, bytes_per_elem, fn, target in _cases(x, k):
        for backend_name, module, repeat in backends:
            seconds = time_call(lambda fn=fn, module=module: fn(module), repeat=repeat, sync=sync)
            traffic = bytes_per_elem * n / 1e9 / seconds
            if "topk" in name:
                ratio, ratio_to = topk_s / seconds, "torch.topk (time)"
            else:
                ratio, ratio_to = (input_gb / seconds) / (input_gb / memcpy_s), "memcpy (GB/s)"
            extra = {"ms": round(seconds * 1e3, 2), "traffic GB/s": round(traffic, 2)}
            if target and backend_name != "reference":
                need = float(target[2:].split("x")[0])
                extra["target"] = target
                extra["met"] = "yes" if ratio >= need else "NO"
            rows.append(
                Row(
                    name,
                    backend_name,
                    "throughput",
                    input_gb / seconds,
                    "GB/s input",
                    ratio=ratio,
                    ratio_to=ratio_to,
                    extra=extra,
                )
            )
    return write_results(
        f"bench_kernels_{device}" if device != "cpu" else "bench_kernels",
        rows,
        notes=notes,
        plot_metric="throughput",
    )


if __name__ == "__main__":
    print(main())
