"""benchmarks/peers.py: the torchdata.nodes and SPDL pipelines that bench_loader and bench_images time;
tiny data, and each peer's tests skip with the measured reason when it cannot run here."""

from __future__ import annotations

import argparse
import io
import math
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import bench_loader_cases, bench_loader_data, peers


def _skip_without(peer: str) -> None:
    reason = peers.unavailable(peer)
    if reason is not None:
        pytest.skip(reason)


class _Tiny(torch.utils.data.Dataset):
    """117 samples of 3x4x4 uint8 whose first byte is the index; label = index * 3."""

    def __init__(self) -> None:
        rng = np.random.default_rng(zlib.crc32(b"peers tiny"))
        self.x = rng.integers(0, 256, size=(117, 3, 4, 4), dtype=np.uint8)
        self.x[:, 0, 0, 0] = np.arange(117)
        self.y = np.arange(117) * 3

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.x[i].copy()), int(self.y[i])

    def gather(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.x[indices]), torch.from_numpy(self.y[indices])


@pytest.mark.parametrize("gathered", [False, True], ids=["per sample", "batch gather"])
@pytest.mark.parametrize(
    "peer, batches",
    [("torchdata.nodes", peers.torchdata_nodes_batches), ("spdl.pipeline", peers.spdl_batches)],
    ids=["torchdata.nodes", "spdl"],
)
def test_a_peer_yields_every_sample_once_in_batches(peer, batches, gathered):
    _skip_without(peer)
    data = _Tiny()
    got = list(batches(data, 13, 2, 0, data.gather if gathered else None))
    assert [len(labels) for _, labels in got] == [13] * 9
    images = torch.cat([images for images, _ in got])
    labels = torch.cat([labels for _, labels in got])
    assert sorted(labels.tolist()) == [3 * i for i in range(117)]
    assert labels.tolist() != sorted(labels.tolist())  # shuffled
    assert torch.equal(images, torch.from_numpy(data.x[labels.numpy() // 3]))  # each image with its label


def test_the_order_comes_from_the_seed():
    _skip_without("spdl.pipeline")
    data = _Tiny()
    first = [b[1].tolist() for b in peers.spdl_batches(data, 13, 2, 0)]
    assert first == [b[1].tolist() for b in peers.spdl_batches(data, 13, 2, 0)]
    assert first != [b[1].tolist() for b in peers.spdl_batches(data, 13, 2, 1)]


def _gradient_jpeg(height: int, width: int, seed: int) -> bytes:
    """A smooth picture (two gradients and a tint), so that two JPEG decoders agree to a few levels."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    tint = np.random.default_rng(seed).integers(30, 200, 3)
    pixels = np.stack([x * 255 // width, y * 255 // height, np.full_like(x, tint[0])], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _tar(path: Path, sizes: list[tuple[int, int]]) -> str:
    with tarfile.open(path, "w") as tar:
        for i, (h, w) in enumerate(sizes):
            for ext, data in (("jpg", _gradient_jpeg(h, w, i)), ("cls", str(i * 7).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


_SIZES = [(90, 120), (64, 64), (133, 71), (70, 99), (101, 80)]


def test_tar_samples_pair_each_jpeg_with_its_label(tmp_path):
    samples = list(peers.tar_samples([_tar(tmp_path / "a.tar", _SIZES)]))
    assert [label for _, label in samples] == [0, 7, 14, 21, 28]
    assert all(jpg[:2] == b"\xff\xd8" for jpg, _ in samples)


def _pillow_eval(img, size: int) -> torch.Tensor:
    from PIL import Image

    from fastio.assembly.image import center_crop_box, resize_shorter_side

    rh, rw = resize_shorter_side(img.height, img.width, round(size * 256 / 224))
    box = center_crop_box(rh, rw, size, size)
    img = img.resize((rw, rh), Image.BILINEAR)
    return torch.from_numpy(np.array(img.crop((box.left, box.top, box.left + size, box.top + size))))


def test_the_torchdata_nodes_image_pipeline_batches_transformed_images(tmp_path):
    _skip_without("torchdata.nodes")
    path = _tar(tmp_path / "a.tar", _SIZES)
    got = list(peers.torchdata_nodes_image_batches([path], lambda img: _pillow_eval(img, 32), 2, 2))
    assert [tuple(images.shape) for images, _ in got] == [(2, 32, 32, 3), (2, 32, 32, 3), (1, 32, 32, 3)]
    assert torch.cat([labels for _, labels in got]).tolist() == [0, 7, 14, 21, 28]


def test_spdl_decodes_the_same_eval_crop_as_pillow(tmp_path):
    """Same boxes, different decoder and scaler: on smooth pictures the two agree to a few levels, while a
    crop off by a few pixels, a flip or swapped axes would differ by tens."""
    _skip_without("spdl.io")
    from PIL import Image

    path = _tar(tmp_path / "a.tar", _SIZES)
    got = list(peers.spdl_image_batches([path], 32, False, 5, 2))
    ((images, labels),) = got
    assert images.shape == (5, 32, 32, 3) and images.dtype == torch.uint8
    assert labels.tolist() == [0, 7, 14, 21, 28]
    for image, (jpg, _) in zip(images, peers.tar_samples([path]), strict=True):
        with Image.open(io.BytesIO(jpg)) as img:
            reference = _pillow_eval(img.convert("RGB"), 32)
        assert (image.float() - reference.float()).abs().mean() < 4


def test_spdl_train_crops_vary_with_the_random_draws(tmp_path):
    _skip_without("spdl.io")
    path = _tar(tmp_path / "a.tar", [(120, 160)] * 4)
    ((images, _),) = list(peers.spdl_image_batches([path], 24, True, 4, 1))
    assert images.shape == (4, 24, 24, 3)
    assert len({tuple(im[:, :, 0].float().mean(dim=0).round().tolist()) for im in images}) > 1


def test_an_unknown_peer_is_named_in_the_error():
    with pytest.raises(ValueError, match="unknown peer 'ffcv'"):
        peers.unavailable("ffcv")


def test_a_peer_that_cannot_run_gets_a_row_with_the_reason(monkeypatch):
    monkeypatch.setattr(peers, "unavailable", lambda peer: f"{peer} does not import (ImportError: test)")
    data = _Tiny()
    args = argparse.Namespace(batch=13, peer_seconds=0.01)
    rows = bench_loader_cases.peer_rows(data.x, data.y, None, args, limit=1000.0)
    assert [r.backend for r in rows] == list(bench_loader_cases.PEER_LOADERS)
    assert all(math.isnan(r.value) for r in rows)
    assert rows[0].extra["status"] == "torchdata.nodes does not import (ImportError: test)"
    notes = bench_loader_cases.peer_notes(rows)
    assert (
        "fixed: SPDL pipeline threads=2: no value (spdl.pipeline does not import (ImportError: test))"
        in notes
    )


def test_the_peers_take_turns_with_streamloader_over_the_same_shard(tmp_path):
    _skip_without("torchdata.nodes")
    _skip_without("spdl.pipeline")
    fixed_dir = bench_loader_data.write_fixed(tmp_path, 300)
    x, y, _ = bench_loader_data.memmap_views(fixed_dir)
    args = argparse.Namespace(batch=13, peer_seconds=0.01)
    rows = bench_loader_cases.peer_rows(x, y, fixed_dir, args, limit=1e9)
    assert [r.backend for r in rows] == [*bench_loader_cases.PEER_LOADERS, bench_loader_cases.IN_TURNS]
    assert all(r.value > 0 and r.extra["status"] == "ok" and r.ratio_to == "memmap" for r in rows)
    ours = rows[-1].value
    ratio = ours / rows[0].value
    expected = f"StreamLoader / torchdata.nodes ParallelMapper threads=2 = {ratio:.2f}x (in turns, same run)"
    assert f"fixed: {expected}" in bench_loader_cases.peer_notes(rows)
