"""`data.video:` section: frame sampling and the frame-budget resize rule (mindvl_ms/data/video.py).

Defaults are Qwen2.5-VL's (`qwen-vl-utils`): 2 fps, 4..768 frames, 128..768 merge units per frame,
a total budget of 128,000 * 0.9 merge units per video. `fps_range` turns on openPangu-VL's random FPS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from mindvl_ms.config.base import ConfigError, F


@dataclass
class VideoConfig:
    """Video frame sampling and per-frame resolution."""

    fps: float = F(2.0, "frames sampled per second of video (constant FPS)")
    fps_range: List[float] = F([], "[lo, hi]: draw the fps per video uniformly in this range (random FPS); "
                                    "empty: constant `fps`")
    min_frames: int = F(4, "fewest frames sampled from one video (rounded up to the temporal patch size)")
    max_frames: int = F(768, "most frames sampled from one video (rounded down to the temporal patch size)")
    video_min_pixels: int = F(128 * 28 * 28, "smallest area of a sampled frame in pixels")
    video_max_pixels: int = F(768 * 28 * 28, "largest area of a sampled frame in pixels")
    video_total_pixels: int = F(int(128000 * 28 * 28 * 0.9), "pixel budget of all frames of one video: a "
                                "frame gets total / nframes * temporal_patch_size, within the min/max")

    def validate(self) -> None:
        if self.fps <= 0:
            raise ConfigError(f"video.fps {self.fps} must be > 0")
        if self.fps_range and (len(self.fps_range) != 2 or not 0 < self.fps_range[0] <= self.fps_range[1]):
            raise ConfigError(f"video.fps_range {self.fps_range}: expected [lo, hi] with 0 < lo <= hi")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ConfigError(f"video: need 1 <= min_frames <= max_frames, got {self.min_frames}, {self.max_frames}")
        if not 0 < self.video_min_pixels <= self.video_max_pixels <= self.video_total_pixels:
            raise ConfigError("video: need 0 < video_min_pixels <= video_max_pixels <= video_total_pixels, got "
                              f"{self.video_min_pixels}, {self.video_max_pixels}, {self.video_total_pixels}")
