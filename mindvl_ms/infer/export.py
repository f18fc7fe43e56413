"""`mindvl export --ckpt DIR --out DIR [--fp16]`: three MindIR graphs with dynamic shapes + export.json.

    out/vision.mindir    uint8 single-frame patches [N, C*P*P] + window metadata -> image_embeds float32[M, D]
                         (rescale, normalise and temporal patching happen inside, see preprocess.py)
    out/vision_video.mindir  normalised float temporal patches [N, C*T*P*P] (videos, data/video.py) + window
                         metadata -> video_embeds float32[M, D]
    out/prefill.mindir   prompt ids, M-RoPE positions, image_embeds, gather index, cache slots, cache in
                         -> last-token logits float32[B, V], cache out
    out/decode.mindir    one token per row, positions, slot, cache in -> logits float32[B, V], cache out
    out/export.json      every graph's inputs/outputs (name, shape with -1 = dynamic, dtype), file sizes,
                         the host-side model facts (EngineSpec), special token ids, the KV-cache layout and
                         the image preprocessing, so a runner (mindir_runner.py) needs nothing else

Every dimension that varies (patches, batch, prompt length, image tokens, cache length) is dynamic: the
cells get `set_inputs` placeholders with None dims and `mindspore.export(..., file_format="MINDIR")` stores
them. `--fp16` casts the weights to float16 first (the KV cache is then float16 too; logits stay float32).
The graphs hold only MindSpore's own operators: the model's CPU C++ kernels are dropped first (their
composite ops give the same values), so a MindIR runs wherever MindSpore or Lite does.
The output directory is written atomically.
"""
import dataclasses
import json
import os
from typing import Dict, Optional

from tqdm import tqdm

import mindspore as ms

from mindvl_ms.checkpoint.integrity import atomic_dir
from mindvl_ms.checkpoint.io import write_json
from mindvl_ms.config.data import DataConfig, ImageConfig
from mindvl_ms.data.processor import carry_processor, save_processor
from mindvl_ms.data.processor_files import read_image_config, read_system_prompt
from mindvl_ms.infer.engine import EngineSpec
from mindvl_ms.infer.generate import load_model
from mindvl_ms.infer.kv_cache import DECODE_NAMES, PREFILL_NAMES, VISION_META, Decode, Prefill, VisionEncoder, param_dtype, \
    supports_cache
from mindvl_ms.ops.cpu_kernels import drop_kernels

EXPORT_JSON = "export.json"
FORMAT = "mindvl-mindir"


def _dtype_name(d) -> str:
    return {ms.float32: "float32", ms.float16: "float16", ms.int32: "int32", ms.uint8: "uint8"}.get(d, str(d))


def _describe(names, placeholders):
    return [{"name": n, "shape": [-1 if s is None or s < 0 else int(s) for s in t.shape], "dtype": _dtype_name(t.dtype)}
            for n, t in zip(names, placeholders)]


def image_config_for(ckpt: str):
    """The checkpoint's preprocessor_config.json values when present, else the Qwen2-VL defaults."""
    return read_image_config(ckpt)


def export_model(model, out: str, image_config=None, extra: Optional[Dict] = None,
                 processor_from: Optional[str] = None) -> Dict:
    """Export a loaded model's vision / prefill / decode graphs to `out`; returns the export.json dict.
    The processor files of `processor_from` (a checkpoint; defaults when None) are written next to the
    graphs (tokenizer, preprocessor_config.json, chat_template.json with the training system prompt)."""
    cfg = model.config
    if not supports_cache(cfg):
        raise ValueError(f"export supports qwen2/qwen3 language models (KV-cache layout); this checkpoint has "
                         f"{cfg.text.model_type}")
    img = image_config or ImageConfig()
    if img.patch_size != cfg.vision.patch_size or img.merge_size != cfg.vision.spatial_merge_size or \
            img.temporal_patch_size != cfg.vision.temporal_patch_size:
        raise ValueError("preprocessing patch/merge/temporal sizes disagree with the model's vision config")
    # portable graphs: the CPU C++ kernels (ops/cpu_kernels.py) would tie the MindIR to a library in this
    # machine's cache, so the model runs its composite ops from here on (the same forward values)
    drop_kernels(model)
    dtype = param_dtype(model)
    vision = VisionEncoder(model, img.image_mean, img.image_std, uint8=True)
    video = VisionEncoder(model)
    prefill, decode = Prefill(model), Decode(model)
    graphs = [("vision", vision, ("pixel_frames",) + VISION_META, vision.dynamic_inputs(),
               [("image_embeds", [-1, cfg.text.hidden_size], "float32")]),
              ("vision_video", video, ("pixel_values_videos",) + VISION_META, video.dynamic_inputs(),
               [("video_embeds", [-1, cfg.text.hidden_size], "float32")]),
              ("prefill", prefill, PREFILL_NAMES + ("cache_k", "cache_v"), prefill.dynamic_inputs(dtype), None),
              ("decode", decode, DECODE_NAMES + ("cache_k", "cache_v"), decode.dynamic_inputs(dtype), None)]
    t = cfg.text
    cache = [t.num_hidden_layers, -1, t.num_key_value_heads, -1, t.head_dim_]
    lm_out = [("logits", [-1, t.vocab_size], "float32"), ("cache_k", cache, _dtype_name(dtype)),
              ("cache_v", cache, _dtype_name(dtype))]
    meta = {"format": FORMAT, "version": 1, "dtype": _dtype_name(dtype), "graphs": {},
            "engine": dataclasses.asdict(EngineSpec.from_config(cfg, _dtype_name(dtype))),
            "tokens": {"image_token_id": cfg.image_token_id, "vision_start_token_id": cfg.vision_start_token_id,
                       "vision_end_token_id": cfg.vision_end_token_id, "video_token_id": cfg.video_token_id},
            "kv_cache": {"layout": "[layers, batch, kv_heads, slots, head_dim]", "shape": cache,
                         "dtype": _dtype_name(dtype)},
            "preprocess": {"input": "uint8 RGB, resized by smart_resize + PIL bicubic, patches [N, C*P*P] in "
                                    "2x2 merge-unit order (one frame; the graph repeats it temporal_patch_size "
                                    "times)", "rescale": "1/255", "resample": "bicubic",
                           **dataclasses.asdict(img)},
            "model_config": dataclasses.asdict(cfg), **(extra or {})}
    with atomic_dir(out) as tmp:
        for name, cell, names, inputs, outs in tqdm(graphs, desc="export", unit="graph"):
            cell.set_inputs(*inputs)
            ms.export(cell, *inputs, file_name=os.path.join(tmp, name), file_format="MINDIR")
            fn = name + ".mindir"
            meta["graphs"][name] = {
                "file": fn, "bytes": _size(tmp, name), "inputs": _describe(names, inputs),
                "outputs": [{"name": n, "shape": s, "dtype": d} for n, s, d in (outs or lm_out)]}
        meta["total_bytes"] = sum(g["bytes"] for g in meta["graphs"].values())
        meta["processor_files"] = (carry_processor(tmp, processor_from) if processor_from else
                                   save_processor(tmp, data_cfg=DataConfig(image=img)))
        meta["system_prompt"] = read_system_prompt(tmp)
        write_json(os.path.join(tmp, EXPORT_JSON), meta)
    return meta


def _size(directory: str, name: str) -> int:
    """Bytes of a graph file plus any external-weight files MindSpore wrote next to it."""
    total = 0
    for entry in os.listdir(directory):
        p = os.path.join(directory, entry)
        if entry == name + ".mindir" or entry.startswith(name + "_variables") or entry.startswith(name + "_graph"):
            if os.path.isdir(p):
                total += sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(p) for f in fs)
            else:
                total += os.path.getsize(p)
    return total


def export(ckpt: str, out: str, fp16: bool = False) -> Dict:
    """Load `ckpt` (native or HF directory), export to `out`; returns the export.json dict."""
    model = load_model(ckpt, fp16)
    return export_model(model, out, image_config_for(ckpt), extra={"source_checkpoint": os.path.abspath(ckpt)},
                        processor_from=ckpt)
