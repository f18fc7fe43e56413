"""The processor a checkpoint carries: tokenizer files, preprocessor_config.json and the chat template.

Every checkpoint mindvl-ms writes (training stages, SFT, merge, convert, init) holds, next to
config.json and the weights, what is needed to format inputs exactly as in training:
    tokenizer.json / vocab.json + merges.txt / tokenizer_config.json   copied from the tokenizer used
    preprocessor_config.json   Qwen2VLImageProcessor keys: min_pixels, max_pixels (and size.shortest_edge /
                               longest_edge), patch_size, temporal_patch_size, merge_size, image_mean/std
    chat_template.json         {"chat_template": Jinja text, "system_prompt": the training system prompt}
`MindVLProcessor.from_pretrained(ckpt)` reads all three, so `mindvl generate`, `chat`, `eval`,
`search-resolution` and `export` reproduce training-time formatting without flags. transformers'
`AutoProcessor.from_pretrained(ckpt)` reads the same files (the Jinja template renders exactly what
`data.processor.render` does: the system turn only when the system prompt is non-empty and the
conversation has none, `<image>` -> `<|vision_start|><|image_pad|><|vision_end|>`; tests check both).
The checkpoint layout as a whole is described in docs/CHECKPOINTS.md.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import List, Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
                   "vocab_subset.json")  # data.vocab_subset: the model's ids are a subset of the tokenizer's
PREPROCESSOR = "preprocessor_config.json"
CHAT_TEMPLATE = "chat_template.json"
PROCESSOR_FILES = TOKENIZER_FILES + (PREPROCESSOR, CHAT_TEMPLATE)
IMAGE_TAG = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_TAG = "<|vision_start|><|video_pad|><|vision_end|>"


def _lit(text: str) -> str:
    """A Jinja string literal for `text` (a JSON string is one; Jinja decodes its escapes)."""
    return json.dumps(text, ensure_ascii=False)


def chat_template(system_prompt: str) -> str:
    """Jinja chat template equal to `data.processor.render` with this system prompt (string contents with
    `<image>` / `<video>` placeholders, or transformers-style lists of {"type": "text"|"image"|"video"} parts)."""
    system = ""
    if system_prompt:  # a system turn only when the conversation has none, as render() does
        turn = _lit(f"<|im_start|>system\n{system_prompt}<|im_end|>\n")
        system = f"{{%- if messages[0]['role'] != 'system' %}}{{{{- {turn} }}}}{{%- endif %}}"
    image, video = _lit(IMAGE_TAG), _lit(VIDEO_TAG)
    return (
        system
        + "{%- for message in messages %}"
        + "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        + "{%- if message['content'] is string %}"
        + f"{{{{- message['content'] | replace('<image>', {image}) | replace('<video>', {video}) }}}}"
        + "{%- else %}{%- for part in message['content'] %}"
        + f"{{%- if part['type'] == 'image' %}}{{{{- {image} }}}}"
        + f"{{%- elif part['type'] == 'video' %}}{{{{- {video} }}}}"
        + f"{{%- elif part['type'] == 'text' %}}{{{{- part['text'] | replace('<image>', {image}) "
        + f"| replace('<video>', {video}) }}}}{{%- endif %}}"
        + "{%- endfor %}{%- endif %}"
        + "{{- '<|im_end|>\\n' }}"
        + "{%- endfor %}"
        + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def preprocessor_dict(image_cfg, video_cfg=None) -> dict:
    """transformers' Qwen2VLImageProcessor configuration for an `ImageConfig`, plus this project's `video`
    section (data.video: fps and frame budget) when given."""
    import dataclasses

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


def save_processor(dst: str, processor=None, data_cfg=None) -> List[str]:
    """Write the processor files into checkpoint directory `dst` (from a MindVLProcessor, or from a
    DataConfig: its tokenizer, `image` section and `system_prompt`); returns the file names written."""
    from mindvl_ms.data.processor import MindVLProcessor

    if processor is None:
        processor = MindVLProcessor(config=data_cfg)
    cfg = processor.config
    written = []
    for src in tokenizer_source_files(processor.tokenizer.source):
        name = os.path.basename(src)
        if os.path.abspath(src) != os.path.abspath(os.path.join(dst, name)):
            shutil.copyfile(src, os.path.join(dst, name))
        written.append(name)
    with open(os.path.join(dst, PREPROCESSOR), "w", encoding="utf-8") as f:
        json.dump(preprocessor_dict(cfg.image, cfg.video), f, indent=2)
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


def read_image_config(ckpt: Optional[str]):
    """ImageConfig from ckpt/preprocessor_config.json (HF keys; `size` as fallback), defaults otherwise."""
    from mindvl_ms.config.data import ImageConfig

    cfg = ImageConfig()
    fn = os.path.join(ckpt, PREPROCESSOR) if ckpt else ""
    if fn and os.path.isfile(fn):
        with open(fn, encoding="utf-8") as f:
            d = json.load(f)
        size = d.get("size") or {}
        d.setdefault("min_pixels", size.get("shortest_edge"))
        d.setdefault("max_pixels", size.get("longest_edge"))
        for k in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean",
                  "image_std"):
            if d.get(k) is not None:
                setattr(cfg, k, d[k])
        cfg.validate()
    return cfg


def read_video_config(ckpt: Optional[str]):
    """VideoConfig from the `video` section of ckpt/preprocessor_config.json, defaults otherwise."""
    from mindvl_ms.config.base import load
    from mindvl_ms.config.video import VideoConfig

    fn = os.path.join(ckpt, PREPROCESSOR) if ckpt else ""
    if fn and os.path.isfile(fn):
        with open(fn, encoding="utf-8") as f:
            d = json.load(f)
        if "video" in d:
            return load(VideoConfig, d["video"], source=fn)
    return VideoConfig()


def processor_of(ckpt: Optional[str]):
    """The MindVLProcessor a checkpoint records: its tokenizer (else the bundled Qwen3 one), pixel limits and
    system prompt (each else the default)."""
    from mindvl_ms.data.processor import MindVLProcessor

    if has_tokenizer(ckpt):
        return MindVLProcessor.from_pretrained(ckpt)
    proc = MindVLProcessor.from_pretrained(None)
    proc.config.image = read_image_config(ckpt)
    proc.config.video = read_video_config(ckpt)
    system_prompt = read_system_prompt(ckpt)
    if system_prompt is not None:
        proc.config.system_prompt = system_prompt
    return proc


def carry_processor(dst: str, *sources: Optional[str]) -> List[str]:
    """Write into `dst` the processor of the first source that has processor files (tokenizer, pixel limits,
    system prompt), else the defaults. Used by convert, init, merge and export, which derive one directory
    from others."""
    src = next((s for s in sources if s and any(os.path.isfile(os.path.join(s, f)) for f in PROCESSOR_FILES)),
               None)
    if src and has_tokenizer(src) and all(os.path.isfile(os.path.join(src, f)) for f in (PREPROCESSOR, CHAT_TEMPLATE)):
        names = [os.path.basename(f) for f in tokenizer_source_files(src)] + [PREPROCESSOR, CHAT_TEMPLATE]
        for name in names:  # complete: copied verbatim
            if os.path.abspath(os.path.join(src, name)) != os.path.abspath(os.path.join(dst, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
        return names
    return save_processor(dst, processor_of(src))


class ProcessorWriter:
    """`writer(checkpoint_dir)` writes the processor of a stage's DataConfig (the tokenizer is loaded once);
    the trainer passes one to every checkpoint save of the stage."""

    def __init__(self, data_cfg):
        self.data_cfg, self.processor = data_cfg, None

    def __call__(self, dst: str) -> List[str]:
        from mindvl_ms.data.processor import MindVLProcessor

        if self.processor is None:
            self.processor = MindVLProcessor(config=self.data_cfg)
        return save_processor(dst, self.processor)
