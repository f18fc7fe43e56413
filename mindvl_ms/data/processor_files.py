"""The processor a checkpoint carries: tokenizer files, preprocessor_config.json and the chat template.

Every checkpoint mindvl-ms writes (training stages, SFT, merge, convert, init) holds, next to
config.json and the weights, what is needed to format inputs exactly as in training:
    tokenizer.json / vocab.json + merges.txt / tokenizer_config.json   copied from the tokenizer used
    preprocessor_config.json   Qwen2VLImageProcessor keys: min_pixels, max_pixels (and size.shortest_edge /
                               longest_edge), patch_size, temporal_patch_size, merge_size, image_mean/std;
                               this project's `video` and `grounding` (coord_format) sections
    chat_template.json         {"chat_template": Jinja text, "system_prompt": the training system prompt}
`MindVLProcessor.from_pretrained(ckpt)` reads all three, so `mindvl generate`, `chat`, `eval`,
`search-resolution` and `export` reproduce training-time formatting without flags. transformers'
`AutoProcessor.from_pretrained(ckpt)` reads the same files (the Jinja template renders exactly what
`data.processor.render` does: the system turn only when the system prompt is non-empty and the
conversation has none, `<image>` -> `<|vision_start|><|image_pad|><|vision_end|>`; tests check both).
The checkpoint layout as a whole is described in docs/CHECKPOINTS.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import List, Optional, Tuple

from mindvl_ms.config.base import load
from mindvl_ms.config.data import DataConfig, ImageConfig
from mindvl_ms.config.grounding import RECORDLESS_COORD_FORMAT, GroundingConfig
from mindvl_ms.config.video import VideoConfig
from mindvl_ms.data.tokens import IM_END, IM_START, IMAGE_TAG, VIDEO_TAG
from mindvl_ms.data.tokenizer import SUBSET_FILE

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
                   SUBSET_FILE)  # a vocabulary subset: the model's ids are a subset of the tokenizer's
PREPROCESSOR = "preprocessor_config.json"
CHAT_TEMPLATE = "chat_template.json"
PROCESSOR_FILES = TOKENIZER_FILES + (PREPROCESSOR, CHAT_TEMPLATE)


def _lit(text: str) -> str:
    """A Jinja string literal for `text` (a JSON string is one; Jinja decodes its escapes)."""
    return json.dumps(text, ensure_ascii=False)


def chat_template(system_prompt: str) -> str:
    """Jinja chat template equal to `data.processor.render` with this system prompt (string contents with
    `<image>` / `<video>` placeholders, or transformers-style lists of {"type": "text"|"image"|"video"} parts)."""
    system = ""
    if system_prompt:  # a system turn only when the conversation has none, as render() does
        turn = _lit(f"{IM_START}system\n{system_prompt}{IM_END}\n")
        system = f"{{%- if messages[0]['role'] != 'system' %}}{{{{- {turn} }}}}{{%- endif %}}"
    image, video, start, end = _lit(IMAGE_TAG), _lit(VIDEO_TAG), _lit(IM_START), _lit(IM_END + "\n")
    generation = _lit(IM_START + "assistant\n")
    return (
        system
        + "{%- for message in messages %}"
        + f"{{{{- {start} + message['role'] + '\\n' }}}}"
        + "{%- if message['content'] is string %}"
        + f"{{{{- message['content'] | replace('<image>', {image}) | replace('<video>', {video}) }}}}"
        + "{%- else %}{%- for part in message['content'] %}"
        + f"{{%- if part['type'] == 'image' %}}{{{{- {image} }}}}"
        + f"{{%- elif part['type'] == 'video' %}}{{{{- {video} }}}}"
        + f"{{%- elif part['type'] == 'text' %}}{{{{- part['text'] | replace('<image>', {image}) "
        + f"| replace('<video>', {video}) }}}}{{%- endif %}}"
        + "{%- endfor %}{%- endif %}"
        + f"{{{{- {end} }}}}"
        + "{%- endfor %}"
        + f"{{%- if add_generation_prompt %}}{{{{- {generation} }}}}{{%- endif %}}"
    )


def preprocessor_dict(image_cfg, video_cfg=None) -> dict:
    """transformers' Qwen2VLImageProcessor configuration for an `ImageConfig`, plus this project's `video`
    section (data.video: fps and frame budget) when given."""
    extra = {} if video_cfg is None else {"video": dataclasses.asdict(video_cfg)}
    return {**extra,
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": list(image_cfg.image_mean), "image_std": list(image_cfg.image_std),
        "min_pixels": int(image_cfg.min_pixels), "max_pixels": int(image_cfg.max_pixels),
        "size": {"shortest_edge": int(image_cfg.min_pixels), "longest_edge": int(image_cfg.max_pixels)},
        "patch_size": int(image_cfg.patch_size), "temporal_patch_size": int(image_cfg.temporal_patch_size),
        "merge_size": int(image_cfg.merge_size),
    }


def tokenizer_source_files(source: str) -> List[str]:
    """Tokenizer files to copy for a tokenizer loaded from `source` (a directory or a file)."""
    if os.path.isfile(source):
        d = os.path.dirname(source)
        extra = os.path.join(d, "tokenizer_config.json")
        return [source] + ([extra] if os.path.isfile(extra) and extra != source else [])
    names = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(source, f))]
    if "tokenizer.json" in names:  # the fast tokenizer file is complete; vocab/merges would only duplicate it
        names = [f for f in names if f not in ("vocab.json", "merges.txt")]
    return [os.path.join(source, f) for f in names]


def write_processor_files(dst: str, tokenizer_source: str, cfg: DataConfig) -> List[str]:
    """Write the processor files into checkpoint directory `dst`: the tokenizer files of `tokenizer_source`
    (a directory or file, `TextTokenizer.source`), the `image`/`video`/`grounding` sections of `cfg` as
    preprocessor_config.json and its `system_prompt` as chat_template.json; returns the file names written."""
    written = []
    for src in tokenizer_source_files(tokenizer_source):
        name = os.path.basename(src)
        if os.path.abspath(src) != os.path.abspath(os.path.join(dst, name)):
            shutil.copyfile(src, os.path.join(dst, name))
        written.append(name)
    with open(os.path.join(dst, PREPROCESSOR), "w", encoding="utf-8") as f:
        json.dump({**preprocessor_dict(cfg.image, cfg.video), "grounding": dataclasses.asdict(cfg.grounding)}, f,
                  indent=2)
    with open(os.path.join(dst, CHAT_TEMPLATE), "w", encoding="utf-8") as f:
        json.dump({"chat_template": chat_template(cfg.system_prompt), "system_prompt": cfg.system_prompt}, f,
                  indent=2, ensure_ascii=False)
    return written + [PREPROCESSOR, CHAT_TEMPLATE]


def read_system_prompt(ckpt: Optional[str]) -> Optional[str]:
    """The system prompt recorded in ckpt/chat_template.json (None when the checkpoint records none)."""
    p = os.path.join(ckpt, CHAT_TEMPLATE) if ckpt else ""
    if not p or not os.path.isfile(p):
        return None
    with open(p, encoding="utf-8") as f:
        d = json.load(f)
    sp = d.get("system_prompt") if isinstance(d, dict) else None
    return sp if isinstance(sp, str) else None


def has_tokenizer(path: Optional[str]) -> bool:
    return bool(path) and os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "vocab.json", "tokenizer.model"))


def _read_preprocessor(ckpt: Optional[str]) -> Tuple[str, dict]:
    """(path, contents) of ckpt/preprocessor_config.json; ("", {}) when there is none."""
    fn = os.path.join(ckpt, PREPROCESSOR) if ckpt else ""
    if not fn or not os.path.isfile(fn):
        return "", {}
    with open(fn, encoding="utf-8") as f:
        return fn, json.load(f)


def read_image_config(ckpt: Optional[str]) -> ImageConfig:
    """ImageConfig from ckpt/preprocessor_config.json (HF keys min_pixels/max_pixels, `size` as fallback,
    patch sizes, mean/std), defaults otherwise."""
    fn, d = _read_preprocessor(ckpt)
    size = d.get("size") or {}
    img = {"min_pixels": d.get("min_pixels", size.get("shortest_edge")),
           "max_pixels": d.get("max_pixels", size.get("longest_edge")),
           **{k: d.get(k) for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")}}
    return load(ImageConfig, {k: v for k, v in img.items() if v is not None}, source=fn or None)


def read_video_config(ckpt: Optional[str]) -> VideoConfig:
    """VideoConfig from the `video` section of ckpt/preprocessor_config.json, defaults otherwise."""
    fn, d = _read_preprocessor(ckpt)
    return load(VideoConfig, d["video"], source=fn) if "video" in d else VideoConfig()


def read_grounding_config(ckpt: Optional[str]) -> GroundingConfig:
    """GroundingConfig from the `grounding` section of ckpt/preprocessor_config.json; a checkpoint that records
    none (a converted Hugging Face model, or one written before the section) keeps its plain numbers."""
    fn, d = _read_preprocessor(ckpt)
    if "grounding" in d:
        return load(GroundingConfig, d["grounding"], source=fn)
    return GroundingConfig(coord_format=RECORDLESS_COORD_FORMAT)


def processor_source(*sources: Optional[str]) -> Optional[str]:
    """The first of `sources` holding any processor file (None when none does)."""
    return next((s for s in sources if s and any(os.path.isfile(os.path.join(s, f)) for f in PROCESSOR_FILES)),
                None)


def copy_processor_files(dst: str, src: Optional[str]) -> Optional[List[str]]:
    """Copy a complete set of processor files (a tokenizer, preprocessor_config.json, chat_template.json)
    from `src` into `dst` verbatim; returns the names, or None when `src` has no complete set."""
    if not (src and has_tokenizer(src) and all(os.path.isfile(os.path.join(src, f))
                                               for f in (PREPROCESSOR, CHAT_TEMPLATE))):
        return None
    names = [os.path.basename(f) for f in tokenizer_source_files(src)] + [PREPROCESSOR, CHAT_TEMPLATE]
    for name in names:
        if os.path.abspath(os.path.join(src, name)) != os.path.abspath(os.path.join(dst, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return names
