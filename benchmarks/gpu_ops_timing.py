"""How close does each fastcomm kernel come to memcpy on this GPU, and how much faster than torch is it?

For each size (1M to 256M elements by default) and dtype (fp32, bf16, fp16), one run times a device-to-device
memcpy of the input (read + write), then every kernel beside torch's own way of doing the same thing: the
plain-PyTorch twin from :mod:`fastcomm.reference` for quantize, dequantize and sign (torch has no such op),
``torch.topk`` on the magnitudes for top-k. The kernels are called through their Triton modules (on CUDA
``torch.ops.fastcomm`` dispatches quantize and sign there too), and top-k also through ``torch.ops.fastcomm``
(the CUDA C++ kernel when ``fastcomm._C`` was built with nvcc). Each row gives the kernel's time, the GB/s
of the bytes any implementation must move (inputs read once, outputs written once, error feedback's
residual read and written once), that as a fraction of memcpy's GB/s (1.0 is the memory-bound limit), and
the speed-up over torch's op.

Run: ``python -m benchmarks.gpu_ops_timing`` on a CUDA machine (``--sizes 1M,16M`` for fewer sizes).
``TRITON_INTERPRET=1 python -m benchmarks.gpu_ops_timing --device cpu --sizes 20k`` runs the same cases on
CPU tensors through Triton's interpreter: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import fastcomm
from benchmarks.harness import Row, markdown_table, write_results
from fastcomm import reference
from fastcomm.triton import quantize, sign, topk

__all__ = ["Case", "cases", "gpu_slug", "main", "parse_size"]

_BLOCK = 256
_CHUNK = 2048


@dataclass(frozen=True)
class Case:
    """One kernel beside torch's way of computing the same outputs.

    Args:
        name: what the row says (``"quantize 4-bit stochastic +residual"``).
        backend: what runs ``kernel`` (``"triton"``, or ``fastcomm.backend()``'s word for a dispatched op).
        traffic: bytes any implementation must move.
        kernel: the call timed.
        torch_name: torch's way (``"torch.topk"``, ``"reference twin"``).
        torch_call: its call, timed beside.
    """

    name: str
    backend: str
    traffic: int
    kernel: Callable[[], object]
    torch_name: str
    torch_call: Callable[[], object]


def parse_size(text: str) -> int:
    """``"256M"`` -> 268435456 (binary units: k, M, G), ``"1000003"`` -> 1000003."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def cases(x: torch.Tensor, ratio: float) -> list[Case]:
    """Every timed case for the input ``x`` (its dtype and device), with fresh residual buffers."""
    n, size = x.numel(), x.element_size()
    residual = torch.randn_like(x) * 0.01
    k = max(1, int(n * ratio))
    out: list[Case] = []
    for bits in reference.QUANT_BITS:
        codes = n * bits // 8 + 4 * -(-n // _BLOCK)
        q_codes, q_scales = quantize.quantize_blockwise(x, bits, _BLOCK, True, 1)
        out += [
            Case(
                f"quantize {bits}-bit stochastic +residual", "triton", 3 * size * n + codes,
                lambda b=bits: quantize.quantize_blockwise(x, b, _BLOCK, True, 1, residual),
                "reference twin",
                lambda b=bits: reference.quantize_blockwise(x, b, _BLOCK, True, 1, residual.clone()),
            ),
            Case(
                f"quantize {bits}-bit nearest", "triton", size * n + codes,
                lambda b=bits: quantize.quantize_blockwise(x, b, _BLOCK),
                "reference twin", lambda b=bits: reference.quantize_blockwise(x, b, _BLOCK),
            ),
            Case(
                f"dequantize {bits}-bit", "triton", codes + size * n,
                lambda b=bits, c=q_codes, s=q_scales: quantize.dequantize_blockwise(
                    c, s, n, b, _BLOCK, x.dtype
                ),
                "reference twin",
                lambda b=bits, c=q_codes, s=q_scales: reference.dequantize_blockwise(
                    c, s, n, b, _BLOCK, x.dtype
                ),
            ),
        ]  # fmt: skip
    bits_bytes = -(-n // 8) + 4 * -(-n // _CHUNK)
    packed, scales = sign.sign_compress(x, None, _CHUNK)
    out += [
        Case(
            "sign +residual", "triton", 3 * size * n + bits_bytes,
            lambda: sign.sign_compress(x, residual, _CHUNK),
            "reference twin", lambda: reference.sign_compress(x, residual.clone(), _CHUNK),
        ),
        Case(
            "sign", "triton", size * n + bits_bytes, lambda: sign.sign_compress(x, None, _CHUNK),
            "reference twin", lambda: reference.sign_compress(x, None, _CHUNK),
        ),
        Case(
            "sign decompress", "triton", bits_bytes + size * n,
            lambda: sign.sign_decompress(packed, scales, n, _CHUNK, x.dtype),
            "reference twin", lambda: reference.sign_decompress(packed, scales, n, _CHUNK, x.dtype),
        ),
    ]  # fmt: skip
    selected = k * (size + 4)
    dispatched = fastcomm.backend()["topk_select"].cuda.implementation if x.is_cuda else "native-cpp"
    for exact in (True, False):
        mode = "exact" if exact else "approx"
        out += [
            Case(
                f"top-k {mode} {ratio:.0%} +residual", "triton", 3 * size * n + selected,
                lambda e=exact: topk.topk_select(x, k, residual, e),
                "torch.topk", lambda: torch.topk(x.abs(), k),
            ),
            Case(
                f"top-k {mode} {ratio:.0%} +residual (ops)", dispatched, 3 * size * n + selected,
                lambda e=exact: torch.ops.fastcomm.topk_select(x, k, residual, e),
                "torch.topk", lambda: torch.topk(x.abs(), k),
            ),
        ]  # fmt: skip
    out.append(
        Case(
            f"top-k exact {ratio:.0%}",
            "triton",
            size * n + selected,
            lambda: topk.topk_select(x, k),
            "torch.topk",
            lambda: torch.topk(x.abs(), k),
        )  # fmt: skip
    )
    return out


def _seconds(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Median seconds of one ``fn()``; back-to-back launches in each timed run hide the sync (CUDA events)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    inner = max(1, min(20, int(2e-3 / max(start.elapsed_time(end) * 1e-3, 1e-7))))  # ~2 ms a timed run
    times = []
    for _ in range(repeat):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / inner)
    return statistics.median(times)


def _failed(case: str, exc: Exception) -> Row:
    """The row of a case whose kernel raised: its error's last line says why."""
    why = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
    print(f"!!! {case}: {type(exc).__name__}: {why}", flush=True)
    return Row(case, "", "failed", float("nan"), "", extra={"why": f"{type(exc).__name__}: {why}"})


def _rows(n: int, dtype: torch.dtype, device: torch.device, ratio: float, repeat: int) -> list[Row]:
    label = f"{n >> 20}M {str(dtype)[6:]}" if n % (1 << 20) == 0 else f"{n:,} {str(dtype)[6:]}"
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype).to(device)
    copy = torch.empty_like(x)
    memcpy_s = _seconds(lambda: copy.copy_(x), device, repeat)
    memcpy_gbps = 2 * n * x.element_size() / memcpy_s / 1e9
    rows = [
        Row(
            f"memcpy {label}",
            "torch",
            "time",
            memcpy_s * 1e3,
            "ms",
            1.0,
            "memcpy",
            {"GB/s": round(memcpy_gbps)},
        )
    ]
    try:
        timed = cases(x, ratio)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails to build is a row, not the end of the run
        return [*rows, _failed(f"setting up the cases {label}", exc)]
    for case in timed:
        try:
            seconds = _seconds(case.kernel, device, repeat)
        except Exception as exc:  # noqa: BLE001 - likewise: the other kernels are still timed
            rows.append(_failed(f"{case.name} {label}", exc))
            continue
        try:
            torch_s: float | None = _seconds(case.torch_call, device, max(1, repeat // 2))
        except torch.cuda.OutOfMemoryError:
            torch_s = None  # the twin's temporaries did not fit: its column stays empty
        gbps = case.traffic / seconds / 1e9
        extra = {
            "GB/s": round(gbps),
            "torch's op": case.torch_name,
            "torch ms": None if torch_s is None else round(torch_s * 1e3, 4),
            "x torch": None if torch_s is None else round(torch_s / seconds, 2),
        }
        rows.append(
            Row(
                f"{case.name} {label}",
                case.backend,
                "time",
                seconds * 1e3,
                "ms",
                gbps / memcpy_gbps,
                "memcpy",
                extra,
            )
        )
        print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def gpu_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``: the part of the name that says which GPU."""
    words = [w for w in name.lower().replace("nvidia", "").split() if any(c.isdigit() for c in w)]
    return "".join(c for c in (words[0] if words else name.lower()) if c.isalnum()) or "gpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,16M,256M", help="element counts, comma separated (k/M/G)")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--ratio", type=float, default=0.01, help="top-k fraction")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_ops_timing needs a CUDA device (or --device cpu for a check of the script)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(
            "--device cpu runs the Triton kernels through the interpreter: set TRITON_INTERPRET=1"
        )
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (Triton interpreter)"
    notes = [
        f"device: {gpu}; sizes {args.sizes} elements; dtypes {args.dtypes}; top-k ratio {args.ratio}.",
        "GB/s counts the bytes any implementation must move (inputs once, outputs once); ratio is that over "
        "the same run's memcpy GB/s for the same size and dtype, so 1.0 is the memory-bound limit; "
        "'x torch' is torch's op's time over the kernel's.",
    ]
    if device.type == "cpu":
        notes.append("CPU through Triton's interpreter: checks the script, measures nothing.")
    name = f"gpu_ops_timing_{gpu_slug(gpu)}" if device.type == "cuda" else "gpu_ops_timing_cpu_check"
    rows: list[Row] = []
    for n in sizes:
        for dtype in dtypes:
            rows += _rows(n, dtype, device, args.ratio, args.repeat)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the last size's buffers are gone; give their memory back
            # Written after every size and dtype, so a run stopped by its time box keeps what it measured.
            try:
                write_results(name, rows, notes=notes, plot_metric="time")
            except ImportError as exc:  # matplotlib is optional on a bare GPU machine; the table is printed
                print(f"results not written: {exc}")
    print(markdown_table(rows))
    print("\n".join(notes))


if __name__ == "__main__":
    main()
