"""Images enter the graph as uint8: rescale, normalise and temporal patching happen inside the model.

openPangu-VL (report section 6.2) moves rescaling/normalisation into the model's forward pass (uint8 instead
of float32: 4x less data to move) and the ViT's temporal patching as well (a still image is one frame, not
`temporal_patch_size` copies: 2x less). Here the host only resizes (smart_resize + PIL bicubic, exactly as
`mindvl_ms.data.processor.patchify`) and reorders pixels into patches:

    frames, grid = uint8_patches(image, image_config)      # uint8 [N, C*P*P], int64 [3]

and `UInt8Normalize` (a Cell, part of the exported vision graph) turns them into the float32 patches
[N, C*T*P*P] the vision tower takes. Normalisation is a 256-entry lookup table per channel whose entries
are computed with the float pipeline's own arithmetic (x * (1/255) in float64 -> float32, then
(x - mean) / std in float32), so the in-graph result is bit-identical to the float path, not just close.
Test: pytest tests/infer/test_preprocess.py
"""
from typing import Optional, Sequence, Tuple

import numpy as np
from PIL import Image

import mindspore as ms
from mindspore import Tensor, nn, ops

from mindvl_ms.data.image import smart_resize

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def normalize_table(image_mean: Sequence[float], image_std: Sequence[float]) -> np.ndarray:
    """float32[C, 256]: the normalised value of every uint8 level per channel (float-path arithmetic)."""
    levels = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)  # [256]
    mean = np.asarray(image_mean, np.float32)[:, None]
    std = np.asarray(image_std, np.float32)[:, None]
    return ((levels[None, :] - mean) / std).astype(np.float32)


class UInt8Normalize(nn.Cell):
    """uint8 [N, C*P*P] single-frame patches -> float32 [N, C*T*P*P] normalised, frame repeated T times."""

    def __init__(self, vision_config, image_mean=None, image_std=None):
        super().__init__()
        v = vision_config
        self.c, self.t, self.pp = v.in_channels, v.temporal_patch_size, v.patch_size ** 2
        self.frame_dim = self.c * self.pp
        table = normalize_table(image_mean or CLIP_MEAN, image_std or CLIP_STD)  # [C, 256]
        self.table = Tensor(table.reshape(-1))  # [C*256]
        self.offset = Tensor((np.arange(self.c, dtype=np.int32) * 256).repeat(self.pp))  # [C*P*P]

    def construct(self, frames):  # uint8 [N, C*P*P]
        idx = frames.astype(ms.int32) + self.offset[None, :]  # [N, C*P*P]
        x = ops.gather(self.table, idx, 0)  # float32 [N, C*P*P]
        x = x.reshape(-1, self.c, 1, self.pp)  # [N, C, 1, P*P]
        x = ops.tile(x, (1, 1, self.t, 1))  # [N, C, T, P*P]
        return x.reshape(-1, self.c * self.t * self.pp)  # [N, C*T*P*P]


def resize_image(image: Image.Image, image_config, size: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """RGB uint8 [h, w, 3] resized by smart_resize (or to `size` = (h, w), multiples of patch*merge)."""
    cfg = image_config
    if image.mode != "RGB":
        image = image.convert("RGB")
    factor = cfg.patch_size * cfg.merge_size
    if size is None:
        h, w = smart_resize(image.height, image.width, factor, cfg.min_pixels, cfg.max_pixels)
    else:
        h, w = int(size[0]), int(size[1])
        if h % factor or w % factor or h <= 0 or w <= 0:
            raise ValueError(f"resize target {h}x{w} must be positive multiples of {factor}")
    return np.array(image.resize((w, h), resample=Image.BICUBIC))


def patchify_uint8(arr: np.ndarray, patch_size: int = 14, merge_size: int = 2) -> Tuple[np.ndarray, np.ndarray]:
    """uint8 [h, w, C] -> (uint8 [gh*gw, C*P*P] in merge-unit order, grid_thw int64[3] = (1, gh, gw))."""
    P, M = patch_size, merge_size
    h, w, c = arr.shape
    gh, gw = h // P, w // P
    if gh * P != h or gw * P != w or gh % M or gw % M:
        raise ValueError(f"image {w}x{h} is not a multiple of patch*merge = {P * M}")
    x = arr.transpose(2, 0, 1).reshape(c, gh // M, M, P, gw // M, M, P)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/M, gw/M, M, M, C, P, P]
    return np.ascontiguousarray(x.reshape(gh * gw, c * P * P)), np.array([1, gh, gw], np.int64)


def uint8_patches(image: Image.Image, image_config, size: Optional[Tuple[int, int]] = None):
    """One image -> (uint8 frames [N, C*P*P], grid_thw int64[3]); see the module docstring."""
    return patchify_uint8(resize_image(image, image_config, size), image_config.patch_size, image_config.merge_size)


def normalize_uint8_numpy(frames: np.ndarray, image_config) -> np.ndarray:
    """Host-side equivalent of UInt8Normalize (for runners that feed float patches)."""
    cfg = image_config
    table = normalize_table(cfg.image_mean, cfg.image_std)  # [C, 256]
    n = frames.shape[0]
    c = table.shape[0]
    x = frames.reshape(n, c, 1, -1)
    out = table[np.arange(c)[None, :, None, None], x.astype(np.int64)]  # [N, C, 1, P*P]
    return np.repeat(out, cfg.temporal_patch_size, axis=2).reshape(n, -1).astype(np.float32)
