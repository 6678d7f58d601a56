"""Images to ViT patches and image-span layouts, as DeepSeek-V4.1's `inference/image_processor.py` defines them.

An image of W x H pixels is scaled up to at least `min_pixels`, rounded up to whole patches and, if its span would
exceed `max_tokens` positions, shrunk (aspect kept) until it fits; it is then letterboxed onto that size with gray
127 (`PIL.ImageOps.pad`, bicubic) or, where `max_wh_ratio` is set and the image is wider than it, stretched. Pixels
become (x/255 - 0.5)/0.5 rounded to bf16, cut into row-major patches whose 3·p² values are ordered channel, pixel
row, pixel column. The aligner merges downsample_ratio² patches into one text position, so an n_vit_h x n_vit_w
patch grid gives an n_llm_h x n_llm_w token grid, ceil(n_vit / ratio), laid out in the prompt as

    IMAGE_START, (IMAGE x n_llm_w, IMAGE_NEW_LINE) x n_llm_h, IMAGE_END

where every position carries `image_token_id` (the span's types tell them apart).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..config import VisionConfig

__all__ = ["IMAGE_START", "IMAGE", "IMAGE_NEW_LINE", "IMAGE_END", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS",
           "MAX_IMAGES", "ImageError", "ImagePatches", "num_image_tokens", "plan_image_grid", "span_types",
           "open_image", "process_image", "data_url_bytes"]

IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)
MAX_IMAGE_BYTES = 32 << 20          # encoded bytes of one image
MAX_IMAGE_PIXELS = 64 << 20         # decoded pixels of one image (before resizing)
MAX_IMAGES = 16                     # images in one request


class ImageError(ValueError):
    """An image cannot be used: undecodable, too large, too many, or of an unsupported source."""


@dataclass(frozen=True)
class ImagePatches:
    """One processed image: patches float32 [n_vit_h·n_vit_w, 3·p²] (bf16-exact values, row-major patch order),
    its patch grid and the token grid the aligner makes of it."""

    patches: np.ndarray
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def n_tokens(self) -> int:
        """Positions of its span in the prompt."""
        return num_image_tokens(self.n_llm_h, self.n_llm_w)


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """Span length of an n_llm_h x n_llm_w token grid: a newline per row plus the start and end delimiters."""
    return n_llm_h * (n_llm_w + 1) + 2


def _llm_grid(height: int, width: int, p: int, r: int) -> tuple[int, int]:
    return math.ceil((height // p) / r), math.ceil((width // p) / r)


def _fit(height: float, width: float, p: int, r: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-preserving pixel size whose token grid fits max_tokens (DeepSeek's solve_resize_ratio):
    the grid width w solves h·(w + 1) + 2 = max_tokens with h = w·height/width."""
    aspect = height / width
    max_w = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    max_h = max_w * aspect
    cell = p * r
    if max_w < 1.0:                        # very tall: one column
        return (max_tokens - 2) // 2 * cell, cell
    if max_h < 1.0:                        # very wide: one row
        return cell, (max_tokens - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def plan_image_grid(width: int, height: int, vc: VisionConfig) -> tuple[int, int, int, int]:
    """(n_llm_h, n_llm_w, pixel height, pixel width) an image of width x height pixels is processed at."""
    if width <= 0 or height <= 0:
        raise ImageError(f"image has no pixels ({width}x{height})")
    p, r = vc.patch_size, vc.downsample_ratio
    if vc.max_wh_ratio is not None and width > height * vc.max_wh_ratio:
        width = height * vc.max_wh_ratio
    if width * height < vc.min_pixels:
        scale = (vc.min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    best_h, best_w = math.ceil(height / p) * p, math.ceil(width / p) * p
    n_h, n_w = _llm_grid(best_h, best_w, p, r)
    if num_image_tokens(n_h, n_w) > vc.max_tokens:
        best_h, best_w = _fit(height, width, p, r, vc.max_tokens)
        n_h, n_w = _llm_grid(best_h, best_w, p, r)
    if num_image_tokens(n_h, n_w) > vc.max_tokens or best_h < p or best_w < p:
        raise ImageError(f"image of {width}x{height} pixels cannot be fitted into {vc.max_tokens} image tokens")
    return n_h, n_w, best_h, best_w


def span_types(n_llm_h: int, n_llm_w: int) -> np.ndarray:
    """The position types of an image span, int8 [num_image_tokens]: start, rows of IMAGE each ending in a
    newline, end."""
    row = [IMAGE] * n_llm_w + [IMAGE_NEW_LINE]
    return np.asarray([IMAGE_START] + row * n_llm_h + [IMAGE_END], np.int8)


def data_url_bytes(url: str) -> bytes:
    """The encoded image a base64 `data:` URL carries; ImageError for anything else (no path, no network: what a
    server hands the tower from a client, so nothing a client sends can name a local file)."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ImageError("an image from a client must be a base64 data: URL")
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise ImageError(f"data URL {header[:40]!r} is not base64-encoded")
    if len(payload) > (MAX_IMAGE_BYTES + 2) // 3 * 4:
        raise ImageError(f"image exceeds {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data URL is not valid base64: {e}") from None


def open_image(source: Any) -> Image.Image:
    """An RGB PIL image from a PIL image, a file path, encoded bytes or a `data:` URL (base64). Remote URLs are
    refused: jdeep never fetches from the network."""
    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, str) and source.startswith("data:"):
            data = data_url_bytes(source)
        elif isinstance(source, str) and source.split(":", 1)[0].lower() in ("http", "https", "ftp", "file"):
            raise ImageError("image URLs are not fetched; pass a data: URL, a file path or the image itself")
        elif isinstance(source, (str, os.PathLike)):
            try:
                size = os.path.getsize(source)
            except OSError as e:
                raise ImageError(f"cannot read image {os.fspath(source)!r}: {e.strerror}") from None
            if size > MAX_IMAGE_BYTES:
                raise ImageError(f"image {os.fspath(source)!r} exceeds {MAX_IMAGE_BYTES >> 20} MiB")
            with open(source, "rb") as f:
                data = f.read()
        elif isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
        else:
            raise ImageError(f"unsupported image source of type {type(source).__name__}")
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageError(f"image exceeds {MAX_IMAGE_BYTES >> 20} MiB")
        try:
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ImageError(f"image of {image.width}x{image.height} pixels exceeds {MAX_IMAGE_PIXELS >> 20} "
                                 "megapixels")
            image.load()
        except ImageError:
            raise
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise ImageError(f"cannot decode image: {e}") from None
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ImageError(f"image of {image.width}x{image.height} pixels exceeds {MAX_IMAGE_PIXELS >> 20} megapixels")
    return image.convert("RGB")


def process_image(source: Any, vc: VisionConfig) -> ImagePatches:
    """One image (any `open_image` source) as the ViT's patches and its grids."""
    image = open_image(source)
    p = vc.patch_size
    n_llm_h, n_llm_w, height, width = plan_image_grid(image.width, image.height, vc)
    if vc.max_wh_ratio is not None and image.width >= vc.max_wh_ratio * image.height:
        image = image.resize((width, height))
    else:
        image = ImageOps.pad(image, (width, height), color=(127, 127, 127))
    x = np.asarray(image, np.float32).transpose(2, 0, 1) / 255.0                    # [3, H, W]
    x = ((x - 0.5) / 0.5).astype(ml_dtypes.bfloat16).astype(np.float32)
    n_h, n_w = height // p, width // p
    patches = x.reshape(3, n_h, p, n_w, p).transpose(1, 3, 0, 2, 4).reshape(n_h * n_w, 3 * p * p)
    return ImagePatches(np.ascontiguousarray(patches), n_h, n_w, n_llm_h, n_llm_w)
