"""Generated images shown at a size a person can read (tutorial 05's digits).

The digits pipeline draws 16 × 16 pixel images: in a notebook that is a speck, and even four times
larger (64 pixels) a stroke is a few screen pixels wide. `enlarged` puts the images side by side and
draws every pixel as a scale × scale block (nearest neighbour), by default the smallest whole scale
that makes the picture 256 pixels tall, so the digit is large and still exactly the pixels the pipeline
produced: no interpolation blurs a stroke into the background or invents grey levels the model never drew.

    enlarged(images)              one picture: images left to right, 256 pixels tall (16 × 16 digits: 16 × 16 blocks)
    enlarged(images, scale=4)     each pixel a 4 × 4 block
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

READABLE_HEIGHT = 256  # screen pixels: a digit about as tall as a few lines of the notebook's text


def enlarged(images, scale: int | None = None, *, height: int = READABLE_HEIGHT) -> Image.Image:
    """The images (PIL images or arrays of one height) left to right, each pixel a scale × scale block;
    scale None: the smallest whole scale that makes the picture at least `height` pixels tall."""
    arrays = [np.asarray(image) for image in images]
    if not arrays:
        raise ValueError("no images to show: pass the pipeline's output images (a list)")
    heights = sorted({array.shape[0] for array in arrays})
    if len(heights) > 1:
        raise ValueError(f"images of heights {[a.shape[0] for a in arrays]}: give images of one height")
    if scale is None:
        scale = max(1, math.ceil(height / heights[0]))
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale={scale!r}: give a whole number >= 1 (how many screen pixels per image pixel)")
    row = Image.fromarray(np.concatenate(arrays, axis=1))
    return row.resize((row.width * scale, row.height * scale), Image.NEAREST)
