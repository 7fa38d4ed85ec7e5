"""ImageStage against its Pillow reference twin, torchvision's crop geometry, and inside StreamLoader."""

from __future__ import annotations

import io
import math
import pickle
import sys
import threading
import zlib

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

import fastio
from fastio.assembly.image import (
    DRAWS,
    ImageStage,
    _reference_image,
    normalize,
    random_resized_crop_box,
)
from fastio.assembly.seeding import STREAM_IMAGE, sample_uniforms
from fastio.assembly.stages import StageContext
from fastio.errors import MissingFieldError


def _rng(case: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(case).encode()))


def _picture(case: object, height: int, width: int, channels: int = 3) -> np.ndarray:
    """Smooth colour waves, a hard-edged block pattern and noise: the content DCT scaling is judged on."""
    rng = _rng(case)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    phase = rng.uniform(0, 2 * np.pi, channels)
    waves = np.stack([128 + 90 * np.sin(x / rng.uniform(9, 40) + p) * np.cos(y / 23 - p) for p in phase], -1)
    blocks = ((x // rng.integers(11, 40)) + (y // rng.integers(11, 40))) % 2 == 0
    waves[blocks] *= 0.55
    waves += rng.normal(0, 6, waves.shape)
    return np.clip(waves, 0, 255).astype(np.uint8)


def _encode(pixels: np.ndarray, fmt: str = "JPEG", mode: str | None = None) -> bytes:
    image = Image.fromarray(pixels)
    if mode is not None:
        image = image.convert(mode)
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return buf.getvalue()


def _run(stage: ImageStage, images: list, ids: np.ndarray, epoch: int = 0, threads: int = 1) -> torch.Tensor:
    dtype, shape = stage.output_specs()[stage.output]
    out = torch.empty((len(images), *shape), dtype=dtype)
    batch = stage(
        {stage.field: list(images), "__key__": [f"k{i}" for i in ids]},
        {stage.output: out},
        StageContext(seed=5, epoch=epoch, sample_ids=ids, threads=threads),
    )
    assert stage.field not in batch and batch[stage.output] is out
    return out


# -- geometry --------------------------------------------------------------------------------------
def _torchvision_get_params(height, width, scale, ratio, uniform, randint):
    """torchvision.transforms.RandomResizedCrop.get_params, as torchvision writes it, with its random
    calls (``torch.empty(1).uniform_(a, b)`` and ``torch.randint(lo, hi)``) passed in."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * uniform(scale[0], scale[1])
        aspect_ratio = math.exp(uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = randint(0, height - h + 1)
            j = randint(0, width - w + 1)
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


GEOMETRY_CASES = [
    (311, 203, (0.08, 1.0), (3 / 4, 4 / 3)),
    (200, 500, (0.08, 1.0), (3 / 4, 4 / 3)),
    (1, 1, (0.08, 1.0), (3 / 4, 4 / 3)),
    (24, 400, (0.9, 1.0), (3 / 4, 4 / 3)),  # too wide for any attempt: the clamped centre-crop fallback
    (400, 24, (0.9, 1.0), (3 / 4, 4 / 3)),  # too tall: the other fallback branch
    (97, 101, (0.99, 1.0), (0.2, 0.3)),  # no attempt fits, ratio clamps the whole image
    (640, 480, (0.25, 0.5), (0.5, 2.0)),
]


class _Draws:
    """torchvision's random calls answered from the stage's uniforms: attempt ``a`` reads slots ``4a``
    (area scale) and ``4a + 1`` (log ratio), and, when it fits, ``4a + 2`` (top) and ``4a + 3`` (left)."""

    def __init__(self, draws: np.ndarray) -> None:
        self.draws, self.uniforms, self.randints = draws, 0, 0

    def uniform(self, lo: float, hi: float) -> float:
        attempt, which = divmod(self.uniforms, 2)
        self.uniforms += 1
        return lo + (hi - lo) * self.draws[4 * attempt + which]

    def randint(self, lo: int, hi: int) -> int:
        slot = 4 * ((self.uniforms - 1) // 2) + 2 + self.randints
        self.randints += 1
        return lo + int(self.draws[slot] * (hi - lo))


@pytest.mark.parametrize("case", GEOMETRY_CASES)
def test_crop_box_is_torchvisions_for_the_same_random_numbers(case):
    height, width, scale, ratio = case
    for sample in range(300):
        draws = _rng((case, sample)).random(DRAWS)
        rng = _Draws(draws)
        expected = _torchvision_get_params(height, width, scale, ratio, rng.uniform, rng.randint)
        box = random_resized_crop_box(height, width, draws, scale, ratio)
        assert (box.top, box.left, box.height, box.width) == expected, sample
        assert 0 <= box.top <= box.top + box.height <= height
        assert 0 <= box.left <= box.left + box.width <= width


# -- the fast path against the Pillow reference twin -------------------------------------------------
# (name, height, width, format, Pillow mode the file is saved in)
IMAGES = [
    ("odd-tall", 311, 203, "JPEG", None),
    ("wide", 200, 500, "JPEG", None),
    ("gray", 257, 199, "JPEG", "L"),
    ("cmyk", 230, 270, "JPEG", "CMYK"),
    ("png-alpha", 181, 243, "PNG", "RGBA"),
    ("webp", 220, 260, "WEBP", None),
    ("large", 1013, 1187, "JPEG", None),  # big enough for 1/2 and 1/4 DCT-domain decodes
]


def _image_bytes(spec: tuple) -> bytes:
    name, height, width, fmt, mode = spec
    pixels = _picture(spec, height, width, 4 if mode == "RGBA" else 3)
    return _encode(pixels, fmt, mode)


# Without DCT scaling both sides decode the same libjpeg-turbo pixels and resize with the same
# fixed-point bilinear filter (torch's uint8 antialiased kernel follows Pillow's); they differ only by +-1
# rounding and where the filter's support meets the crop's edge: bound 0.5 level mean.
# With DCT scaling the fast path starts from a 1/k decode (each 8x8 block's IDCT taken at 8/k x 8/k: the
# image low-passed and subsampled by a different filter than Pillow's triangle) and rounds the crop box
# to whole reduced pixels (a shift of up to k/2 source pixels). On this content (hard edges and 6-level
# pixel noise, which both effects hit hardest) the two measure 2.5-3.7 and 0.6-3 levels mean; the mean
# difference to the reference was 0.9-4.5 levels: bound 6 levels.
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dct", [False, True], ids=["full-decode", "dct-scaled"])
@pytest.mark.parametrize("spec", IMAGES, ids=[s[0] for s in IMAGES])
def test_matches_the_pillow_reference(spec, dct, train):
    data = _image_bytes(spec)
    stage = ImageStage("jpg", size=(96, 112) if spec[0] != "large" else 224, train=train, dct_scaling=dct)
    ids = np.arange(6, dtype=np.int64) + zlib.crc32(spec[0].encode()) % 1000
    fast = _run(stage, [data] * len(ids), ids).numpy().astype(np.int64)
    draws = sample_uniforms(5, 0, ids, DRAWS, STREAM_IMAGE)
    bound = 6.0 if dct and spec[0] == "large" else 0.5
    for row in range(len(ids)):
        ref = _reference_image(stage, data, draws[row] if train else None).astype(np.int64)
        assert fast[row].shape == ref.shape
        diff = np.abs(fast[row] - ref)
        assert diff.mean() < bound, (row, diff.mean(), diff.max())


def test_dct_scaled_decode_is_used_and_reduces_the_image(monkeypatch):
    import simplejpeg

    seen = []
    decode = simplejpeg.decode_jpeg

    def spy(data, *args, **kwargs):
        pixels = decode(data, *args, **kwargs)
        seen.append(pixels.shape[:2])
        return pixels

    monkeypatch.setattr(simplejpeg, "decode_jpeg", spy)
    data = _image_bytes(IMAGES[-1])
    _run(ImageStage(size=224, train=False), [data], np.array([0]))
    # shorter side 1013 -> 256: a 1/2 decode (507 x 594) still covers 256 x 300; 1/4 (254) would not
    assert seen == [(507, 594)]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_nchw_is_nhwc_transposed(train):
    images = [_image_bytes(spec) for spec in IMAGES[:3]]
    ids = np.array([3, 17, 40])
    nhwc = _run(ImageStage(size=(40, 56), train=train, layout="NHWC"), images, ids)
    nchw = _run(ImageStage(size=(40, 56), train=train, layout="NCHW"), images, ids)
    assert nhwc.shape == (3, 40, 56, 3) and nchw.shape == (3, 3, 40, 56)
    assert torch.equal(nhwc.permute(0, 3, 1, 2), nchw)
    assert nhwc.float().std() > 10  # real pixels, not an untouched buffer


def test_threads_and_epochs():
    images = [_image_bytes(spec) for spec in IMAGES[:3]] * 3
    ids = np.arange(100, 109)
    stage = ImageStage(size=48)
    one = _run(stage, images, ids, threads=1)
    assert torch.equal(_run(stage, images, ids, threads=3), one)
    again = _run(pickle.loads(pickle.dumps(stage)), images, ids, threads=2)  # pickles after its pool exists
    assert torch.equal(again, one)
    next_epoch = _run(stage, images, ids, epoch=1)
    assert not any(torch.equal(next_epoch[k], one[k]) for k in range(len(ids)))
    evaluation = ImageStage(size=48, train=False)
    assert torch.equal(_run(evaluation, images, ids), _run(evaluation, images[::-1], ids[::-1]).flip(0))
    assert torch.equal(_run(evaluation, images, ids, epoch=3), _run(evaluation, images, ids))


def test_each_calling_thread_gets_its_own_decode_threads():
    stage = ImageStage(size=16)
    barrier = threading.Barrier(4)  # two callers x ctx.threads=2: only met if all four run at once
    one = stage._one

    def waiting_one(*job):
        barrier.wait(timeout=10)
        return one(*job)

    stage._one = waiting_one
    images = [_image_bytes(IMAGES[0])] * 2
    errors = []

    def caller(first: int) -> None:
        try:
            _run(stage, images, np.array([first, first + 1]), threads=2)
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)

    callers = [threading.Thread(target=caller, args=(first,)) for first in (0, 2)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    assert not errors, errors


def test_decode_threads_run_torch_ops_alone_and_leave_the_caller_as_it_was():
    from fastio.assembly.image import _omp_set_num_threads

    if _omp_set_num_threads() is None:
        pytest.skip("torch does not run its CPU ops on GNU OpenMP here")
    before = torch.get_num_threads()
    inside = ImageStage()._executor(2).submit(torch.get_num_threads).result()
    assert inside == 1 and torch.get_num_threads() == before


def test_flip_is_drawn_per_sample_with_probability_half():
    ids = np.arange(400)
    flips = sample_uniforms(5, 0, ids, DRAWS, STREAM_IMAGE)[:, -1] < 0.5
    assert 150 < flips.sum() < 250
    data = _image_bytes(IMAGES[0])
    flipped = ImageStage(size=32, scale=(1.0, 1.0), ratio=(203 / 311, 203 / 311))
    plain = ImageStage(size=32, scale=(1.0, 1.0), ratio=(203 / 311, 203 / 311), flip=False)
    a = _run(flipped, [data] * 8, ids[:8])
    b = _run(plain, [data] * 8, ids[:8])
    for k in range(8):
        assert torch.equal(a[k], b[k].flip(1) if flips[k] else b[k]), k


def test_jpeg_that_only_pillow_accepts_decodes_as_pillow_does():
    import simplejpeg

    good = _image_bytes(IMAGES[0])
    damaged = good[:-2] + b"\x00\x00\x00" + good[-2:]  # junk before the end marker: a libjpeg warning
    with pytest.raises(ValueError, match="extraneous bytes"):
        simplejpeg.decode_jpeg(damaged)
    stage = ImageStage(size=40)
    ids = np.array([21])
    expected = _reference_image(stage, damaged, sample_uniforms(5, 0, ids, DRAWS, STREAM_IMAGE)[0])
    assert np.abs(_run(stage, [damaged], ids)[0].numpy().astype(int) - expected).mean() < 0.5


# -- bad input ----------------------------------------------------------------------------------------
def _corrupt(kind: str) -> bytes | None:
    good = _image_bytes(IMAGES[0])
    return {
        "truncated-jpeg": good[: len(good) // 2],
        "jpeg-magic-then-garbage": b"\xff\xd8" + _rng(kind).bytes(300),
        "garbage": _rng(kind).bytes(300),
        "empty": b"",
        "truncated-png": _image_bytes(IMAGES[4])[:200],
        "missing-member": None,
    }[kind]


CORRUPTIONS = [
    "truncated-jpeg",
    "jpeg-magic-then-garbage",
    "garbage",
    "empty",
    "truncated-png",
    "missing-member",
]


@pytest.mark.parametrize("kind", CORRUPTIONS)
@pytest.mark.parametrize("threads", [1, 2])
def test_undecodable_image_raises_naming_the_sample(kind, threads):
    good = _image_bytes(IMAGES[1])
    with pytest.raises(fastio.CorruptShardError, match="k11"):
        _run(ImageStage(size=32), [good, _corrupt(kind), good], np.array([10, 11, 12]), threads=threads)


@pytest.mark.parametrize("spec", [IMAGES[0], IMAGES[4]], ids=["jpeg", "png"])
def test_decompression_bomb_raises(spec, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 311 * 203 // 3)  # the images hold 3x that
    with pytest.raises(fastio.CorruptShardError, match="MAX_IMAGE_PIXELS|decompression bomb"):
        _run(ImageStage(size=32), [_image_bytes(spec)], np.array([0]))


def test_decoded_images_are_refused_by_name():
    decoded = torch.zeros(8, 8, 3, dtype=torch.uint8)
    with pytest.raises(fastio.SchemaMismatchError, match="encoded image bytes"):
        _run(ImageStage(size=8), [decoded], np.array([0]))


@pytest.mark.parametrize("missing", ["simplejpeg", "PIL.Image"])
def test_missing_decoder_names_the_extra(missing, monkeypatch):
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import missing` raise ImportError
    with pytest.raises(ImportError, match=r"fastcomm\[image\]"):
        ImageStage()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="layout"):
        ImageStage(layout="HWC")
    with pytest.raises(ValueError, match="eval_resize"):
        ImageStage(size=224, eval_resize=200)
    with pytest.raises(ValueError, match="scale"):
        ImageStage(scale=(0.5, 0.1))


# -- normalize ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_normalize(layout):
    rng = _rng(("normalize", layout))
    shape = (2, 5, 7, 3) if layout == "NHWC" else (2, 3, 5, 7)
    images = torch.from_numpy(rng.integers(0, 256, shape, np.uint8))
    mean, std = (0.1, 0.5, 0.9), (0.2, 0.3, 0.4)
    result = normalize(images, mean, std, layout=layout)
    chw = images.permute(0, 3, 1, 2) if layout == "NHWC" else images
    expected = (chw.double() / 255 - torch.tensor(mean).double().view(1, 3, 1, 1)) / torch.tensor(
        std
    ).double().view(1, 3, 1, 1)
    assert result.shape == (2, 3, 5, 7) and result.dtype == torch.float32
    torch.testing.assert_close(result.double(), expected, rtol=1e-6, atol=1e-6)
    if layout == "NHWC":
        assert result.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="normalize"):
        normalize(images, layout="NCHW" if layout == "NHWC" else "NHWC")


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_normalize_infers_the_layout_from_the_channel_dimension(layout):
    shape = (2, 5, 7, 3) if layout == "NHWC" else (2, 3, 5, 7)
    images = torch.from_numpy(_rng(("infer", layout)).integers(0, 256, shape, np.uint8))
    assert torch.equal(normalize(images), normalize(images, layout=layout))


@pytest.mark.parametrize("shape", [(2, 3, 5, 3), (2, 3, 3, 3)])
def test_normalize_needs_layout_when_both_dimensions_could_be_channels(shape):
    images = torch.zeros(shape, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"ambiguous: pass layout='NCHW' .* or layout='NHWC'"):
        normalize(images)
    assert normalize(images, layout="NHWC").shape == (2, 3, shape[1], shape[2])
    assert normalize(images, layout="NCHW").shape == shape


def test_normalize_with_the_wrong_layout_says_which_to_pass():
    images = torch.zeros((8, 3, 224, 224), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"dim 3, which has 224; these images are NCHW: pass layout='NCHW'"):
        normalize(images, layout="NHWC")


def test_normalize_of_images_without_a_channel_dimension_says_so():
    with pytest.raises(ValueError, match=r"\(2, 4, 5, 7\) with 3 means.*neither dim 1 \(NCHW\) nor dim 3"):
        normalize(torch.zeros((2, 4, 5, 7), dtype=torch.uint8))


# -- inside StreamLoader ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_tars(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    for shard in range(3):
        with wds.TarWriter(str(root / f"imgs-{shard:06d}.tar")) as sink:
            for k in range(9):
                i = shard * 9 + k
                rng = _rng(("tar", i))
                pixels = _picture(("tar", i), int(rng.integers(40, 90)), int(rng.integers(40, 90)))
                sink.write({"__key__": f"s{i:04d}", "jpg": _encode(pixels), "cls": i % 5})
    return str(root / "imgs-{000000..000002}.tar")


def _epoch(pattern, epoch, **kwargs):
    stage = ImageStage(size=32)
    loader = fastio.StreamLoader(
        pattern, batch_size=8, shuffle=True, seed=3, batches=fastio.BatchOptions(stages=[stage]), **kwargs
    )
    loader.set_epoch(epoch)
    images, labels = {}, {}
    for batch in loader:
        assert batch["image"].dtype == torch.uint8 and batch["image"].shape[1:] == (32, 32, 3)
        assert batch["cls"].dtype == torch.int64 and batch["cls"].shape == batch["image"].shape[:1]
        assert "jpg" not in batch
        for row, key in enumerate(batch["__key__"]):
            images[key] = batch["image"][row].clone()
            labels[key] = int(batch["cls"][row])
    assert len(images) == 27 and all(labels[f"s{i:04d}"] == i % 5 for i in range(27))
    return images


def test_same_images_for_any_num_workers_and_new_ones_each_epoch(image_tars):
    base = _epoch(image_tars, 0, num_workers=0)
    process, threads = fastio.WorkerOptions(mode="process"), fastio.WorkerOptions(threads=2)
    for kwargs in ({"num_workers": 2}, {"num_workers": 2, "workers": process}, {"workers": threads}):
        other = _epoch(image_tars, 0, **kwargs)
        assert all(torch.equal(other[k], base[k]) for k in base), kwargs
    following = _epoch(image_tars, 1, num_workers=2)
    assert sum(torch.equal(following[k], base[k]) for k in base) == 0


def test_images_from_a_fastio_shard_bytes_field(tmp_path):
    encoded = [_encode(_picture(("shard", i), 40 + 3 * i, 70 - 2 * i)) for i in range(11)]
    with fastio.ShardWriter(
        tmp_path / "set", schema={"jpg": "bytes", "y": ("int64", ())}, max_samples=4
    ) as w:
        for i, data in enumerate(encoded):
            w.write({"jpg": data, "y": i})
    stage = ImageStage(size=24, train=False, layout="NCHW", dct_scaling=False)  # the tight bound above
    loader = fastio.StreamLoader(
        str(tmp_path / "set"), batch_size=5, batches=fastio.BatchOptions(stages=[stage]), num_workers=2
    )
    seen = 0
    for batch in loader:
        ys = batch["y"].tolist()
        assert batch["image"].shape == (len(ys), 3, 24, 24) and "jpg" not in batch
        for row, i in enumerate(ys):
            expected = _reference_image(stage, encoded[i], None)
            assert np.abs(batch["image"][row].numpy().astype(int) - expected).mean() < 0.5, i
        seen += len(ys)
    assert seen == 11


@pytest.mark.parametrize("worker_mode", ["thread", "process"])
def test_a_field_the_samples_lack_is_named_with_the_fields_they_have(image_tars, worker_mode):
    loader = fastio.StreamLoader(
        image_tars,
        batch_size=8,
        batches=fastio.BatchOptions(stages=[ImageStage("jpeg", size=16)]),
        workers=fastio.WorkerOptions(mode=worker_mode),
        num_workers=1,
    )
    expected = r"ImageStage\(field='jpeg'\): the samples have no field 'jpeg'; their fields: 'cls', 'jpg': "
    expected += "pass field='jpg'"
    with pytest.raises(MissingFieldError, match=expected) as err:
        next(iter(loader))
    assert isinstance(err.value, KeyError) and isinstance(err.value, fastio.SchemaMismatchError)
