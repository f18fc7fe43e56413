"""Video input: metadata, frame sampling, the frame-budget resize rule, PyAV decoding and patches.

Design (Qwen2.5-VL's video path, as `qwen-vl-utils` implements it, plus openPangu-VL's sampling):
- Token counts come from metadata alone (`frames`, `fps`, `width`, `height` in the JSONL's
  `video_meta`), so packing and validation never decode: `video_grid(meta, cfg)` gives the grid.
- Frames: `nframes = total_frames / video_fps * fps`, clamped to [min_frames, max_frames] (rounded
  to the temporal patch size, the "frame factor") and to the video's length, floored to a multiple of
  the frame factor; indices are `round(linspace(0, total - 1, nframes))`. `fps` is constant
  (`video.fps`), or, with `video.fps_range: [lo, hi]`, drawn per sample from a seeded generator
  (openPangu-VL trains non-precise time tasks with random FPS, precise ones at a constant 1 FPS). The
  `VideoConfig` passed in is the one of the sample's data source (`data.sources[].video` over
  `data.video`, `DataConfig.video_for`), so one mix can hold both kinds of source.
- Frame budget (openPangu-VL section 2.4, Qwen2.5-VL's rule): each frame's pixel budget is
  inversely proportional to the number of frames,
  `max_pixels = max(min(video_max_pixels, video_total_pixels / nframes * frame_factor), 1.05 * video_min_pixels)`,
  then `smart_resize` to multiples of patch*merge inside [video_min_pixels, max_pixels].
- Patches: frames are resized (PIL bicubic, as the image path), normalised, grouped into temporal
  patches of `temporal_patch_size` frames and cut exactly as `Qwen2VLImageProcessor` cuts a frame list
  (data/image.py's `cut_patches`, shared with still images):
  [grid_t * grid_h * grid_w, C*T*P*P] in 2x2 merge-unit order.
- Time: `second_per_grid = temporal_patch_size / sample_fps` (seconds spanned by one temporal
  patch), which the M-RoPE index multiplies by `vision.tokens_per_second` (Qwen2.5-VL's absolute
  time positions).

Usage:
    meta = probe_video("clip.mp4")                  # VideoMeta(frames, fps, width, height)
    clip = load_video("clip.mp4", cfg.image, cfg.video, rng)   # VideoClip(pixel_values, grid_thw, ...)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import av
import numpy as np
from PIL import Image

from mindvl_ms.config.data import ImageConfig
from mindvl_ms.config.video import VideoConfig
from mindvl_ms.data.image import cut_patches, normalise_frames, smart_resize


@dataclass(frozen=True)
class VideoMeta:
    """What packing needs to count a video's tokens without decoding it."""

    frames: int
    fps: float
    width: int
    height: int

    def check(self, where: str = "video_meta") -> None:
        if self.frames < 1 or self.fps <= 0 or self.width < 1 or self.height < 1:
            raise ValueError(f"{where}: need frames >= 1, fps > 0, width and height >= 1 "
                             f"(got frames={self.frames}, fps={self.fps}, width={self.width}, height={self.height})")


@dataclass
class VideoClip:
    """A decoded, sampled and patchified video."""

    pixel_values: np.ndarray      # float32 [grid_t * grid_h * grid_w, C*T*P*P]
    grid_thw: np.ndarray          # int64 [3]
    second_per_grid: float        # seconds spanned by one temporal patch
    frame_indices: np.ndarray     # int64 [nframes] indices into the source video
    sample_fps: float


def _round(n: float, f: int) -> int:
    return round(n / f) * f


def _ceil(n: float, f: int) -> int:
    return math.ceil(n / f) * f


def _floor(n: float, f: int) -> int:
    return math.floor(n / f) * f


def sample_fps(cfg: VideoConfig, rng: Optional[np.random.Generator] = None) -> float:
    """The sampling rate for one video: constant `cfg.fps`, or uniform in `cfg.fps_range` (seeded)."""
    if cfg.fps_range:
        if rng is None:
            raise ValueError("video.fps_range is set: sampling needs a seeded numpy Generator")
        lo, hi = cfg.fps_range
        return float(rng.uniform(lo, hi))
    return float(cfg.fps)


def num_frames(total_frames: int, video_fps: float, fps: float, cfg: VideoConfig, factor: int) -> int:
    """How many frames to sample (a multiple of `factor` = temporal_patch_size)."""
    min_frames = _ceil(cfg.min_frames, factor)
    max_frames = _floor(min(cfg.max_frames, total_frames), factor)
    n = total_frames / video_fps * fps
    n = min(min(max(n, min_frames), max_frames), total_frames)
    n = _floor(n, factor)
    if not factor <= n <= total_frames:
        raise ValueError(f"a video of {total_frames} frames cannot give {factor} <= nframes <= {total_frames} "
                         f"(min_frames {cfg.min_frames}, max_frames {cfg.max_frames}, temporal patch {factor})")
    return int(n)


def frame_indices(total_frames: int, nframes: int) -> np.ndarray:
    """int64[nframes]: evenly spaced, rounded half to even like torch.linspace(...).round()."""
    return np.round(np.linspace(0, total_frames - 1, nframes)).astype(np.int64)


def frame_size(width: int, height: int, nframes: int, image: ImageConfig, cfg: VideoConfig) -> Tuple[int, int]:
    """(resized_height, resized_width) of every frame under the frame budget."""
    factor = image.patch_size * image.merge_size
    max_pixels = max(min(cfg.video_max_pixels, cfg.video_total_pixels / nframes * image.temporal_patch_size),
                     int(cfg.video_min_pixels * 1.05))
    return smart_resize(height, width, factor, cfg.video_min_pixels, max_pixels)


def plan_video(meta: VideoMeta, image: ImageConfig, cfg: VideoConfig,
               rng: Optional[np.random.Generator] = None) -> Tuple[np.ndarray, Tuple[int, int], float]:
    """(frame indices, (height, width), sample_fps) from metadata alone."""
    meta.check()
    fps = sample_fps(cfg, rng)
    n = num_frames(meta.frames, meta.fps, fps, cfg, image.temporal_patch_size)
    idx = frame_indices(meta.frames, n)
    return idx, frame_size(meta.width, meta.height, n, image, cfg), n / max(meta.frames, 1e-6) * meta.fps


def video_grid(meta: VideoMeta, image: ImageConfig, cfg: VideoConfig,
               rng: Optional[np.random.Generator] = None) -> Tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) of a video from metadata alone. With `fps_range` the caller passes the
    sample's own generator (`video_rng`), so packing and loading draw the same fps."""
    idx, (h, w), _ = plan_video(meta, image, cfg, rng)
    return idx.size // image.temporal_patch_size, h // image.patch_size, w // image.patch_size


def video_tokens(meta: VideoMeta, image: ImageConfig, cfg: VideoConfig,
                 rng: Optional[np.random.Generator] = None) -> int:
    t, h, w = video_grid(meta, image, cfg, rng)
    return t * h * w // image.merge_size ** 2


def video_rng(seed: int, line: int, index: int) -> np.random.Generator:
    """The generator of one video of one sample: the same draw in the packer and the loader."""
    return np.random.default_rng([int(seed), int(line), int(index)])


def probe_video(path: str) -> VideoMeta:
    """Metadata from the container (PyAV); errors name the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"video not found: {path}")
    try:
        with av.open(path) as c:
            s = c.streams.video[0]
            frames = s.frames
            fps = float(s.average_rate or s.guessed_rate or 0)
            if not frames:  # containers without a frame count: count by demuxing (no decoding)
                frames = sum(1 for p in c.demux(s) if p.size)
            return VideoMeta(frames=int(frames), fps=fps, width=s.codec_context.width,
                             height=s.codec_context.height)
    except (av.error.FFmpegError, IndexError) as e:
        raise ValueError(f"{path}: unreadable video ({e})") from None


def decode_frames(path: str, indices: Sequence[int]) -> list:
    """PIL RGB frames at the given indices (decoded in one pass; errors name the file)."""
    want = sorted(set(int(i) for i in indices))
    got = {}
    try:
        with av.open(path) as c:
            for i, frame in enumerate(c.decode(video=0)):
                if i in want:
                    got[i] = frame.to_image().convert("RGB")
                if i >= want[-1]:
                    break
    except av.error.FFmpegError as e:
        raise ValueError(f"{path}: unreadable video ({e})") from None
    missing = [i for i in want if i not in got]
    if missing:
        raise ValueError(f"{path}: video ends before frame {missing[0]} (metadata says more frames)")
    return [got[int(i)] for i in indices]


def patchify_frames(frames: Sequence[Image.Image], size: Tuple[int, int], image: ImageConfig) -> Tuple[np.ndarray, np.ndarray]:
    """Frames -> (float32[grid_t*grid_h*grid_w, C*T*P*P], grid_thw int64[3]); len(frames) % T == 0."""
    h, w = size
    arr = np.stack([normalise_frames(f.resize((w, h), resample=Image.BICUBIC), image) for f in frames])  # [F, C, h, w]
    return cut_patches(arr, image)


def load_video(path: str, image: ImageConfig, cfg: VideoConfig, rng: Optional[np.random.Generator] = None,
               meta: Optional[VideoMeta] = None) -> VideoClip:
    """Probe (unless `meta` is given), sample, decode and patchify one video."""
    meta = meta or probe_video(path)
    idx, size, fps = plan_video(meta, image, cfg, rng)
    pixel_values, grid = patchify_frames(decode_frames(path, idx), size, image)
    return VideoClip(pixel_values, grid, image.temporal_patch_size / fps, idx, fps)
