"""Tutorial 05's digits at a readable size: lessons.pictures.enlarged, nearest neighbour."""

import numpy as np
import pytest
from PIL import Image

from xdit_lab.lessons.pictures import enlarged


def test_enlarged_draws_every_pixel_as_a_block_of_the_same_value():
    """Three 64 × 64 RGB images become one 768 × 256 picture equal to numpy's own block repeat of them side
    by side (np.repeat on both axes): nearest neighbour, no new values. Control: PIL's default (bicubic)
    resize to the same size is run and differs from the blocks (it invents grey levels between strokes)."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)) for _ in range(3)]
    picture = enlarged(images, scale=4)
    assert picture.size == (3 * 64 * 4, 64 * 4)
    row = np.concatenate([np.asarray(image) for image in images], axis=1)
    blocks = np.repeat(np.repeat(row, 4, axis=0), 4, axis=1)
    assert np.array_equal(np.asarray(picture), blocks)
    smooth = Image.fromarray(row).resize(picture.size)  # the wrong variant: interpolated
    assert not np.array_equal(np.asarray(smooth), blocks)
    assert len(np.unique(np.asarray(picture))) == len(np.unique(row))  # no value the images do not have


def test_enlarged_digits_are_256_pixels_tall_by_default():
    """Tutorial 05's digits are 16 × 16: by default each pixel becomes a 16 × 16 block (256 pixels tall,
    not the 64 a scale of 4 gave); a 20-pixel image gets the smallest whole scale reaching 256 (13: 260)."""
    digits = [np.full((16, 16, 3), value, np.uint8) for value in (0, 128, 255)]
    assert enlarged(digits).size == (3 * 256, 256)
    assert np.array_equal(np.asarray(enlarged(digits)), np.asarray(enlarged(digits, scale=16)))
    assert enlarged([np.zeros((20, 10), np.uint8)]).size == (130, 260)


@pytest.mark.parametrize(
    "images, scale, said",
    [
        ([np.zeros((8, 8), np.uint8)], 0, "scale=0: give a whole number >= 1"),
        ([np.zeros((8, 8), np.uint8)], 2.5, "scale=2.5: give a whole number >= 1"),
        ([], 4, "no images to show"),
        ([np.zeros((8, 8), np.uint8), np.zeros((9, 8), np.uint8)], 4, r"heights \[8, 9\]"),
    ],
)
def test_enlarged_refuses_what_it_cannot_draw(images, scale, said):
    with pytest.raises(ValueError, match=said):
        enlarged(images, scale=scale)
