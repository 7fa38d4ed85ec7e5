"""How bench_loader times each contender, and the row it makes of a rate.

Every rate is samples/s over whole batches, timed from the first batch (:func:`timed_rate`), or the median
of a ``StreamLoader``'s epochs after a warm-up epoch (:func:`stream_epochs`, with the process's resident
memory after each).

Example::

    limit = memmap_gather_rate(x, 256, len(x))
    print(rate_row("fixed", "numpy memmap gather (limit)", limit, IMAGE_BYTES + 8))
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from benchmarks.bench_loader_data import IMAGE_SHAPE
from benchmarks.harness import Row

__all__ = [
    "dataloader_rate",
    "memmap_gather_rate",
    "rate_row",
    "rss_text",
    "stream_epochs",
    "timed_rate",
    "webloader_rate",
]


def _rss_mb() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


def timed_rate(
    batches: Iterable[Any], count: Callable[[Any], int], limit: int, seconds: float = float("inf")
) -> float:
    """samples/s of iterating ``batches`` until ``limit`` samples, ``seconds`` or the end, timed from the
    first batch."""
    it = iter(batches)
    first = next(it)
    seen = 0
    start = time.perf_counter()
    for batch in it:
        seen += count(batch)
        if seen >= limit or time.perf_counter() - start >= seconds:
            break
    del first
    return seen / (time.perf_counter() - start)


def memmap_gather_rate(x: np.memmap, batch: int, limit: int) -> float:
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))[:limit]
    out = np.empty((batch, *IMAGE_SHAPE), np.uint8)
    rates = []
    for _ in range(
        2
    ):  # the first pass maps the pages into this process, as StreamLoader's warm-up epoch does
        start = time.perf_counter()
        for b in range(0, len(order) - batch + 1, batch):
            np.take(x, order[b : b + batch], axis=0, out=out)
        rates.append((len(order) // batch * batch) / (time.perf_counter() - start))
    return rates[-1]


def dataloader_rate(
    dataset: torch.utils.data.Dataset, batch: int, workers: int, limit: int, collate: Callable | None = None
) -> float:
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate,
        persistent_workers=False,
    )
    return timed_rate(
        loader, lambda b: len(b[1]) if isinstance(b, (list, tuple)) and collate is None else len(b), limit
    )


def stream_epochs(
    source: Any, batch: int, epochs: int, **kwargs: Any
) -> tuple[float, list[dict[str, float]], Any]:
    import fastio

    loader = fastio.StreamLoader(source, batch_size=batch, seed=0, **kwargs)
    for _ in loader:  # warm-up epoch: lazy checksums and page cache, reported in the notes
        pass
    first_epoch = loader.stats()
    rates, rss = [], []
    for epoch in range(1, epochs + 1):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
        rates.append(loader.stats()["samples_per_s"])
        gc.collect()
        rss.append(_rss_mb())
    return float(np.median(rates)), rss, first_epoch


def webloader_rate(pattern: str, batch: int, workers: int, limit: int) -> float:
    import webdataset as wds

    dataset = (
        wds.WebDataset(pattern, shardshuffle=False, empty_check=False)
        .shuffle(1000)
        .decode()
        .to_tuple("x.npy", "cls")
        .batched(batch)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers)
    return timed_rate(loader, lambda b: len(b[1]), limit)


def rate_row(
    case: str,
    backend: str,
    rate: float,
    sample_bytes: float,
    ratio_to: tuple[str, float] | None = None,
    **extra: Any,
) -> Row:
    """A samples/s row of ``case`` with its MB/s (``sample_bytes`` per sample), its ratio to
    ``ratio_to`` (a label and its rate) when given, and ``extra`` columns that are not None."""
    row = Row(
        case, backend, "samples/s", rate, "samples/s", extra={"MB/s": f"{rate * sample_bytes / 1e6:,.0f}"}
    )
    if ratio_to is not None:
        row.ratio, row.ratio_to = rate / ratio_to[1], ratio_to[0]
    row.extra.update({k: v for k, v in extra.items() if v is not None})
    return row


def rss_text(rss: list[dict[str, float]]) -> str:
    """Resident memory after each epoch as ``"anon+file / ..."`` MB (from :func:`stream_epochs`)."""
    return " / ".join(f"{r['RssAnon']:.0f}+{r['RssFile']:.0f}" for r in rss)
