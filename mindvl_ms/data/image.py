"""The image path shared by still images and video frames: smart_resize, normalisation and patch cutting.

Identical to transformers 4.57.1 `Qwen2VLImageProcessor` (slow path, checked in tests/data/test_processor.py):
RGB -> `smart_resize` (sides multiples of patch*merge=28, area in [min_pixels, max_pixels], aspect ratio
<= 200) -> PIL bicubic resize -> x*(1/255) in float64 then float32 -> (x - mean) / std with the OpenAI
CLIP statistics -> frames grouped into temporal patches of `temporal_patch_size` (a still image is
repeated to that many frames) -> patches [grid_t*grid_h*grid_w, C*T*P*P] ordered by 2x2 merge unit, so
each run of 4 consecutive patches is one LLM token. Tokens per image = grid_t*grid_h*grid_w / 4.

Quality filters vs hard limits: `data.image.min_side` (default 28, one merge unit) and
`max_aspect_ratio` (default 50) are rule-based filters (the openPangu-VL report's data cleaning):
`quality_errors` names what an image breaks, and the callers (validate, the packers,
`MindVLProcessor.process_sample`) skip its line with file:line. smart_resize's own limits (ratio 200,
empty images) stay hard errors for direct calls.
"""
from __future__ import annotations

import math
import os
import struct
from fractions import Fraction
from typing import List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from mindvl_ms.config.data import ImageConfig

MAX_RATIO = 200


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> Tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with the area inside [min_pixels, max_pixels]."""
    if min(height, width) <= 0:
        raise ValueError(f"image size {width}x{height} is empty")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_RATIO}, "
                         f"got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(width: int, height: int, cfg: ImageConfig) -> Tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) of a still image of the given pixel size, from metadata alone."""
    h, w = smart_resize(height, width, cfg.patch_size * cfg.merge_size, cfg.min_pixels, cfg.max_pixels)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def image_tokens(width: int, height: int, cfg: ImageConfig) -> int:
    """LLM tokens of one still image: grid_t*grid_h*grid_w / merge_size**2."""
    t, h, w = image_grid(width, height, cfg)
    return t * h * w // (cfg.merge_size ** 2)


def quality_errors(width: int, height: int, cfg: ImageConfig, what: str = "") -> List[Tuple[str, str]]:
    """[(reason, detail)] for an image that breaks the data.image quality filters (see module doc)."""
    out = []
    what = f"{what}: " if what else ""
    if min(width, height) < cfg.min_side:
        out.append(("below minimum resolution", f"{what}{width}x{height}, shortest side must be >= "
                                                f"{cfg.min_side} (data.image.min_side)"))
    # exact ratio: the sides may be a line's own numbers (trusted image_sizes), too large for a float
    if Fraction(max(width, height), max(min(width, height), 1)) > cfg.max_aspect_ratio:
        out.append(("extreme aspect ratio", f"{what}{width}x{height}, ratio above {cfg.max_aspect_ratio:g} "
                                            f"(data.image.max_aspect_ratio)"))
    return out


# what PIL raises for a file it cannot read: besides OSError (unknown format, truncated data), its decoders
# raise ValueError, SyntaxError, EOFError or struct.error on broken streams, and a header declaring more than
# twice Image.MAX_IMAGE_PIXELS raises DecompressionBombError before any pixel is read
_PIL_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)


def _unreadable(path: str, e: Exception) -> OSError:
    msg = str(e) if path in str(e) else f"{path}: {e}"
    return OSError(msg if isinstance(e, OSError) else f"{msg} ({type(e).__name__})")


def load_image(path: str) -> Image.Image:
    """Decode an image file fully; any failure is an OSError naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"image not found: {path}")
    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except _PIL_ERRORS as e:
        raise _unreadable(path, e) from None


def image_size(path: str) -> Tuple[int, int]:
    """(width, height) from the file header only (PIL opens lazily; no pixel decoding); any failure is an
    OSError naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"image not found: {path}")
    try:
        with Image.open(path) as im:
            return im.size
    except _PIL_ERRORS as e:
        raise _unreadable(path, e) from None


def normalise_frames(image: Image.Image, cfg: ImageConfig) -> np.ndarray:
    """A resized RGB image -> float32[C, h, w]: x*(1/255) in float64, then (x - mean) / std in float32."""
    arr = np.array(image.convert("RGB") if image.mode != "RGB" else image)  # uint8 [h, w, 3]
    arr = (arr.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.array(cfg.image_mean, dtype=np.float32)
    std = np.array(cfg.image_std, dtype=np.float32)
    return ((arr - mean) / std).transpose(2, 0, 1)


def cut_patches(frames: np.ndarray, cfg: ImageConfig) -> Tuple[np.ndarray, np.ndarray]:
    """Normalised frames float32[F, C, h, w] (F a multiple of temporal_patch_size, h and w of patch*merge)
    -> (patches float32[grid_t*grid_h*grid_w, C*T*P*P] in merge-unit order, grid_thw int64[3])."""
    P, T, M = cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size
    if len(frames) % T:
        raise ValueError(f"{len(frames)} frames is not a multiple of temporal_patch_size {T}")
    C, gt, gh, gw = frames.shape[1], len(frames) // T, frames.shape[2] // P, frames.shape[3] // P
    x = frames.reshape(gt, T, C, gh // M, M, P, gw // M, M, P)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [t, gh/M, gw/M, M, M, C, T, P, P]
    return np.ascontiguousarray(x.reshape(gt * gh * gw, C * T * P * P)), np.array([gt, gh, gw], dtype=np.int64)


def patchify(image: Image.Image, cfg: ImageConfig) -> Tuple[np.ndarray, np.ndarray]:
    """One image -> (pixel patches float32[grid_t*grid_h*grid_w, C*T*P*P], grid_thw int64[3])."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    h, w = smart_resize(image.height, image.width, cfg.patch_size * cfg.merge_size, cfg.min_pixels, cfg.max_pixels)
    arr = normalise_frames(image.resize((w, h), resample=Image.BICUBIC), cfg)  # [C, h, w]
    return cut_patches(np.repeat(arr[None], cfg.temporal_patch_size, axis=0), cfg)  # the still image as T frames


def process_images(images: Sequence[Image.Image], cfg: ImageConfig) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """Images -> (pixel_values float32[sum N_i, 1176], image_grid_thw int64[k, 3]), or (None, None)."""
    if not images:
        return None, None
    out = [patchify(im, cfg) for im in images]
    return np.concatenate([p for p, _ in out]), np.stack([g for _, g in out])
