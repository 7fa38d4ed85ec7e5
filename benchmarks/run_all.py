"""`make bench`: every benchmark on built-in synthetic data, one after another, each printing its table."""

from __future__ import annotations

import importlib
import sys
import time

SUITE = ("bench_kernels", "bench_loader", "bench_images", "bench_hooks", "bench_convergence", "bench_remote")


def main() -> int:
    failed = []
    for name in SUITE:
        start = time.perf_counter()
        print(f"\n===== benchmarks/{name}.py =====", flush=True)
        try:
            module = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as exc:
            print(f"(not present yet: {exc})")
            continue
        try:
            print(module.main([]))
        except Exception as exc:  # one benchmark failing must not hide the others' numbers
            failed.append(name)
            print(f"{name} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"({name} took {time.perf_counter() - start:.0f} s)", flush=True)
    print("\nResults: benchmarks/results/*.json, *.md, *.png")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
