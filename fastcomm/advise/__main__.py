"""``python -m fastcomm.advise``: the predicted step time per method, flat and two-level, with the reason.

Example::

    python -m fastcomm.advise --params 1.3e9 --gpus 64 --gpus-per-node 8 --link 25gbit --intra nvlink \\
        --step-compute 0.8s --methods allreduce,quantize8,quantize4,sign
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

import torch

from fastcomm.advise.kernels import kernel_rates
from fastcomm.advise.methods import METHODS, method_of
from fastcomm.advise.model import parse_seconds
from fastcomm.advise.prediction import format_table, predict

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastcomm.advise",
        description="The predicted step time per hook, flat and two-level, with the reason.",
    )
    parser.add_argument("--params", type=float, required=True, help="fp32 parameters, e.g. 1.3e9")
    parser.add_argument("--gpus", type=int, required=True, help="ranks in all")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (default: --gpus)")
    parser.add_argument(
        "--link", default="25gbit", help="each node's link to the others: 25gbit, 100mbit, 12GB/s"
    )
    parser.add_argument(
        "--intra", default="nvlink", help="the link inside a node: nvlink, pcie, loopback, a rate"
    )
    parser.add_argument("--step-compute", default="0.5s", help="compute per step without communication: 0.8s")
    parser.add_argument("--latency", default=None, help="per-message latency of --link (default 25us)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument(
        "--methods",
        default=",".join(m.name for m in METHODS),
        help="comma-separated method names to price (default: all): " + ", ".join(m.name for m in METHODS),
    )
    parser.add_argument(
        "--kernels", default=None, help="a bench_kernels JSON file for the kernel throughputs"
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=("cpu", "cuda"),
        help="where the compression kernels run: their rates come from bench_kernels results for that "
        "device when this is a checkout, else are measured there (default: cuda when there is one)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as caught:  # an old method name's DeprecationWarning
            warnings.simplefilter("always", DeprecationWarning)
            methods = [method_of(name) for name in args.methods.split(",") if name]
        for warning in caught:
            print(f"fastcomm.advise: {warning.message}", file=sys.stderr)
        if not methods:
            raise ValueError(f"--methods names no method; known: {', '.join(m.name for m in METHODS)}")
        rates = kernel_rates(args.device, args.kernels)
        rows = predict(
            args.params,
            args.gpus,
            args.gpus_per_node,
            args.link,
            args.intra,
            args.step_compute,
            latency_s=None if args.latency is None else parse_seconds(args.latency),
            rates=rates,
            methods=methods,
            bucket_mb=args.bucket_mb,
        )
    except ValueError as error:
        print(f"fastcomm.advise: {error}", file=sys.stderr)
        return 2
    per_node = args.gpus_per_node or args.gpus
    print(
        f"{args.params:.3g} fp32 parameters on {args.gpus} GPUs ({per_node} per node), link {args.link}, "
        f"intra {args.intra}, {parse_seconds(args.step_compute):.3g} s of compute per step"
    )
    print(f"kernel rates: {rates.source} ({rates.device})")
    if rates.device == "cpu":
        print(
            "(compression priced at CPU kernel rates; for GPUs: --device cuda on one, or --kernels with a "
            "bench_kernels_cuda.json)"
        )
    print()
    print(format_table(rows))
    best = min((r for r in rows if r.step_s is not None), key=lambda r: r.step_s or 0.0)
    print(
        f"\nfastest: {best.method} ({best.schedule}), {best.step_s:.3f} s per step, {best.speedup:.2f}x "
        "dense allreduce; speed only: top-k, sign and PowerSGD change the loss (docs/hooks.md)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
