"""`mindvl export --ckpt DIR --out DIR [--fp16]`: three MindIR graphs with dynamic shapes + export.json.

    out/vision.mindir    uint8 single-frame patches [N, C*P*P] + window metadata -> image_embeds float32[M, D]
                         (rescale, normalise and temporal patching happen inside, see preprocess.py)
    out/vision_video.mindir  normalised float temporal patches [N, C*T*P*P] (videos, data/video.py) + window
                         metadata -> video_embeds float32[M, D]
    out/prefill.mindir   prompt ids, M-RoPE positions, image_embeds, gather index, cache slots, cache in
                         -> last-token logits float32[B, V], cache out
    out/decode.mindir    one token per row, positions, slot, cache in -> logits float32[B, V], cache out
    out/weights/data_*   every weight once, shared by the four graphs (their parameters name offsets in it)
    out/export.json      every graph's inputs/outputs (name, shape with -1 = dynamic, dtype), file sizes,
                         the host-side model facts (EngineSpec), special token ids, the KV-cache layout and
                         the image preprocessing, so a runner (mindir_runner.py) needs nothing else

Every dimension that varies (patches, batch, prompt length, image tokens, cache length) is dynamic: the
cells get `set_inputs` placeholders with None dims and `mindspore.export(..., file_format="MINDIR")` stores
them. `--fp16` casts the weights to float16 first (the KV cache is then float16 too; logits stay float32).
The graphs hold only MindSpore's own operators: the model's CPU C++ kernels are dropped first (their
composite ops give the same values), so a MindIR runs wherever MindSpore or Lite does.
The output directory is written atomically.

Weights are written once: the four graphs use the same parameters (prefill and decode the whole
language model, both vision graphs the vision tower), and `mindspore.export` would embed them in each
file (or in a `<graph>_variables/` directory each, above 1 GB), four copies of the vision tower's and
two of the language model's weights. Each graph is serialized instead with its parameters pointing
into `weights/` (MindIR's external data: file, offset, length; the 64-byte file header MindSpore's
loader checks), where a weight is appended the first time a graph uses it; `mindspore.load` reads the
graphs as it reads its own split exports. The size against the checkpoint: docs/PERFORMANCE.md,
## checkpoint. `--fp16` loads the checkpoint straight into float16 parameters (no float32 copy).
"""
import dataclasses
import os
import sys
from typing import Dict, Optional

from tqdm import tqdm

import mindspore as ms
from mindspore.train.mind_ir_pb2 import ModelProto
from mindspore.train.serialization import _cell_info

from mindvl_ms.checkpoint.integrity import atomic_dir
from mindvl_ms.checkpoint.io import write_json
from mindvl_ms.checkpoint.pretrained import load_pretrained
from mindvl_ms.config.data import DataConfig, ImageConfig
from mindvl_ms.data.processor import carry_processor, save_processor
from mindvl_ms.data.processor_files import read_image_config, read_system_prompt
from mindvl_ms.infer.engine import EngineSpec
from mindvl_ms.infer.kv_cache import DECODE_NAMES, PREFILL_NAMES, VISION_META, Decode, Prefill, VisionEncoder, param_dtype, \
    supports_cache
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.ops.cpu_kernels import drop_kernels

EXPORT_JSON = "export.json"
FORMAT = "mindvl-mindir"
WEIGHTS = "weights"
WEIGHT_FILE_BYTES = 1 << 30  # a new weights/data_N past this, as MindSpore splits its own exports
_ALIGN = 64  # MindSpore pads each weight to 64 bytes and starts a data file with a 64-byte header


class SharedWeights:
    """The `weights/` files of an export: each parameter appended once, its (file, offset, length) kept for
    every graph that uses it."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(os.path.join(directory, WEIGHTS), exist_ok=True)
        self.where: Dict[str, tuple] = {}
        self._index, self._file, self._offset = -1, None, 0

    def _next_file(self) -> None:
        self.close()
        self._index += 1
        self._file = open(os.path.join(self.directory, self._location()), "wb")
        self._file.write(bytes([sys.byteorder == "little"]) + bytes(_ALIGN - 1))  # the loader's check byte
        self._offset = _ALIGN

    def _location(self) -> str:
        return f"{WEIGHTS}/data_{self._index}"

    def place(self, name: str, param) -> tuple:
        """(location, offset, length) of `name`'s bytes, written on first use."""
        if name not in self.where:
            raw = param.data.get_bytes()
            pad = -len(raw) % _ALIGN
            if self._file is None or (self._offset > _ALIGN and self._offset + len(raw) > WEIGHT_FILE_BYTES):
                self._next_file()
            self._file.write(raw)
            self._file.write(bytes(pad))
            self.where[name] = (self._location(), self._offset, len(raw))
            self._offset += len(raw) + pad
        return self.where[name]

    @property
    def bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.directory, WEIGHTS, f))
                   for f in os.listdir(os.path.join(self.directory, WEIGHTS)))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def save_graph(cell, inputs, path: str, weights: SharedWeights) -> None:
    """Serialize `cell` compiled on `inputs` as MindIR at `path`, its parameters as external data in
    `weights` (see the module doc): what `mindspore.export(..., file_format="MINDIR")` does, but sharing
    the weight files across graphs."""
    syntax = ms.get_context("jit_syntax_level")
    ms.set_context(jit_syntax_level=ms.STRICT)  # as mindspore.export compiles
    try:
        stream, params = _cell_info(cell, False, *inputs)
    finally:
        ms.set_context(jit_syntax_level=syntax)
    model = ModelProto()
    model.ParseFromString(stream)
    for proto in model.graph.parameter:
        name = proto.name[proto.name.find(":") + 1:]
        if name not in params:
            raise ValueError(f"graph parameter {name!r} is not a parameter of {type(cell).__name__}")
        location, offset, length = weights.place(name, params[name])
        proto.external_data.location = location
        proto.external_data.offset = offset
        proto.external_data.length = length
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


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
        weights = SharedWeights(tmp)
        for name, cell, names, inputs, outs in tqdm(graphs, desc="export", unit="graph"):
            cell.set_inputs(*inputs)
            fn = name + ".mindir"
            save_graph(cell, inputs, os.path.join(tmp, fn), weights)
            meta["graphs"][name] = {
                "file": fn, "bytes": os.path.getsize(os.path.join(tmp, fn)), "inputs": _describe(names, inputs),
                "outputs": [{"name": n, "shape": s, "dtype": d} for n, s, d in (outs or lm_out)]}
        weights.close()
        meta["weights"] = {"directory": WEIGHTS, "bytes": weights.bytes, "tensors": len(weights.where)}
        meta["total_bytes"] = sum(g["bytes"] for g in meta["graphs"].values()) + weights.bytes
        meta["processor_files"] = (carry_processor(tmp, processor_from) if processor_from else
                                   save_processor(tmp, data_cfg=DataConfig(image=img)))
        meta["system_prompt"] = read_system_prompt(tmp)
        write_json(os.path.join(tmp, EXPORT_JSON), meta)
    return meta


def export(ckpt: str, out: str, fp16: bool = False) -> Dict:
    """Load `ckpt` (native or HF directory), export to `out`; returns the export.json dict."""
    model = load_pretrained(MindVLModel, ckpt, dtype=ms.float16 if fp16 else None)
    return export_model(model, out, image_config_for(ckpt), extra={"source_checkpoint": os.path.abspath(ckpt)},
                        processor_from=ckpt)
