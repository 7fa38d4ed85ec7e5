"""The image pipeline as a batch stage: encoded JPEG/PNG/WebP bytes -> a fixed ``[B, H, W, 3]`` uint8 batch.

:class:`ImageStage` runs inside :class:`fastio.StreamLoader` (``stages=[...]``) on the raw bytes of one
image field, per sample and in GIL-free threads:

1. read the image's size from its header (libjpeg-turbo through simplejpeg for JPEG, Pillow otherwise);
2. pick the crop: torchvision's ``RandomResizedCrop`` geometry for training (10 attempts of an area scale
   and a log-uniform aspect ratio, then the whole-image centre crop clamped to the ratio range), or
   torchvision's ``Resize(eval_resize)`` + ``CenterCrop(size)`` for evaluation (:mod:`fastio.assembly.crop`);
3. decode, at 1/2, 1/4 or 1/8 size in the DCT domain when the crop at that size still covers the output
   (only these power-of-two factors: libjpeg-turbo's other factors decode slower than the full image);
4. resize the crop with antialiased bilinear filtering (torch's uint8 kernel, which follows Pillow's
   ``BILINEAR`` resampling and runs about twice as fast), flip, and write the result straight into the
   loader's output buffer, NHWC or NCHW.

Every random draw comes from :func:`fastio.assembly.seeding.sample_uniforms` with ``STREAM_IMAGE``, so a
sample's crop and flip depend only on ``(seed, epoch, sample index)``, never on ``num_workers`` or resume
points.
:func:`normalize` turns the uint8 batch into normalized floats on whatever device it has been moved to.

Example::

    import fastio
    from fastio.assembly.image import ImageStage, normalize

    stage = ImageStage("jpg", size=224, train=True)
    loader = fastio.StreamLoader("imgs-{000000..000003}.tar", batch_size=64, stages=[stage], num_workers=2)
    for batch in loader:
        x = normalize(batch["image"].to("cuda", non_blocking=True))   # float32 [64, 3, 224, 224]
        y = batch["cls"]                                               # int64 [64]
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import io
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastio.assembly.crop import (
    CROP_ATTEMPTS,
    DRAWS_PER_ATTEMPT,
    CropBox,
    center_crop_box,
    random_resized_crop_box,
    resize_shorter_side,
)
from fastio.assembly.seeding import STREAM_IMAGE, sample_uniforms
from fastio.assembly.stages import StageContext, input_field
from fastio.errors import CorruptShardError, SchemaMismatchError

__all__ = [
    "DRAWS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "CropBox",
    "ImageStage",
    "center_crop_box",
    "normalize",
    "random_resized_crop_box",
    "resize_shorter_side",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

DRAWS = CROP_ATTEMPTS * DRAWS_PER_ATTEMPT + 1  # the crop's (fastio.assembly.crop), and one for the flip
_DCT_FACTORS = (8, 4, 2)  # libjpeg-turbo's fast reduced decodes (1/8, 1/4, 1/2)
_JPEG_MAGIC = b"\xff\xd8"


class ImageStage:
    """Decode, crop, resize and flip one encoded image field into a fixed uint8 batch (a ``BatchStage``).

    1. For each sample, the crop comes from the sample's own uniforms (``STREAM_IMAGE``): torchvision's
       ``RandomResizedCrop(size, scale, ratio)`` + ``RandomHorizontalFlip()`` when ``train``, else
       ``Resize(eval_resize)`` + ``CenterCrop(size)`` (no randomness).
    2. JPEGs decode through libjpeg-turbo (simplejpeg) at the smallest 1/2^k size whose crop still covers
       the output; PNG, WebP, CMYK JPEG and the rest decode through Pillow (converted to RGB, alpha
       dropped).
    3. The crop is resized by antialiased bilinear filtering and written into ``out[output]`` row by row,
       in up to ``ctx.threads`` threads (the decoders and the resize release the GIL).
    4. ``batch[output]`` becomes the uint8 batch and ``batch[field]`` (the bytes) is removed.

    A sample whose bytes do not decode, or whose header claims more than twice Pillow's
    ``MAX_IMAGE_PIXELS`` (a decompression bomb), raises :class:`fastio.CorruptShardError` naming its key;
    a value that is not bytes raises :class:`fastio.SchemaMismatchError`, and a batch without ``field``
    :class:`fastio.errors.MissingFieldError` naming the fields it has. No image is silently replaced.

    Args:
        field: the batch field holding the encoded images (a list of ``bytes``), e.g. ``"jpg"``.
        size: output size, an int (square) or ``(height, width)``.
        train: random crop + flip (True) or the deterministic evaluation crop (False).
        scale, ratio: ``RandomResizedCrop``'s area and aspect-ratio ranges.
        flip: flip horizontally with probability 1/2 (train only).
        eval_resize: the shorter side before the evaluation centre crop (default ``size / 0.875``: 256
            for 224).
        layout: ``"NHWC"`` (``[B, H, W, 3]``) or ``"NCHW"`` (``[B, 3, H, W]``).
        output: the batch field the images are written to.
        dct_scaling: decode JPEGs at reduced size where the crop allows it.

    Example::

        stage = ImageStage("jpg", size=224, train=False, layout="NCHW")
        loader = fastio.StreamLoader("val-{000000..000009}.tar", batch_size=128, stages=[stage])
    """

    def __init__(
        self,
        field: str = "jpg",
        size: int | Sequence[int] = 224,
        *,
        train: bool = True,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: bool = True,
        eval_resize: int | None = None,
        layout: str = "NHWC",
        output: str = "image",
        dct_scaling: bool = True,
    ) -> None:
        sizes = (size, size) if isinstance(size, int) else tuple(int(s) for s in size)
        if len(sizes) != 2 or min(sizes) < 1:
            raise ValueError(f"size must be a positive int or (height, width), got {size!r}")
        if not 0 < scale[0] <= scale[1]:
            raise ValueError(f"scale must satisfy 0 < scale[0] <= scale[1], got {scale!r}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < ratio[0] <= ratio[1], got {ratio!r}")
        if layout not in ("NHWC", "NCHW"):
            raise ValueError(f"layout must be 'NHWC' or 'NCHW', got {layout!r}")
        if eval_resize is None:
            eval_resize = int(round(max(sizes) / 0.875))
        if eval_resize < max(sizes):
            raise ValueError(f"eval_resize ({eval_resize}) must be at least the output size {sizes}")
        self.field, self.size, self.train = field, sizes, bool(train)
        self.scale, self.ratio = (float(scale[0]), float(scale[1])), (float(ratio[0]), float(ratio[1]))
        self.flip, self.eval_resize, self.layout, self.output = bool(flip), int(eval_resize), layout, output
        self.dct_scaling = bool(dct_scaling)
        _require_decoders()
        self._local = threading.local()  # each calling thread's decode pool (see _executor)

    # -- pickling: the decode pools stay behind --------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_local"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def __repr__(self) -> str:
        mode = (
            f"train scale={self.scale} ratio={self.ratio} flip={self.flip}"
            if self.train
            else f"eval resize={self.eval_resize}"
        )
        return f"ImageStage({self.field!r} -> {self.output!r} {self.size} {self.layout}, {mode})"

    # -- the BatchStage contract -----------------------------------------------------------------------
    def output_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """``{output: (torch.uint8, (H, W, 3) or (3, H, W))}``.

        Example::

            assert ImageStage(size=32).output_specs() == {"image": (torch.uint8, (32, 32, 3))}
        """
        h, w = self.size
        return {self.output: (torch.uint8, (h, w, 3) if self.layout == "NHWC" else (3, h, w))}

    def __call__(self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: StageContext) -> Any:
        """Fill ``out[self.output]`` from ``batch[self.field]`` (see the class docstring).

        Example::

            batch = stage({"jpg": [data], "__key__": ["k"]}, {"image": buf}, ctx)
        """
        encoded = input_field(batch, self.field, f"ImageStage(field={self.field!r})")
        images = out[self.output]
        n = len(encoded)
        if images.shape[0] != n:
            raise ValueError(f"{self!r}: {n} images for an output of {images.shape[0]} rows")
        draws = (
            sample_uniforms(ctx.seed, ctx.epoch, ctx.sample_ids, DRAWS, STREAM_IMAGE) if self.train else None
        )
        keys = batch.get("__key__")
        jobs = [
            (images[k], encoded[k], None if draws is None else draws[k], _sample_name(keys, ctx, k))
            for k in range(n)
        ]
        # Always on the stage's own threads, even one: their torch resizes run single-threaded (see
        # _one_torch_thread), while the caller's torch settings stay as they are. One thread takes the
        # whole batch in one hand-off; several take one sample at a time (image sizes vary). Waiting on
        # the results re-raises the first failed sample's error in this thread.
        threads = max(1, min(ctx.threads, n))
        pool = self._executor(threads)
        if threads == 1:
            pool.submit(lambda: [self._one(*job) for job in jobs]).result()
        else:
            list(pool.map(lambda job: self._one(*job), jobs))
        del batch[self.field]
        batch[self.output] = images
        return batch

    def _executor(self, threads: int) -> concurrent.futures.ThreadPoolExecutor:
        """The calling thread's pool of ``threads`` decode threads, made on first use in this process.

        One pool per calling thread, so each of the loader's worker threads gets the ``ctx.threads`` it
        was promised; a pool inherited through fork has no threads, so a new process makes its own."""
        owner = (os.getpid(), threads)
        if getattr(self._local, "owner", None) != owner:
            self._local.pool = concurrent.futures.ThreadPoolExecutor(
                threads, thread_name_prefix="fastio-image", initializer=_one_torch_thread
            )
            self._local.owner = owner
        return self._local.pool

    # -- one sample ------------------------------------------------------------------------------------
    def _one(self, dst: torch.Tensor, data: Any, draws: np.ndarray | None, name: str) -> None:
        if data is None:
            raise CorruptShardError(name, self.field, "an encoded image", "no such member in the sample")
        if not isinstance(data, (bytes, bytearray, memoryview)):  # e.g. a loader built with decode="pil"
            raise SchemaMismatchError(name, self.field, "encoded image bytes", type(data).__name__)
        try:
            pixels, height, width, box = self._decode(data, draws)
        except (ValueError, OSError, SyntaxError, _DecompressionBomb) as exc:  # what the decoders raise
            raise CorruptShardError(
                name,
                self.field,
                "a JPEG, PNG or WebP image",
                f"undecodable bytes ({exc})",
                f"{len(data)} bytes starting {bytes(data[:8]).hex()}",
            ) from exc
        # pixels: uint8 [h', w', 3] of the image whose full size is (height, width); smaller after DCT scaling
        src = _channels_last(pixels)
        oh, ow = self.size
        if box is not None:
            rows, cols = pixels.shape[0] / height, pixels.shape[1] / width
            top, left = int(round(box.top * rows)), int(round(box.left * cols))
            bottom = max(top + 1, int(round((box.top + box.height) * rows)))
            right = max(left + 1, int(round((box.left + box.width) * cols)))
            image = _resize(src[:, :, top:bottom, left:right], oh, ow)[0]
        else:
            rh, rw = resize_shorter_side(height, width, self.eval_resize)
            crop = center_crop_box(rh, rw, oh, ow)
            image = _resize(src, rh, rw)[0, :, crop.top : crop.top + oh, crop.left : crop.left + ow]
        if self._flips(draws):
            image = image.flip(2)
        dst.copy_(image.permute(1, 2, 0) if self.layout == "NHWC" else image)

    def _flips(self, draws: np.ndarray | None) -> bool:
        return self.train and self.flip and float(draws[DRAWS - 1]) < 0.5

    def _crop(self, height: int, width: int, draws: np.ndarray | None) -> CropBox | None:
        """The training crop in full-image pixels; None in eval mode (resize, then the centre crop)."""
        return random_resized_crop_box(height, width, draws, self.scale, self.ratio) if self.train else None

    def _decode(self, raw: Any, draws: np.ndarray | None) -> tuple[np.ndarray, int, int, CropBox | None]:
        """(uint8 ``[h', w', 3]`` pixels, full height, full width, training crop)."""
        if bytes(raw[:2]) == _JPEG_MAGIC:
            import simplejpeg

            try:
                height, width, colorspace, _ = simplejpeg.decode_jpeg_header(raw)
                _check_pixels(height, width)
                if colorspace in ("Gray", "YCbCr", "RGB"):  # CMYK/YCCK: Pillow's conversion is the reference
                    box = self._crop(height, width, draws)
                    factor = self._dct_factor(height, width, box)
                    pixels = simplejpeg.decode_jpeg(
                        raw, "RGB", min_height=-(-height // factor), min_width=-(-width // factor)
                    )
                    return pixels, height, width, box
            except ValueError:
                # strict libjpeg-turbo refuses recoverable damage too (extraneous bytes before a marker),
                # which Pillow decodes; what Pillow refuses as well (truncation) is raised below
                pass
        pixels = _decode_pillow(raw)
        height, width = pixels.shape[:2]
        return pixels, height, width, self._crop(height, width, draws)

    def _dct_factor(self, height: int, width: int, box: CropBox | None) -> int:
        """The largest 1/k reduction whose crop still covers the output (1 when there is none)."""
        if not self.dct_scaling:
            return 1
        if box is not None:
            room_h, room_w = box.height / self.size[0], box.width / self.size[1]
        else:
            rh, rw = resize_shorter_side(height, width, self.eval_resize)
            room_h, room_w = height / rh, width / rw
        for factor in _DCT_FACTORS:
            if room_h >= factor and room_w >= factor:
                return factor
        return 1


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """The ``omp_set_num_threads`` of the GNU OpenMP runtime torch runs its CPU ops on (Linux), else None.

    Found among the libraries this process has mapped, so it is torch's own copy even when the wheel
    vendors it under another name."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
        return ctypes.CDLL(sorted(paths)[0]).omp_set_num_threads if paths else None
    except (OSError, AttributeError):
        return None


def _one_torch_thread() -> None:
    """Decode-thread initializer: torch ops in this thread use this thread alone.

    Each thread that calls a parallel torch op gets its own OpenMP team of ``torch.get_num_threads()``
    threads, so N decode threads would run N teams (N x cores threads, spinning between images). OpenMP's
    thread count is a per-thread setting, unlike ``torch.set_num_threads``, which would change the
    training thread's too."""
    set_num_threads = _omp_set_num_threads()
    if set_num_threads is not None:
        torch.get_num_threads()  # torch's lazy per-thread OpenMP set-up first: it would undo the next line
        set_num_threads(1)


def _require_decoders() -> None:
    """Fail at construction, in the main process, when the ``image`` extra is missing."""
    try:
        import PIL.Image  # noqa: F401
        import simplejpeg  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            'fastio.assembly.image.ImageStage needs Pillow and simplejpeg: pip install "fastcomm[image]" '
            f"(or pip install Pillow simplejpeg); {exc}"
        ) from exc


def _sample_name(keys: Any, ctx: StageContext, k: int) -> str:
    index = int(ctx.sample_ids[k])
    return f"sample {keys[k]!r} (index {index})" if keys is not None else f"sample index {index}"


def _channels_last(pixels: np.ndarray) -> torch.Tensor:
    """A ``[1, 3, h, w]`` view of contiguous HWC pixels with channels-last strides throughout (the batch
    stride too: torch's fast uint8 resize, and a channels-last result, need them)."""
    h, w, c = pixels.shape
    return torch.from_numpy(pixels).as_strided((1, c, h, w), (h * w * c, 1, w * c, c))


def _resize(src: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Antialiased bilinear resize of a uint8 ``[1, 3, h, w]`` image (torch's Pillow-matching kernel)."""
    if src.shape[-2:] == (height, width):
        return src
    return torch.nn.functional.interpolate(
        src, size=(height, width), mode="bilinear", antialias=True, align_corners=False
    )


class _DecompressionBomb(Exception):
    """An image whose header claims more pixels than Pillow would decode (``MAX_IMAGE_PIXELS``)."""


def _check_pixels(height: int, width: int) -> None:
    """Pillow's decompression-bomb limit, applied to JPEGs that libjpeg-turbo decodes as well."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and height * width > 2 * limit:
        raise _DecompressionBomb(f"{height}x{width} pixels, over twice PIL.Image.MAX_IMAGE_PIXELS ({limit})")


def _decode_pillow(raw: Any) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw)) as img:
            return np.array(img.convert("RGB"))  # a writable copy: torch.from_numpy refuses read-only memory
    except Image.DecompressionBombError as exc:
        raise _DecompressionBomb(str(exc)) from exc


def normalize(
    images: torch.Tensor,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    *,
    layout: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(images / 255 - mean) / std`` as a float ``[B, 3, H, W]`` tensor, on ``images``' device.

    NHWC input gives a channels-last ``[B, 3, H, W]`` result (a permuted view, no transpose copy), the
    memory format convolutions run fastest in; NCHW input gives a contiguous one.

    Args:
        images: uint8 ``[B, H, W, 3]`` (NHWC) or ``[B, 3, H, W]`` (NCHW).
        mean, std: per channel, in ``[0, 1]`` units.
        layout: ``"NHWC"`` or ``"NCHW"``; None (the default): the one whose channel dimension (3 or 1)
            has ``len(mean)`` entries. When both have (``[B, 3, H, 3]``), ``layout`` must be given.
        dtype: the floating dtype of the result.

    Example::

        x = normalize(batch["image"].cuda(non_blocking=True))   # float32 [B, 3, 224, 224]
    """
    if len(mean) != len(std):
        raise ValueError(f"normalize: {len(mean)} means but {len(std)} stds; give one of each per channel")
    layout = _image_layout(tuple(images.shape), len(mean), layout)
    chw = images.permute(0, 3, 1, 2) if layout == "NHWC" else images
    scale = 1.0 / (255.0 * torch.tensor(std, dtype=torch.float64))
    shift = -torch.tensor(mean, dtype=torch.float64) / torch.tensor(std, dtype=torch.float64)
    result = chw.to(dtype)
    result.mul_(scale.to(device=images.device, dtype=dtype).view(1, -1, 1, 1))
    return result.add_(shift.to(device=images.device, dtype=dtype).view(1, -1, 1, 1))


_CHANNEL_DIM = {"NCHW": 1, "NHWC": 3}


def _image_layout(shape: tuple[int, ...], channels: int, layout: str | None) -> str:
    """``layout`` checked against ``shape``; if None, the one layout whose channel dimension has
    ``channels`` entries. Never a guess: a shape both layouts fit needs ``layout``."""
    if layout is not None and layout not in _CHANNEL_DIM:
        raise ValueError(f"layout must be 'NHWC' or 'NCHW', got {layout!r}")
    if len(shape) != 4:
        raise ValueError(f"normalize: images {shape} are not a batch [B, H, W, C] or [B, C, H, W]")
    fits = [name for name, dim in _CHANNEL_DIM.items() if shape[dim] == channels]
    where = f"images {shape} with {channels} means and stds"
    if layout is None and len(fits) == 1:
        return fits[0]
    if layout is None and fits:
        raise ValueError(
            f"normalize: {where}: dims 1 and 3 both have {channels} entries, so the layout is ambiguous: "
            "pass layout='NCHW' ([B, C, H, W]) or layout='NHWC' ([B, H, W, C])"
        )
    if not fits:
        raise ValueError(
            f"normalize: {where}: neither dim 1 (NCHW) nor dim 3 (NHWC) has {channels} entries; give one "
            "mean and one std per channel"
        )
    if layout not in fits:
        dim = _CHANNEL_DIM[layout]
        raise ValueError(
            f"normalize: {where}: layout={layout!r} puts the channels in dim {dim}, which has {shape[dim]}; "
            f"these images are {fits[0]}: pass layout={fits[0]!r} (or leave layout out)"
        )
    return layout


def _reference_image(stage: ImageStage, data: bytes, draws: np.ndarray | None) -> np.ndarray:
    """The specification :class:`ImageStage` is held to, in plain Pillow: full decode, crop, resize, flip.

    Returns one uint8 image in the stage's layout (``[H, W, 3]`` or ``[3, H, W]``).

    Example::

        ref = _reference_image(ImageStage(size=64), jpeg_bytes, sample_uniforms(0, 0, [7], DRAWS)[0])
    """
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
    width, height = rgb.size
    oh, ow = stage.size
    if stage.train:
        box = random_resized_crop_box(height, width, draws, stage.scale, stage.ratio)
        crop = rgb.crop((box.left, box.top, box.left + box.width, box.top + box.height))
        result = crop.resize((ow, oh), Image.BILINEAR)
    else:
        rh, rw = resize_shorter_side(height, width, stage.eval_resize)
        box = center_crop_box(rh, rw, oh, ow)
        result = rgb.resize((rw, rh), Image.BILINEAR).crop((box.left, box.top, box.left + ow, box.top + oh))
    if stage._flips(draws):
        result = result.transpose(Image.FLIP_LEFT_RIGHT)
    pixels = np.asarray(result)
    return pixels if stage.layout == "NHWC" else pixels.transpose(2, 0, 1)
