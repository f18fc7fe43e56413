"""Generation with a static KV cache in graph mode: token-level and text-level APIs.

    from mindvl_ms.infer.generate import generate, generate_text
    ids = generate(model, [{"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid}], max_new_tokens=16)
    texts = generate_text(model, processor, [{"messages": [...], "images": [PIL.Image or path]}])

Samples carry images as float patches (`pixel_values` [N, C*T*P*P] + `image_grid_thw`, what the data
processor emits), uint8 single-frame patches (`pixel_frames` [N, C*P*P] + `image_grid_thw`, normalised
inside the vision graph, see preprocess.py) or precomputed `image_features` (+ `image_grid_thw`).
Options: max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty, eos_token_ids,
stop_strings (need `decode`), seed, padding_side ('left' or 'right'), on_token(row, id) for streaming.

Design: `EagerBackend` wraps the model's own cells (kv_cache.py: vision, prefill, decode, one compile
each for all shapes) and `engine.Engine` does the host-side work; an Engine is kept per model so image
features stay cached across calls (chat turns). Models without a KV-cache layout (DeepSeek-V3 MLA) fall
back to full-sequence forwards of the model per new token (same outputs, slower).
`load_model(ckpt)` builds the plain `models.mindvl.MindVLModel` (the engine needs only its cells);
`load_eval_backend(ckpt)` is what `mindvl eval` calls.
"""
import logging
import os
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image, UnidentifiedImageError

import mindspore as ms
from mindspore import Tensor

from mindvl_ms.checkpoint.pretrained import load_pretrained
from mindvl_ms.data.collate import build_model_inputs, llm_actual_seq_len, model_args
from mindvl_ms.data.processor import processor_of
from mindvl_ms.data.schema import Sample, normalise_messages
from mindvl_ms.infer.engine import Engine, EngineSpec
from mindvl_ms.infer.kv_cache import DECODE_NAMES, PREFILL_NAMES, VISION_META, build_cells, cache_shape, param_dtype, \
    supports_cache
from mindvl_ms.infer.preprocess import uint8_patches
from mindvl_ms.infer.sampling import SamplingConfig, choose, stop_reason
from mindvl_ms.models.mindvl import MindVLModel, cast_params
from mindvl_ms.ops.dispatch import is_ascend
from mindvl_ms.parallel.moe import bind_mindformers_moe

log = logging.getLogger(__name__)
# patches per vision call of EvalBackend.encode_images (16 images of 448x448)
VISION_CALL_PATCHES = 16384
_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class EagerBackend:
    """The MindSpore cells of a loaded model behind the Engine interface."""

    def __init__(self, model, image_mean=None, image_std=None):
        if ms.get_context("mode") != ms.GRAPH_MODE:  # the CLI commands call use_graph_mode(); scripts may not
            log.warning("MindSpore is in PyNative mode: generation runs op by op (far slower than compiled "
                        "graphs); call ms.set_context(mode=ms.GRAPH_MODE) before loading the model")
        self.model = model
        self.dtype = param_dtype(model)
        self.spec = EngineSpec.from_config(model.config, "float16" if self.dtype == ms.float16 else "float32")
        self.vis_f, self.vis_u8, self.prefill_cell, self.decode_cell = build_cells(model, image_mean, image_std)

    def vision(self, pixels: np.ndarray, meta: Dict[str, np.ndarray], uint8: bool) -> np.ndarray:
        cell = self.vis_u8 if uint8 else self.vis_f
        pixels = pixels.astype(np.uint8 if uint8 else np.float32)
        return cell(Tensor(pixels), *[Tensor(meta[k]) for k in VISION_META]).asnumpy()

    def new_cache(self, batch: int, length: int):
        z = np.zeros(cache_shape(self.model.config, batch, length), np.dtype(self.spec.cache_dtype))
        return Tensor(z), Tensor(z)

    def prefill(self, arrays, cache):
        out = self.prefill_cell(*[Tensor(arrays[k]) for k in PREFILL_NAMES], *cache)
        return out[0].asnumpy(), (out[1], out[2])

    def decode(self, arrays, cache):
        out = self.decode_cell(*[Tensor(arrays[k]) for k in DECODE_NAMES], *cache)
        return out[0].asnumpy(), (out[1], out[2])


def get_engine(model, image_mean=None, image_std=None) -> Engine:
    """The Engine of `model` (built once; rebuilt if the parameters changed dtype)."""
    eng = _ENGINES.get(model)
    if eng is None or eng.backend.dtype != param_dtype(model):
        eng = Engine(EagerBackend(model, image_mean, image_std))
        _ENGINES[model] = eng
    return eng


def _sampling(max_new_tokens: int, kw: Dict) -> SamplingConfig:
    fields = SamplingConfig.__dataclass_fields__
    unknown = sorted(set(kw) - set(fields))
    if unknown:
        raise TypeError(f"generate: unknown option(s) {unknown}; known: {sorted(fields)}")
    cfg = SamplingConfig(max_new_tokens=max_new_tokens, **kw)
    cfg.eos_token_ids = tuple(int(i) for i in cfg.eos_token_ids)
    cfg.stop_strings = tuple(cfg.stop_strings)
    return cfg


def generate(model, batch_samples: Sequence[Dict], max_new_tokens: int = 32, *, padding_side: str = "left",
             decode=None, on_token=None, use_cache: bool = True, group_seeds=None, **sampling) -> List[List[int]]:
    """Generated token ids for each sample (see the module docstring for sample keys and options;
    `group_seeds` as in `Engine.generate`)."""
    cfg = _sampling(max_new_tokens, sampling)
    if cfg.stop_strings and decode is None:
        raise ValueError("stop_strings need decode= (a function from token ids to text)")
    if not use_cache or not supports_cache(model.config):
        # row after row; each group's rows draw in turn from the group's generator (one group: cfg.seed)
        groups = group_seeds if group_seeds is not None else [(cfg.seed, len(batch_samples))]
        rngs = [rng for seed, n in groups for rng in [np.random.default_rng(seed)] * n]
        if len(rngs) != len(batch_samples):
            raise ValueError(f"group_seeds cover {len(rngs)} rows, the batch has {len(batch_samples)}")
        return [_generate_full(model, s, cfg, decode, lambda t, r=r: on_token and on_token(r, t), rngs[r])
                for r, s in enumerate(batch_samples)]
    return get_engine(model).generate(batch_samples, cfg, padding_side, decode, on_token, group_seeds)


def _generate_full(model, sample: Dict, cfg: SamplingConfig, decode, on_token, rng) -> List[int]:
    """Reference path without a cache: one full forward of the model per new token."""
    if sample.get("pixel_frames") is not None or sample.get("image_features") is not None:
        raise ValueError("the no-cache path takes float pixel_values only")
    if getattr(model, "_dynamic_shape_inputs", None) is None:
        model.set_dynamic_inputs()  # one compile for the growing sequence
    prompt = [int(i) for i in np.asarray(sample["input_ids"]).reshape(-1)]
    out: List[int] = []
    while True:
        batch = full_inputs(model.config, sample, out)
        logits = model(*model_args(batch))[0].asnumpy()[:, -1]  # [1, V]
        tok = int(choose(logits, [np.array(prompt + out)], cfg, rng)[0])
        out.append(tok)
        on_token(tok)
        if stop_reason(out, cfg, decode):
            return out


def full_inputs(config, sample: Dict, generated: Sequence[int]) -> Dict[str, np.ndarray]:
    """Model inputs for prompt + generated tokens in one row. Generated tokens are plain text (an emitted
    <|image_pad|> id is embedded as a token, as in cached decoding) with positions continuing from the
    prompt's max position + 1."""
    n = len(np.asarray(sample["input_ids"]).reshape(-1))
    k = len(generated)
    batch = build_model_inputs([[dict(sample, labels=None)]], config, pad_to=n + k)
    start = int(batch["position_ids"][0, :, :n].max()) + 1
    batch["input_ids"][0, n:] = np.asarray(generated, np.int32)
    batch["segment_ids"][0, n:] = batch["segment_ids"][0, 0]
    batch["position_ids"][0, :, n:] = start + np.arange(k, dtype=np.int32)
    batch["actual_seq_len"] = llm_actual_seq_len(batch["segment_ids"])  # the row is one segment now
    return batch  # embed_index of the appended columns already points at their own text embeddings


# -- text level ----------------------------------------------------------------------------------

def encode_chat(processor, messages, images: Sequence = (), image_hw: Optional[Sequence] = None,
                videos: Sequence[str] = ()) -> Dict:
    """Chat messages + images (PIL or paths) + video paths -> a generation sample: images as uint8 patches,
    videos sampled and patchified as in training (float temporal patches, second_per_grid_ts)."""
    msgs = normalise_messages(messages)
    frames, grids = [], []
    for i, im in enumerate(images):
        if isinstance(im, (str, os.PathLike)):
            im = open_image(str(im))
        f, g = uint8_patches(im, processor.image_config, None if image_hw is None else image_hw[i])
        frames.append(f)
        grids.append(g)
    m2 = processor.image_config.merge_size ** 2
    counts = [int(np.prod(g)) // m2 for g in grids]
    vids = processor.process_videos(Sample(messages=msgs, videos=[str(v) for v in videos], source="<prompt>"))
    vcounts = [int(np.prod(g)) // m2 for g in vids.get("video_grid_thw", [])]
    ids, _ = processor.encode(msgs, counts, add_generation_prompt=msgs[-1]["role"] != "assistant",
                              video_counts=vcounts)
    out = {"input_ids": ids, **vids}
    if frames:
        out.update(pixel_frames=np.concatenate(frames), image_grid_thw=np.stack(grids))
    return out


def open_image(path: str):
    """Decode an image file; a missing or unreadable file is a clear error naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"image not found: {path}")
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"cannot read image {path}: {e}") from None


def stop_token_ids(processor) -> tuple:
    tok = processor.tokenizer
    return tuple(tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>") if tok.has_token(t))


def generate_text(model, processor, samples: Sequence[Dict], max_new_tokens: int = 64, **kw) -> List[str]:
    """Answers as text for chat samples {"messages": [...], "images": [...], optional "image_hw"}."""
    batch = [s if "input_ids" in s else encode_chat(processor, s["messages"], s.get("images") or (),
                                                     s.get("image_hw")) for s in samples]
    kw.setdefault("eos_token_ids", stop_token_ids(processor))
    stops = tuple(kw.get("stop_strings", ()))
    ids = generate(model, batch, max_new_tokens, decode=lambda t: processor.decode(t), **kw)
    texts = []
    for row in ids:
        text = processor.decode(row)
        for s in stops:
            text = text.split(s)[0]
        texts.append(text.strip())
    return texts


def use_graph_mode() -> None:
    """Compiled graphs for the commands that run a model (eval, search-resolution, rollout, generate, chat,
    export). MindSpore's default is PyNative (op by op), many times slower per batch for `mindvl eval`
    (docs/PERFORMANCE.md, ## infer)."""
    ms.set_context(mode=ms.GRAPH_MODE)


def load_model(ckpt: str, fp16: bool = False):
    """A checkpoint directory (native or HF) -> model in inference dtype, with clear errors."""
    if not os.path.isdir(ckpt):
        raise FileNotFoundError(f"checkpoint directory not found: {ckpt}")
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise FileNotFoundError(f"{ckpt}: no config.json (expected a checkpoint directory)")
    model = load_pretrained(MindVLModel, ckpt)
    if is_ascend():
        bind_mindformers_moe(model)  # MindFormers' router and dispatcher: the MoE default on Ascend
    return cast_params(model, ms.float16) if fp16 else model


def load_processor(ckpt: Optional[str], model_config=None):
    """The checkpoint's processor (data/processor_files.py): its tokenizer when it ships one, else the
    bundled Qwen3 tokenizer; its pixel limits (preprocessor_config.json) and training system prompt
    (chat_template.json) when recorded, else the defaults. Checked against the model's vocabulary."""
    proc = processor_of(ckpt)
    if model_config is not None:
        if proc.image_pad_id != model_config.image_token_id:
            raise ValueError(f"tokenizer's <|image_pad|> is {proc.image_pad_id} but the model expects "
                             f"{model_config.image_token_id}")
        if proc.tokenizer.vocab_size > model_config.text.vocab_size:
            raise ValueError(f"tokenizer has {proc.tokenizer.vocab_size} tokens, the model only "
                             f"{model_config.text.vocab_size}")
    return proc


GROUNDING_TAGS = ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                  "<|quad_end|>")


def decode_answer(processor, ids: Sequence[int], show_special: bool = False) -> str:
    """Generated ids -> the text `mindvl generate` / `chat` print: special tokens dropped except the
    grounding tags (`<|box_start|>(x1,y1),(x2,y2)<|box_end|>` stays readable); with show_special every
    token as text, the stop token included."""
    tok = processor.tokenizer
    ids = [int(i) for i in ids]
    if show_special:
        return tok.decode(ids, skip_special_tokens=False)
    keep = {tok.token_to_id(t) for t in GROUNDING_TAGS if tok.has_token(t)}
    parts, run = [], []
    for i in ids:
        if i in keep:  # special tokens are whole tokens, so decoding around them splits no character
            parts += [tok.decode(run, skip_special_tokens=True), tok.decode([i], skip_special_tokens=False)]
            run = []
        else:
            run.append(i)
    return "".join(parts + [tok.decode(run, skip_special_tokens=True)])


class EvalBackend:
    """`mindvl eval`'s backend: generate(samples) -> answers, encode_images([(path, h, w), ...]) -> features."""

    def __init__(self, model, processor, max_new_tokens: int = 128):
        self.model, self.processor, self.max_new_tokens = model, processor, max_new_tokens
        self.engine = get_engine(model)

    def encode_images(self, requests: Sequence[Tuple[str, int, int]]) -> List[np.ndarray]:
        """Merged visual tokens of each (path, resized height, width): consecutive images share one vision
        call up to VISION_CALL_PATCHES patches (a call's fixed cost is most of a small image's; the bound
        keeps a batch of large images from holding all their activations at once)."""
        groups, size = [[]], 0
        for path, height, width in requests:
            frames, grid = uint8_patches(open_image(path), self.processor.image_config, (height, width))
            n = int(np.prod(grid))
            if groups[-1] and size + n > VISION_CALL_PATCHES:
                groups.append([])
                size = 0
            groups[-1].append({"pixel_frames": frames, "image_grid_thw": grid[None]})
            size += n
        return [f[0] for g in groups if g for f in self.engine.image_features(g)]

    def generate(self, samples: Sequence[Dict]) -> List[str]:
        """Greedy answers; samples carry messages, image paths, resized image_hw and optionally the
        features from encode_images (then the images are not decoded again)."""
        if not samples:
            return []
        p = self.processor.image_config.patch_size
        batch = []
        for s in samples:
            feats = s.get("image_features")
            if feats is None or not s.get("images"):
                batch.append(encode_chat(self.processor, s["messages"], s.get("images") or (), s.get("image_hw")))
                continue
            ids, _ = self.processor.encode(normalise_messages(s["messages"]), [f.shape[0] for f in feats],
                                           add_generation_prompt=True)
            grids = np.array([[1, h // p, w // p] for h, w in s["image_hw"]], np.int64)
            batch.append({"input_ids": ids, "image_features": feats, "image_grid_thw": grids})
        n = max(int(s.get("max_new_tokens", self.max_new_tokens)) for s in samples)
        return generate_text(self.model, self.processor, batch, max_new_tokens=n)


def load_eval_backend(ckpt: str, max_new_tokens: int = 128) -> EvalBackend:
    model = load_model(ckpt)
    return EvalBackend(model, load_processor(ckpt, model.config), max_new_tokens)
