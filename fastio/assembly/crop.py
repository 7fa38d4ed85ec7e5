"""torchvision's crop geometry, as plain functions of an image's size and given uniforms: what
:class:`fastio.assembly.image.ImageStage` crops, and what its tests hold it to.

* :func:`random_resized_crop_box`: ``RandomResizedCrop.get_params`` (training);
* :func:`resize_shorter_side` and :func:`center_crop_box`: ``Resize(shorter)`` + ``CenterCrop`` (evaluation).

Example::

    from fastio.assembly.crop import center_crop_box, resize_shorter_side

    box = center_crop_box(*resize_shorter_side(300, 400, 256), 224, 224)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = [
    "CROP_ATTEMPTS",
    "DRAWS_PER_ATTEMPT",
    "CropBox",
    "center_crop_box",
    "random_resized_crop_box",
    "resize_shorter_side",
]

CROP_ATTEMPTS = 10  # torchvision's RandomResizedCrop tries this many (scale, ratio) draws
DRAWS_PER_ATTEMPT = 4  # area scale, log aspect ratio, top, left


@dataclasses.dataclass(frozen=True)
class CropBox:
    """A crop of an image in pixels: rows ``top:top+height``, columns ``left:left+width``.

    Example::

        box = CropBox(top=10, left=20, height=100, width=120)
    """

    top: int
    left: int
    height: int
    width: int


def random_resized_crop_box(
    height: int, width: int, draws: np.ndarray, scale: tuple[float, float], ratio: tuple[float, float]
) -> CropBox:
    """torchvision's ``RandomResizedCrop.get_params``, with its random numbers given as uniforms.

    1. For each of 10 attempts take an area ``scale`` and a log-uniform aspect ``ratio`` from ``draws``;
       the first crop that fits the image is placed at a uniform top-left corner.
    2. If none fits: the centre crop of the whole image, clamped to the ratio range.

    Args:
        height, width: the image's size.
        draws: at least ``CROP_ATTEMPTS * DRAWS_PER_ATTEMPT`` uniforms in ``[0, 1)``.
        scale, ratio: as in torchvision.

    Example::

        box = random_resized_crop_box(300, 400, np.full(40, 0.5), (0.08, 1.0), (3 / 4, 4 / 3))
    """
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for attempt in range(CROP_ATTEMPTS):
        first = attempt * DRAWS_PER_ATTEMPT
        u_area, u_ratio, u_top, u_left = draws[first : first + DRAWS_PER_ATTEMPT]
        target_area = area * (scale[0] + (scale[1] - scale[0]) * float(u_area))
        aspect = math.exp(log_lo + (log_hi - log_lo) * float(u_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return CropBox(int(u_top * (height - h + 1)), int(u_left * (width - w + 1)), h, w)
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return CropBox((height - h) // 2, (width - w) // 2, h, w)


def resize_shorter_side(height: int, width: int, shorter: int) -> tuple[int, int]:
    """The ``(height, width)`` torchvision's ``Resize(shorter)`` gives (the longer side is truncated).

    Example::

        assert resize_shorter_side(300, 400, 256) == (256, 341)
    """
    if height <= width:
        return shorter, int(shorter * width / height)
    return int(shorter * height / width), shorter


def center_crop_box(height: int, width: int, crop_height: int, crop_width: int) -> CropBox:
    """torchvision's ``CenterCrop`` placement (the image is at least the crop's size).

    Example::

        assert center_crop_box(256, 341, 224, 224) == CropBox(16, 58, 224, 224)
    """
    top = int(round((height - crop_height) / 2.0))
    left = int(round((width - crop_width) / 2.0))
    return CropBox(top, left, crop_height, crop_width)
