"""Sample processing: the Qwen chat template, assistant-only labels and `MindVLProcessor`.

Images and video frames go through data/image.py (smart_resize, normalisation, patches; identical to
transformers' `Qwen2VLImageProcessor`) and data/video.py (frame sampling and the frame budget, with the video
settings of the sample's data source: `DataConfig.video_for(sample.source)`, the same in packer and loader).

Text path: grounding labels written in `data.grounding.coord_format` (data/grounding.py
`reformat_messages`), then the Qwen2.5-VL chat template (`<|im_start|>role\\n...<|im_end|>\\n`, a default system
turn when the sample has none); every `<image>` becomes `<|vision_start|><|image_pad|>*N<|vision_end|>`
(data/tokens.py). The template is rendered with ONE `<|image_pad|>` per image, tokenised once with
character offsets, and each pad is then expanded to N ids; labels are the ids of tokens that start inside
an assistant turn's content or its closing `<|im_end|>` (HF convention: aligned with input_ids, -100
elsewhere; the model shifts). The same rendering gives the metadata-only token count used by the offline
packer (`count_tokens`), so packer and loader always agree on lengths.

A training sample whose image breaks the `data.image` quality filters (data/image.py) is skipped with a
SampleError naming file:line; `process_sample` also checks each decoded image against the line's
`image_sizes` (the packer counted tokens from them), so a wrong size costs that line, named by file:line
and field, instead of the run. So does an image that cannot be decoded (`load_images`: field and file
named) and text that already holds a vision token (`check_text`, which the offline packer's metadata
pass runs too, so packer and loader reject the same lines).

A checkpoint carries its processor as files (data/processor_files.py): `MindVLProcessor.from_pretrained`
reads them, `save_processor`, `carry_processor` and `ProcessorWriter` write them, `processor_of` builds
the processor a checkpoint records even without a tokenizer of its own.

Usage:
    proc = MindVLProcessor.from_pretrained(dir_or_None)
    batch = proc(messages=[...], images=[PIL.Image...])           # HF-style numpy batch of one
    out = model(**batch)                                           # .logits, .loss (infer/hf_api.py)
    sample = proc.process_sample(parse_sample(obj, "file.jsonl", 1))   # per-sample dict for packing
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from mindspore import Tensor
from PIL import Image

from mindvl_ms.config.data import DataConfig, ImageConfig
from mindvl_ms.data.grounding import reformat_messages
from mindvl_ms.data.image import load_image, process_images, quality_errors
from mindvl_ms.data.processor_files import (copy_processor_files, has_tokenizer, processor_source, read_grounding_config,
                                            read_image_config, read_system_prompt, read_video_config,
                                            write_processor_files)
from mindvl_ms.data.schema import (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Sample, SampleError, count_placeholders,
                                   normalise_messages)
from mindvl_ms.data.tokenizer import TextTokenizer, load_tokenizer
from mindvl_ms.data.tokens import (CHAT_TOKENS, IGNORE_INDEX, IM_END, IM_START, IMAGE_PAD, IMAGE_TAG, VIDEO_PAD,
                                   VIDEO_TAG, VISION_TOKENS)
from mindvl_ms.data.video import VideoMeta, load_video, probe_video, video_rng, video_tokens


# ----------------------------------------------------------------------------------------------
# chat template and labels

def render(messages: List[Dict[str, str]], system_prompt: str = "You are a helpful assistant.",
           add_generation_prompt: bool = False) -> Tuple[str, List[Tuple[int, int]]]:
    """Template text with one <|image_pad|> per image and one <|video_pad|> per video, and the supervised
    character spans."""
    parts: List[str] = []
    spans: List[Tuple[int, int]] = []
    pos = 0

    def put(s: str, supervised: bool = False) -> None:
        nonlocal pos
        parts.append(s)
        if supervised and s:
            spans.append((pos, pos + len(s)))
        pos += len(s)

    if messages[0]["role"] != "system" and system_prompt:
        put(f"{IM_START}system\n{system_prompt}{IM_END}\n")
    for m in messages:
        content = m["content"].replace(IMAGE_PLACEHOLDER, IMAGE_TAG).replace(VIDEO_PLACEHOLDER, VIDEO_TAG)
        put(f"{IM_START}{m['role']}\n")
        if m["role"] == "assistant":
            put(content + IM_END, supervised=True)
            put("\n")
        else:
            put(content + IM_END + "\n")
    if add_generation_prompt:
        put(f"{IM_START}assistant\n")
    return "".join(parts), spans


def _supervised_mask(offsets, spans) -> np.ndarray:
    starts = np.array([s for s, _ in offsets], dtype=np.int64)
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return mask


def expand_image_pads(ids: np.ndarray, labels: np.ndarray, pad_id: int, counts: Sequence[int], kind: str = "image"):
    """Repeat the k-th <|image_pad|> (or <|video_pad|>) id counts[k] times (labels there are IGNORE_INDEX)."""
    where = np.flatnonzero(ids == pad_id)
    if len(where) != len(counts):
        raise ValueError(f"text has {len(where)} {kind} pad tokens but there are {len(counts)} {kind}s")
    reps = np.ones(len(ids), dtype=np.int64)
    reps[where] = np.asarray(counts, dtype=np.int64)
    out_labels = labels.copy()
    out_labels[where] = IGNORE_INDEX
    return np.repeat(ids, reps), np.repeat(out_labels, reps)


def check_text(sample: Sample) -> None:
    """SampleError for text that already holds a vision token: the template would take a raw <|image_pad|>
    for an image's pad and expand the wrong one (or find more pads than images), and the packer's count
    would disagree with the loader's."""
    for i, m in enumerate(sample.messages):
        raw = [t for t in VISION_TOKENS if t in m["content"]]
        if raw:
            raise SampleError(sample.source, sample.line, "raw vision token",
                              f"field messages[{i}].content contains {raw[0]}; use <image> / <video> placeholders")


def load_images(sample: Sample) -> list:
    """Decoded images of a sample; an unreadable one is a SampleError naming its field and file."""
    images = []
    for k, p in enumerate(sample.images):
        try:
            images.append(load_image(p))
        except OSError as e:
            raise SampleError(sample.source, sample.line, "unreadable image", f"field images[{k}]: {e}") from None
    return images


# ----------------------------------------------------------------------------------------------
# videos of a sample (metadata only; decoding is data/video.py's load_video)

def video_metas(sample: Sample, check: bool = True) -> list:
    """VideoMeta per video of a sample: the line's `video_meta`, checked against the container header
    with `check` (or read from the header when the line has none). SampleErrors name file:line, field."""
    n_ph = count_placeholders(sample, VIDEO_PLACEHOLDER)
    if n_ph != len(sample.videos):
        raise SampleError(sample.source, sample.line, "video count mismatch",
                          f"{n_ph} <video> placeholders for {len(sample.videos)} videos")
    metas = []
    for k, path in enumerate(sample.videos):
        given = None if sample.video_meta is None else VideoMeta(**sample.video_meta[k])
        real = None
        if given is None or check:
            try:
                real = probe_video(path)
            except (OSError, ValueError) as e:
                raise SampleError(sample.source, sample.line, "unreadable video", f"field videos[{k}]: {e}") from None
        if given is not None and real is not None and (
                (given.frames, given.width, given.height) != (real.frames, real.width, real.height)
                or abs(given.fps - real.fps) > 1e-3 * real.fps):
            raise SampleError(sample.source, sample.line, "video metadata mismatch",
                              f"field video_meta[{k}]={sample.video_meta[k]} but {path} has frames={real.frames}, "
                              f"fps={real.fps:g}, width={real.width}, height={real.height}")
        metas.append(given or real)
    return metas


def video_token_counts(sample: Sample, metas, image: ImageConfig, video, seed: int) -> List[int]:
    """Merged tokens per video from metadata (the fps draw is seeded by (data seed, line, index))."""
    try:
        return [video_tokens(m, image, video, video_rng(seed, sample.line, k)) for k, m in enumerate(metas)]
    except (ValueError, OverflowError) as e:  # OverflowError: trusted metadata too large for a float
        raise SampleError(sample.source, sample.line, "bad video", f"field videos: {e}") from None


class MindVLProcessor:
    """Tokenizer + image processor + chat template; see the module docstring."""

    def __init__(self, tokenizer: Optional[TextTokenizer] = None, config: Optional[DataConfig] = None):
        self.config = config or DataConfig()
        self.tokenizer = tokenizer or load_tokenizer(self.config.tokenizer or None)
        self.image_pad_id = self.tokenizer.token_to_id(IMAGE_PAD)
        self.video_pad_id = self.tokenizer.token_to_id(VIDEO_PAD)
        for t in CHAT_TOKENS:
            self.tokenizer.token_to_id(t)  # fail early on a tokenizer without the chat/vision tokens

    @property
    def image_config(self) -> ImageConfig:
        return self.config.image

    @classmethod
    def from_pretrained(cls, path: Optional[str] = None, **overrides) -> "MindVLProcessor":
        """Tokenizer files from `path` (default: the bundled Qwen3 tokenizer); pixel limits from its
        preprocessor_config.json when present (HF keys min_pixels/max_pixels/size, patch sizes, mean/std);
        the system prompt from its chat_template.json when it records one, the grounding coordinate format it
        records (else plain: data/processor_files.py)."""
        cfg = DataConfig(tokenizer=path or "", image=read_image_config(path), video=read_video_config(path),
                         grounding=read_grounding_config(path))
        system_prompt = read_system_prompt(path)  # the training system prompt (chat_template.json)
        if system_prompt is not None:
            cfg.system_prompt = system_prompt
        for k, v in overrides.items():
            target = cfg.image if hasattr(cfg.image, k) else cfg
            if not hasattr(target, k):
                raise TypeError(f"MindVLProcessor.from_pretrained: unknown option {k!r}")
            setattr(target, k, v)
        cfg.image.validate()
        return cls(config=cfg)

    # -- text ---------------------------------------------------------------------------------
    def encode(self, messages: List[Dict[str, str]], image_counts: Sequence[int],
               add_generation_prompt: bool = False, video_counts: Sequence[int] = ()) -> Tuple[np.ndarray, np.ndarray]:
        """Conversation -> (input_ids int64[n], labels int64[n]) with image and video pads expanded."""
        messages = reformat_messages(messages, self.config.grounding.coord_format)  # data.grounding's format
        text, spans = render(messages, self.config.system_prompt, add_generation_prompt)
        ids, offsets = self.tokenizer.encode_offsets(text)
        ids = np.asarray(ids, dtype=np.int64)
        labels = np.where(_supervised_mask(offsets, spans), ids, IGNORE_INDEX) if len(ids) else ids
        ids, labels = expand_image_pads(ids, labels.astype(np.int64), self.image_pad_id, image_counts)
        return expand_image_pads(ids, labels, self.video_pad_id, video_counts, "video")

    def count_tokens(self, messages: List[Dict[str, str]], image_counts: Sequence[int],
                     video_counts: Sequence[int] = ()) -> int:
        """Sequence length from metadata alone (no image decoding): equals len(encode(...)[0])."""
        text, _ = render(reformat_messages(messages, self.config.grounding.coord_format), self.config.system_prompt)
        return (len(self.tokenizer.encode(text)) + int(sum(image_counts)) - len(image_counts)
                + int(sum(video_counts)) - len(video_counts))

    # -- videos -------------------------------------------------------------------------------
    def video_metas(self, sample: Sample, check: bool = True) -> list:
        return video_metas(sample, check)

    def video_config(self, sample: Sample):
        """The video settings of a sample: its source's own `video:` over `data.video` (DataConfig.video_for)."""
        return self.config.video_for(sample.source) if sample.source else self.config.video

    def video_token_counts(self, sample: Sample, metas) -> List[int]:
        if not metas:
            return []
        return video_token_counts(sample, metas, self.image_config, self.video_config(sample), self.config.seed)

    def process_videos(self, sample: Sample) -> Dict:
        """Decode, sample and patchify a sample's videos: pixel_values_videos, video_grid_thw,
        second_per_grid_ts (absent when the sample has none)."""
        if not sample.videos and not count_placeholders(sample, VIDEO_PLACEHOLDER):
            return {}
        clips, video = [], self.video_config(sample)
        for k, (path, meta) in enumerate(zip(sample.videos, self.video_metas(sample))):
            try:
                clips.append(load_video(path, self.image_config, video,
                                        video_rng(self.config.seed, sample.line, k), meta))
            except (OSError, ValueError) as e:
                raise SampleError(sample.source, sample.line, "unreadable video", f"field videos[{k}]: {e}") from None
        return {"pixel_values_videos": np.concatenate([c.pixel_values for c in clips]),
                "video_grid_thw": np.stack([c.grid_thw for c in clips]),
                "second_per_grid_ts": np.array([c.second_per_grid for c in clips], np.float64)}

    # -- samples ------------------------------------------------------------------------------
    def process_sample(self, sample: Sample, images: Optional[Sequence[Image.Image]] = None) -> Dict:
        """A parsed JSONL sample -> dict(input_ids, labels, pixel_values, image_grid_thw, id, source, line)."""
        if count_placeholders(sample) != len(sample.images if images is None else images):
            raise SampleError(sample.source, sample.line, "image count mismatch",
                              f"{count_placeholders(sample)} <image> placeholders for "
                              f"{len(sample.images if images is None else images)} images")
        check_text(sample)
        if images is None:
            images = load_images(sample)
        for k, im in enumerate(images):
            name = sample.images[k] if k < len(sample.images) else f"images[{k}]"
            if sample.image_sizes is not None and tuple(sample.image_sizes[k]) != tuple(im.size):
                raise SampleError(sample.source, sample.line, "image size mismatch",
                                  f"field image_sizes[{k}]={list(sample.image_sizes[k])} but {name} is "
                                  f"{im.size[0]}x{im.size[1]}")
            bad = quality_errors(im.size[0], im.size[1], self.image_config, name)
            if bad:
                raise SampleError(sample.source, sample.line, bad[0][0], f"field images[{k}]: {bad[0][1]}")
        try:
            pixel_values, grid = process_images(images, self.image_config)
        except ValueError as e:
            raise SampleError(sample.source, sample.line, "bad image", f"field images: {e}") from None
        counts = [] if grid is None else [int(np.prod(g)) // self.image_config.merge_size ** 2 for g in grid]
        videos = self.process_videos(sample)
        vcounts = [int(np.prod(g)) // self.image_config.merge_size ** 2 for g in videos.get("video_grid_thw", [])]
        input_ids, labels = self.encode(sample.messages, counts, video_counts=vcounts)
        return {"input_ids": input_ids, "labels": labels, "pixel_values": pixel_values, "image_grid_thw": grid,
                **videos, "id": sample.id, "source": sample.source, "line": sample.line}

    def __call__(self, messages, images: Optional[Sequence[Image.Image]] = None,
                 add_generation_prompt: Optional[bool] = None, return_tensors: str = "np",
                 videos: Optional[Sequence[str]] = None) -> Dict:
        """HF-style call for one conversation: a batch of one (input_ids [1, n], attention_mask [1, n],
        labels [1, n], and pixel_values [N, C*T*P*P] + image_grid_thw [k, 3] when there are images), as
        numpy arrays (return_tensors="np") or MindSpore Tensors ("ms"); `model(**batch)` takes either.
        Adds the generation prompt when the last turn is not the assistant's (inference) unless told
        otherwise. `videos` are file paths (one `<video>` placeholder each); they add pixel_values_videos,
        video_grid_thw and second_per_grid_ts, sampled as in training."""
        if return_tensors not in ("np", "ms"):
            raise ValueError(f"return_tensors must be 'np' or 'ms', got {return_tensors!r}")
        msgs = normalise_messages(messages)
        images = list(images or [])
        n_ph = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in msgs)
        if n_ph != len(images):
            raise ValueError(f"messages have {n_ph} image placeholders but {len(images)} images were given")
        if add_generation_prompt is None:
            add_generation_prompt = msgs[-1]["role"] != "assistant"
        pixel_values, grid = process_images(images, self.image_config)
        counts = [] if grid is None else [int(np.prod(g)) // self.image_config.merge_size ** 2 for g in grid]
        vids = self.process_videos(Sample(messages=msgs, videos=list(videos or []), source="<call>", line=0))
        vcounts = [int(np.prod(g)) // self.image_config.merge_size ** 2 for g in vids.get("video_grid_thw", [])]
        ids, labels = self.encode(msgs, counts, add_generation_prompt, video_counts=vcounts)
        out = {"input_ids": ids[None], "attention_mask": np.ones((1, len(ids)), dtype=np.int64),
               "labels": labels[None], **vids}
        if pixel_values is not None:
            out["pixel_values"], out["image_grid_thw"] = pixel_values, grid
        if return_tensors == "ms":
            out = {k: Tensor(v) for k, v in out.items()}
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


# ----------------------------------------------------------------------------------------------
# the processor a checkpoint carries (the files: data/processor_files.py)

def save_processor(dst: str, processor: Optional[MindVLProcessor] = None,
                   data_cfg: Optional[DataConfig] = None) -> List[str]:
    """Write the processor files into checkpoint directory `dst` (from a MindVLProcessor, or from a
    DataConfig: its tokenizer, `image` section and `system_prompt`); returns the file names written."""
    processor = processor or MindVLProcessor(config=data_cfg)
    return write_processor_files(dst, processor.tokenizer.source, processor.config)


def processor_of(ckpt: Optional[str]) -> MindVLProcessor:
    """The MindVLProcessor a checkpoint records: its tokenizer (else the bundled Qwen3 one), pixel limits and
    system prompt (each else the default)."""
    if has_tokenizer(ckpt):
        return MindVLProcessor.from_pretrained(ckpt)
    proc = MindVLProcessor.from_pretrained(None)
    proc.config.image = read_image_config(ckpt)
    proc.config.video = read_video_config(ckpt)
    proc.config.grounding = read_grounding_config(ckpt)
    system_prompt = read_system_prompt(ckpt)
    if system_prompt is not None:
        proc.config.system_prompt = system_prompt
    return proc


def carry_processor(dst: str, *sources: Optional[str]) -> List[str]:
    """Write into `dst` the processor of the first source that has processor files (tokenizer, pixel limits,
    system prompt), else the defaults. Used by convert, init, merge and export, which derive one directory
    from others. A complete set is copied verbatim."""
    src = processor_source(*sources)
    copied = copy_processor_files(dst, src)
    return copied if copied is not None else save_processor(dst, processor_of(src))


class ProcessorWriter:
    """`writer(checkpoint_dir)` writes the processor of a stage's DataConfig (the tokenizer is loaded once);
    the trainer passes one to every checkpoint save of the stage."""

    def __init__(self, data_cfg: DataConfig):
        self.data_cfg, self.processor = data_cfg, None

    def __call__(self, dst: str) -> List[str]:
        if self.processor is None:
            self.processor = MindVLProcessor(config=self.data_cfg)
        return save_processor(dst, self.processor)
