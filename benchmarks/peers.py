"""Peer loaders measured beside fastio in bench_loader and bench_images: ``torchdata.nodes`` and SPDL.

Each peer runs the pipeline its own documentation builds, over the same bytes as ours, in the same run:

* ``torchdata.nodes`` (torchdata 0.11): ``SamplerWrapper -> ParallelMapper(threads) -> Batcher ->
  Mapper(default_collate) -> Prefetcher -> Loader`` over a map-style dataset, or over tar samples for
  images (``IterableWrapper``), with the same Pillow transforms as the DataLoader rows.
* SPDL (``spdl`` 0.8): ``PipelineBuilder().add_source(...).pipe(fn, concurrency=threads).aggregate(batch)
  .pipe(collate).add_sink(...)``; for images, its own tar reader (``spdl.io.iter_tarfile``) and its own
  decode and resize (``spdl.io``, FFmpeg's libavcodec + swscale filter graph).

Either may be missing: :func:`unavailable` says why, measured (the import's or the first decode's error),
and the benchmark writes a row without a value and a note with that reason instead of failing. Install
them with ``pip install --no-deps spdl==0.8.0 spdl-core==0.8.0 spdl-io==0.8.0 torchdata==0.11.0`` (their
own dependencies would resolve another torch); SPDL's decode also needs FFmpeg 4-9 shared libraries
(``apt-get install libavformat59 libavfilter8 libavdevice59`` on Debian 12).

Example::

    reason = unavailable("torchdata.nodes")
    if reason is None:
        for images, labels in torchdata_nodes_batches(dataset, batch=256, threads=2, seed=0):
            ...
"""

from __future__ import annotations

import functools
import io
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

__all__ = [
    "PEERS",
    "spdl_batches",
    "spdl_image_batches",
    "tar_samples",
    "torchdata_nodes_batches",
    "torchdata_nodes_image_batches",
    "unavailable",
    "versions",
]

PEERS = ("torchdata.nodes", "spdl.pipeline", "spdl.io")
_DISTRIBUTIONS = {"torchdata.nodes": "torchdata", "spdl.pipeline": "spdl-core", "spdl.io": "spdl-io"}
_PREFETCH = 2  # batches each peer keeps ready, as DataLoader's prefetch_factor


@functools.cache
def unavailable(peer: str) -> str | None:
    """Why ``peer`` (one of :data:`PEERS`) cannot run here, measured; None when it can. For ``spdl.io``
    this decodes a small JPEG, since its FFmpeg libraries are loaded at the first call, not at import."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; choose from {PEERS}")
    try:
        module = __import__(peer, fromlist=["_"])
    except ImportError as exc:
        return f"{_DISTRIBUTIONS[peer]} does not import ({type(exc).__name__}: {exc})"
    if peer == "spdl.io":
        try:
            module.load_image(_tiny_jpeg())
        except (RuntimeError, OSError) as exc:  # libavutil & co. missing: one line of the error is enough
            return f"spdl.io cannot decode: {str(exc).split(', ')[0]}"
    return None


def versions() -> dict[str, str]:
    """The installed version of each peer's distribution (``"-"`` when absent)."""
    from importlib import metadata

    found = {}
    for dist in sorted(set(_DISTRIBUTIONS.values())):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "-"
    return found


def _tiny_jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 8), (200, 30, 90)).save(buf, format="JPEG")
    return buf.getvalue()


# -- map-style data (bench_loader) -------------------------------------------------------------------
def _order(size: int, seed: int) -> list[int]:
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()


def torchdata_nodes_batches(
    dataset: torch.utils.data.Dataset,
    batch: int,
    threads: int,
    seed: int,
    gather: Callable[[list[int]], Any] | None = None,
) -> Iterable[Any]:
    """torchdata.nodes' map-style recipe: random sampler, ``ParallelMapper`` of ``dataset[i]`` on
    ``threads`` threads, ``Batcher``, ``default_collate``, ``Prefetcher``. With ``gather`` (a batch from a
    list of indices), the indices are batched first and the mapper runs once per batch.

    Example::

        batches = torchdata_nodes_batches(dataset, batch=256, threads=2, seed=0)
    """
    import torchdata.nodes as tn

    sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    node: Any = tn.SamplerWrapper(sampler)
    if gather is None:
        node = tn.ParallelMapper(node, map_fn=dataset.__getitem__, num_workers=threads, method="thread")
        node = tn.Mapper(tn.Batcher(node, batch_size=batch, drop_last=False), default_collate)
    else:
        node = tn.Batcher(node, batch_size=batch, drop_last=False)
        node = tn.ParallelMapper(node, map_fn=gather, num_workers=threads, method="thread")
    return tn.Loader(tn.Prefetcher(node, prefetch_factor=_PREFETCH))


def spdl_batches(
    dataset: torch.utils.data.Dataset,
    batch: int,
    threads: int,
    seed: int,
    gather: Callable[[list[int]], Any] | None = None,
) -> Iterator[Any]:
    """SPDL's pipeline over a map-style dataset: shuffled indices, ``dataset[i]`` on ``threads`` threads,
    ``aggregate(batch)``, ``default_collate``. With ``gather``, the source yields lists of ``batch`` indices
    and the pipe runs once per batch: each item crossing a stage costs SPDL's event loop ~0.1 ms, which
    sample by sample (or aggregating single indices) bounds it at thousands of samples/s on 2 cores.

    Example::

        batches = spdl_batches(dataset, batch=256, threads=2, seed=0)
    """
    order = _order(len(dataset), seed)  # type: ignore[arg-type]
    if gather is None:
        return _spdl_run(order, dataset.__getitem__, threads, batch)
    return _spdl_run([order[i : i + batch] for i in range(0, len(order), batch)], gather, threads)


def _spdl_run(
    source: Iterable[Any], fn: Callable[[Any], Any], threads: int, batch: int | None = None
) -> Iterator[Any]:
    """``fn`` over ``source`` on ``threads`` threads, in input order; then, given ``batch``, items
    aggregated into batches of that size and collated."""
    from spdl.pipeline import PipelineBuilder

    builder = PipelineBuilder().add_source(source).pipe(fn, concurrency=threads, output_order="input")
    if batch is not None:
        builder = builder.aggregate(batch).pipe(default_collate)
    pipeline = builder.add_sink(_PREFETCH).build(num_threads=threads)
    with pipeline.auto_stop():
        yield from pipeline.get_iterator()


# -- JPEG tars (bench_images) ------------------------------------------------------------------------
def _grouped(members: Iterable[tuple[str, Any]]) -> Iterator[tuple[bytes, int]]:
    """``(jpg bytes, cls)`` per sample from a tar's members in order (``key.jpg``, ``key.cls``)."""
    current, sample = None, {}
    for name, data in members:
        key, _, ext = name.partition(".")
        if key != current:
            if "jpg" in sample:
                yield sample["jpg"], int(sample["cls"])
            current, sample = key, {}
        sample[ext] = bytes(data)
    if "jpg" in sample:
        yield sample["jpg"], int(sample["cls"])


def tar_samples(paths: Sequence[str]) -> Iterator[tuple[bytes, int]]:
    """The ``(jpg, cls)`` samples of WebDataset tars, read with Python's ``tarfile``."""
    import tarfile

    for path in paths:
        with tarfile.open(path) as tar:
            yield from _grouped((m.name, tar.extractfile(m).read()) for m in tar if m.isfile())  # type: ignore[union-attr]


def torchdata_nodes_image_batches(
    paths: Sequence[str], transform: Callable[[Any], torch.Tensor], batch: int, threads: int
) -> Iterable[Any]:
    """torchdata.nodes over tar samples: ``IterableWrapper``, ``ParallelMapper`` (Pillow decode +
    ``transform``) on ``threads`` threads, ``Batcher``, ``default_collate``, ``Prefetcher``."""
    import torchdata.nodes as tn

    def decode(sample: tuple[bytes, int]) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(io.BytesIO(sample[0])) as img:
            return transform(img.convert("RGB")), sample[1]

    node: Any = tn.IterableWrapper(tar_samples(paths))
    node = tn.ParallelMapper(node, map_fn=decode, num_workers=threads, method="thread")
    node = tn.Batcher(node, batch_size=batch, drop_last=False)
    node = tn.Mapper(node, default_collate)
    return tn.Loader(tn.Prefetcher(node, prefetch_factor=_PREFETCH))


def _spdl_filter(width: int, height: int, size: int, train: bool) -> str:
    """FFmpeg's filter graph for torchvision's train (RandomResizedCrop + flip) or eval (Resize + CenterCrop)
    geometry, with fastio's torchvision-equal boxes, to ``size`` x ``size`` RGB."""
    from fastio.assembly.image import DRAWS, center_crop_box, random_resized_crop_box, resize_shorter_side

    if train:
        draws = np.array([random.random() for _ in range(DRAWS)])
        box = random_resized_crop_box(height, width, draws, (0.08, 1.0), (3 / 4, 4 / 3))
        flip = ",hflip" if random.random() < 0.5 else ""
        steps = f"crop={box.width}:{box.height}:{box.left}:{box.top},scale={size}:{size}:flags=bilinear{flip}"
    else:
        rh, rw = resize_shorter_side(height, width, round(size * 256 / 224))
        box = center_crop_box(rh, rw, size, size)
        steps = f"scale={rw}:{rh}:flags=bilinear,crop={size}:{size}:{box.left}:{box.top}"
    return f"{steps},format=rgb24"


def spdl_image_batches(
    paths: Sequence[str], size: int, train: bool, batch: int, threads: int
) -> Iterator[Any]:
    """SPDL end to end: its tar reader, then per image its demuxer, FFmpeg decode and filter graph
    (crop, bilinear scale, flip) on ``threads`` threads, ``aggregate(batch)``, ``default_collate``."""
    import spdl.io

    def samples() -> Iterator[tuple[bytes, int]]:
        for path in paths:
            with open(path, "rb") as fh:
                yield from _grouped(spdl.io.iter_tarfile(fh.read()))

    def decode(sample: tuple[bytes, int]) -> tuple[torch.Tensor, int]:
        packets = spdl.io.demux_image(sample[0])
        frames = spdl.io.decode_packets(
            packets, filter_desc=_spdl_filter(packets.width, packets.height, size, train)
        )
        return torch.from_numpy(spdl.io.to_numpy(spdl.io.convert_frames(frames))), sample[1]

    return _spdl_run(samples(), decode, threads, batch)
