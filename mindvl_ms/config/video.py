"""`data.video:` section: frame sampling and the frame-budget resize rule (mindvl_ms/data/video.py).

Defaults are Qwen2.5-VL's (`qwen-vl-utils`): 2 fps, 4..768 frames, 128..768 merge units per frame,
a total budget of 128,000 * 0.9 merge units per video. `fps_range` turns on openPangu-VL's random FPS.

`data.sources[].video:` (`SourceVideoConfig`) gives one data source its own settings over the stage's:
openPangu-VL (report section 2.4) samples "non-precise time-aware tasks such as video summarization" at a
random FPS and "precise time-aware tasks like temporal localization" at a constant 1 FPS, two kinds of
source in one mix. A field the source leaves unset (null) follows `data.video`; a source that sets `fps`
without `fps_range` samples at that constant rate even when the stage draws a random one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

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


@dataclass
class SourceVideoConfig:
    """One data source's video settings; every field left null follows the stage's `data.video`."""

    fps: Optional[float] = F(None, "constant frames per second for this source's videos (the stage's fps_range "
                                   "does not apply then); null: the stage's")
    fps_range: Optional[List[float]] = F(None, "[lo, hi]: random FPS for this source's videos; []: constant fps; "
                                                "null: the stage's")
    min_frames: Optional[int] = F(None, "fewest frames sampled from one video of this source; null: the stage's")
    max_frames: Optional[int] = F(None, "most frames sampled from one video of this source; null: the stage's")
    video_min_pixels: Optional[int] = F(None, "smallest frame area in pixels; null: the stage's")
    video_max_pixels: Optional[int] = F(None, "largest frame area in pixels; null: the stage's")
    video_total_pixels: Optional[int] = F(None, "frame budget: pixels of all frames of one video (a frame gets "
                                                "total / nframes * temporal_patch_size); null: the stage's")

    def overrides(self) -> Dict[str, Any]:
        """The fields this source sets ({} when it follows the stage in everything)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def over(self, stage: VideoConfig) -> VideoConfig:
        """The VideoConfig this source's samples use: the stage's with this source's fields in place. Setting
        `fps` alone means a constant rate, so the stage's `fps_range` is dropped with it."""
        values = self.overrides()
        if "fps" in values and "fps_range" not in values:
            values["fps_range"] = []
        out = dataclasses.replace(stage, **values)
        out.validate()
        return out
