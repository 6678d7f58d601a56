"""The image processor (jdeep.vision.processor) against DeepSeek-V4.1's rules written out independently: grid
planning and span length for several sizes and aspect ratios, the pixel normalisation and patch order against a
float64 loop, the gray letterbox, and clear errors for bad images."""

from __future__ import annotations

import base64
import io
import math

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from jdeep.config import ModelConfig, VisionConfig
from jdeep.config.small_models import tiny_v41_config
from jdeep.vision import processor
from jdeep.vision.processor import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, ImageError, num_image_tokens,
                                    plan_image_grid, process_image, span_types)

TINY = ModelConfig.from_dict(tiny_v41_config(vision=True)).vision
RELEASED = VisionConfig()          # DeepSeek-V4.1-Flash: patch 14, ratio 3, 1024 tokens, 544² min pixels


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("size", [(544, 544), (100, 100), (640, 480), (480, 640), (1024, 1024), (1920, 1080),
                                  (4000, 3000), (20000, 50), (50, 20000), (1, 1), (3000, 40)])
def test_grid_and_span_length(size):
    W, H = size
    vc = RELEASED
    n_h, n_w, ph, pw = plan_image_grid(W, H, vc)
    p, r = vc.patch_size, vc.downsample_ratio
    assert ph % p == 0 and pw % p == 0 and ph >= p and pw >= p
    assert (n_h, n_w) == (math.ceil(ph // p / r), math.ceil(pw // p / r))
    n = n_h * (n_w + 1) + 2
    assert num_image_tokens(n_h, n_w) == n == len(span_types(n_h, n_w)) <= vc.max_tokens
    # no shrink needed: the size is the (scaled-up) image rounded up to whole patches
    w, h = W, H
    if w * h < vc.min_pixels:
        s = math.sqrt(vc.min_pixels / (w * h))
        w, h = int(w * s), int(h * s)
    n_up = math.ceil(math.ceil(h / p) / r) * (math.ceil(math.ceil(w / p) / r) + 1) + 2
    if n_up <= vc.max_tokens:
        assert (ph, pw) == (math.ceil(h / p) * p, math.ceil(w / p) * p)
    else:   # shrunk, aspect kept to within a cell of the grid
        assert (ph, pw) != (math.ceil(h / p) * p, math.ceil(w / p) * p)
        assert abs(pw / ph - w / h) / (w / h) < 0.5 or min(n_h, n_w) == 1


def test_span_layout():
    t = span_types(2, 3)
    want = [IMAGE_START] + [IMAGE] * 3 + [IMAGE_NEW_LINE] + [IMAGE] * 3 + [IMAGE_NEW_LINE] + [IMAGE_END]
    assert t.tolist() == want


def test_pixels_and_patch_order_match_float64_loop():
    """An image already at a whole-patch size above min_pixels is not resized: every patch value is
    bf16((x/255 - 0.5)/0.5) at index c·p² + py·p + px, patches in row-major order."""
    rng = np.random.default_rng(0)
    H, W = 24, 36
    arr = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    got = process_image(Image.fromarray(arr), TINY)
    p = TINY.patch_size
    assert (got.n_vit_h, got.n_vit_w, got.n_llm_h, got.n_llm_w) == (H // p, W // p, 2, 3)
    want = np.zeros((H // p * (W // p), 3 * p * p))
    for i in range(H // p):
        for j in range(W // p):
            for c in range(3):
                for py in range(p):
                    for px in range(p):
                        v = (float(arr[i * p + py, j * p + px, c]) / 255.0 - 0.5) / 0.5
                        want[i * (W // p) + j, c * p * p + py * p + px] = float(ml_dtypes.bfloat16(v))
    np.testing.assert_allclose(got.patches, want, rtol=0, atol=1e-7)


def test_letterbox_is_gray_127():
    """30 px wide onto 32: ImageOps.pad centres it, the outer columns are gray 127 after normalisation."""
    arr = np.zeros((24, 30, 3), np.uint8)
    got = process_image(Image.fromarray(arr), TINY)
    assert (got.n_vit_h, got.n_vit_w) == (6, 8)
    p = TINY.patch_size
    img = got.patches.reshape(6, 8, 3, p, p).transpose(2, 0, 3, 1, 4).reshape(3, 24, 32)
    gray = float(ml_dtypes.bfloat16((127 / 255 - 0.5) / 0.5))
    assert np.all(img[:, :, 0] == gray) and np.all(img[:, :, 31] == gray)
    assert np.all(img[:, :, 2:30] == -1.0)


def test_small_image_scaled_up_to_min_pixels():
    got = process_image(Image.fromarray(np.full((5, 5, 3), 200, np.uint8)), TINY)
    assert got.n_vit_h * TINY.patch_size * got.n_vit_w * TINY.patch_size >= TINY.min_pixels


def test_sources_give_the_same_patches(tmp_path):
    arr = np.random.default_rng(1).integers(0, 256, (20, 28, 3), dtype=np.uint8)
    data = _png(arr)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    ref = process_image(Image.fromarray(arr), TINY).patches
    for source in (data, str(path), path, url):
        np.testing.assert_array_equal(process_image(source, TINY).patches, ref)


@pytest.mark.parametrize("source, message", [
    (b"not an image", "cannot decode image"),
    ("https://example.com/cat.png", "not fetched"),
    ("data:image/png,rawbytes", "not base64"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("/nonexistent/cat.png", "cannot read image"),
    (12345, "unsupported image source"),
])
def test_bad_images_are_named(source, message):
    with pytest.raises(ImageError, match=message):
        process_image(source, TINY)


def test_too_many_pixels(monkeypatch):
    monkeypatch.setattr(processor, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageError, match="megapixels"):
        process_image(_png(np.zeros((20, 20, 3), np.uint8)), TINY)
