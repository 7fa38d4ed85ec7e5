"""Compression kernel throughputs for the cost model: read from ``bench_kernels`` results, or measured here.

Every rate is in bytes of fp32 gradient processed per second (what ``benchmarks/bench_kernels.py`` reports
as "GB/s input"), so a pass over ``n`` elements takes ``4 n / rate``; ``sparse_accumulate`` is in entries
per second. :func:`kernel_rates` picks the source:

1. a given ``bench_kernels`` JSON file;
2. else ``benchmarks/results/bench_kernels.json`` (``bench_kernels_cuda.json`` for ``cuda``) beside the
   package, when this is a checkout and its rows were measured on the same kind of device;
3. else :func:`measure_rates`: each kernel timed on this device (a few seconds on a CPU).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastcomm import ops

__all__ = ["KERNELS", "KernelRates", "kernel_rates", "load_rates", "measure_rates", "results_path"]

# kernel key -> the bench_kernels case that measures it (stochastic rounding and residual_source: what the
# hooks run; the decodes accumulate into a warm buffer, as the two-phase hooks do)
KERNELS: dict[str, str] = {
    "copy": "memcpy (Tensor.copy_)",
    "quantize8": "quantize_blockwise 8-bit stochastic +residual_source",
    "quantize4": "quantize_blockwise 4-bit stochastic +residual_source",
    "dequantize8": "dequantize_blockwise_into 8-bit accumulate",
    "dequantize4": "dequantize_blockwise_into 4-bit accumulate",
    "sign_compress": "sign_compress +residual_source",
    "sign_decompress": "sign_decompress_into accumulate",
    "topk_select": "topk_select approx 1% +residual_source",
    "powersgd_project": "powersgd_project rank 4 +residual",
    "powersgd_back_project": "powersgd_back_project rank 4",
    "powersgd_expand": "powersgd_expand rank 4 +residual",
}
_SPARSE = re.compile(r"^sparse_accumulate (\d+) entries$")


@dataclass(frozen=True)
class KernelRates:
    """Throughputs of the kernels the hooks run, and where they came from.

    Attributes:
        rates: kernel key (:data:`KERNELS`) -> bytes of fp32 input per second.
        sparse_entries_per_s: ``sparse_accumulate`` entries per second (top-k's decode).
        device: ``"cpu"`` or ``"cuda"``.
        threads: CPU threads the rates were measured with (``None`` on a GPU).
        source: the JSON file, or ``"measured"``.

    Example::

        rates = KernelRates({"copy": 10e9}, 1e9, "cpu", 1, "given")
        rates.seconds("copy", 4e6)   # 0.0004
    """

    rates: Mapping[str, float]
    sparse_entries_per_s: float
    device: str
    threads: int | None
    source: str
    notes: tuple[str, ...] = field(default=())

    def seconds(self, kernel: str, nbytes: float) -> float:
        """Seconds for ``kernel`` to process ``nbytes`` of fp32 input."""
        rate = self.rates.get(kernel)
        if rate is None:
            raise KeyError(f"no rate for kernel {kernel!r}; known: {', '.join(sorted(self.rates))}")
        return nbytes / rate

    def scaled(self, factor: float) -> KernelRates:
        """Every rate times ``factor`` (``1/2``: two ranks sharing each core)."""
        return KernelRates(
            {k: v * factor for k, v in self.rates.items()},
            self.sparse_entries_per_s * factor,
            self.device,
            self.threads,
            self.source,
            (*self.notes, f"rates scaled by {factor:.3g}"),
        )


def results_path(device: str = "cpu") -> Path:
    """Where a checkout keeps ``bench_kernels``'s committed results for ``device``."""
    name = "bench_kernels.json" if device == "cpu" else f"bench_kernels_{device}.json"
    return Path(__file__).resolve().parents[2] / "benchmarks" / "results" / name


def load_rates(path: str | Path) -> KernelRates:
    """The rates in a ``bench_kernels`` JSON file (its non-reference rows).

    Raises:
        ValueError: a kernel of :data:`KERNELS` has no row there.
    """
    payload = json.loads(Path(path).read_text())
    rows = [r for r in payload["rows"] if r.get("backend") != "reference" and r.get("value")]
    by_case = {r["case"]: r for r in rows}
    missing = [case for case in KERNELS.values() if case not in by_case]
    sparse = next((r for r in rows if _SPARSE.match(r["case"])), None)
    if missing or sparse is None:
        raise ValueError(f"{path}: no rows for {', '.join(missing or ['sparse_accumulate'])}")
    rates = {key: float(by_case[case]["value"]) * 1e9 for key, case in KERNELS.items()}
    match = _SPARSE.match(sparse["case"])
    assert match is not None
    entries_per_s = int(match.group(1)) / (float(sparse["extra"]["ms"]) / 1e3)
    machine = payload.get("machine", {})
    device = "cuda" if machine.get("cuda") and "cuda" in Path(path).name else "cpu"
    threads = _threads_of(machine) if device == "cpu" else None
    return KernelRates(rates, entries_per_s, device, threads, str(path))


def _threads_of(machine: Mapping[str, Any]) -> int | None:
    for entry in machine.get("fastcomm_backend", {}).values():
        threads = entry.get("cpu", {}).get("threads")
        if threads:
            return int(threads)
    return None


def _median_seconds(fn: Callable[[], object], device: str, repeat: int) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_rates(
    device: str = "cpu",
    numel: int = 1 << 22,
    repeat: int = 5,
    threads: int | None = None,
    kernels: tuple[str, ...] | None = None,
) -> KernelRates:
    """Time each kernel of :data:`KERNELS` on ``numel`` fp32 elements of ``device`` (median of ``repeat``).

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        numel: elements per call; 4M (16 MB) takes about 2 s for every kernel on one core. Measure at the
            size the hooks run (a DDP bucket: 25 MB and up) where that matters: 16 MB still fits one
            32 MB L3 slice of a server CPU, and 8-bit quantization ran 1.5x faster there than at 64 MB.
        repeat: timed calls per kernel.
        threads: CPU threads to measure with (``torch.set_num_threads``; restored after), e.g. 1 for
            ranks that each use one core; ``None`` keeps the current setting.
        kernels: keys of :data:`KERNELS` to time (``None``: all); the rates hold only these (and
            ``sparse_entries_per_s`` is measured only with ``"topk_select"``, else ``nan``).

    Example::

        rates = measure_rates("cpu", numel=1 << 20, repeat=2, threads=1)
        rates.seconds("quantize8", 4 * 25_000_000)   # one 8-bit pass over 25M fp32 gradients
    """
    unknown = sorted(set(kernels or ()) - set(KERNELS))
    if unknown:
        raise ValueError(f"unknown kernels {unknown}; known: {', '.join(KERNELS)}")
    before = torch.get_num_threads()
    if threads is not None and device == "cpu":
        torch.set_num_threads(threads)
    try:
        return _measure(device, numel, repeat, tuple(KERNELS) if kernels is None else tuple(kernels))
    finally:
        torch.set_num_threads(before)


def _measure(device: str, numel: int, repeat: int, kernels: tuple[str, ...]) -> KernelRates:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g).to(device)
    residual, written, into = torch.randn_like(x) * 0.01, torch.empty_like(x), torch.zeros_like(x)
    rates = {key: 4 * numel / _median_seconds(_call(key, x, residual, written, into), device, repeat)
             for key in kernels}  # fmt: skip
    sparse = math.nan
    if "topk_select" in kernels:
        entries = 2 * max(1, numel // 100)
        idx = torch.randint(0, numel, (entries,), generator=g, dtype=torch.int32).to(device)
        vals = torch.randn(entries, generator=g).to(device)
        sparse = entries / _median_seconds(lambda: ops.sparse_accumulate(into, idx, vals), device, repeat)
    threads = torch.get_num_threads() if device == "cpu" else None
    return KernelRates(rates, sparse, device, threads, "measured")


def _call(key: str, x: torch.Tensor, residual: torch.Tensor, written: torch.Tensor,
          into: torch.Tensor) -> Callable[[], object]:  # fmt: skip
    """The call that times kernel ``key`` on ``x`` (its inputs made here, only for it)."""
    if key == "copy":
        out = torch.empty_like(x)
        return lambda: out.copy_(x)
    if key in ("quantize8", "quantize4"):
        bits = int(key[-1])
        return lambda: ops.quantize_blockwise(x, bits, 256, True, 1, written, residual)
    if key in ("dequantize8", "dequantize4"):
        bits = int(key[-1])
        codes, scales = ops.quantize_blockwise(x, bits=bits)
        return lambda: ops.dequantize_blockwise_into(into, codes, scales, bits, 256, True)
    if key == "sign_compress":
        return lambda: ops.sign_compress(x, written, 2048, residual)
    if key == "sign_decompress":
        packed, scales = ops.sign_compress(x)
        return lambda: ops.sign_decompress_into(into, packed, scales, 2048, True)
    if key == "topk_select":
        k = max(1, x.numel() // 100)
        return lambda: ops.topk_select(x, k, written, False, residual)
    cols = min(x.numel(), 4096)
    rows = x.numel() // cols
    matrix, feedback = x[: rows * cols].view(rows, cols), residual[: rows * cols].view(rows, cols)
    g = torch.Generator().manual_seed(1)
    q_t = torch.randn(4, cols, generator=g).to(x.device)
    p_mat = torch.randn(rows, 4, generator=g).to(x.device)
    if key == "powersgd_project":
        p_out, formed = torch.empty_like(p_mat), torch.empty_like(matrix)
        return lambda: ops.powersgd_project(p_out, formed, q_t, matrix, feedback)
    if key == "powersgd_back_project":
        q_out = torch.empty_like(q_t)
        return lambda: ops.powersgd_back_project(q_out, p_mat, matrix)
    assert key == "powersgd_expand", key
    approx, owed = torch.empty_like(matrix), matrix.clone()
    return lambda: ops.powersgd_expand(approx, p_mat, q_t, owed)


def kernel_rates(device: str = "cpu", path: str | Path | None = None) -> KernelRates:
    """The rates from ``path``, else the committed results for ``device``, else measured on ``device``.

    Example::

        rates = kernel_rates("cpu")
        print(rates.source, rates.rates["sign_compress"] / 1e9, "GB/s")
    """
    if path is not None:
        return load_rates(path)
    committed = results_path(device)
    if committed.is_file():
        try:
            return load_rates(committed)
        except (ValueError, KeyError, json.JSONDecodeError):
            pass  # an older results file without every kernel: measure instead
    return measure_rates(device)
