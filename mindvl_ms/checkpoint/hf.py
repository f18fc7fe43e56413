"""Hugging Face <-> native checkpoints for MindVL (Qwen2.5-VL layout; Qwen3/Qwen2 LLM checkpoints).

Native parameter names equal the HF Qwen2.5-VL file names (`visual.*`, `model.*`, `lm_head.*`), so the
conversion is near-identity:
- `visual.patch_embed.proj.weight`: HF Conv3d [E, C, T, P, P] <-> native MatMul weight [E, C*T*P*P]
  (a reshape: bit-exact);
- transformers >= 4.52 in-memory names (`model.visual.*`, `model.language_model.*`) are accepted too;
- DeepSeek-V3 language models map through `hf_deepseek` when present.
A native checkpoint directory is `config.json` ({"format": "mindvl-native", "config": {...}}) plus
safetensors; an HF directory is transformers' `config.json` plus safetensors. Every read of a directory
here verifies it first against its checksums (`integrity.verify_checkpoint`, once per load, the
training state excepted); every write goes through `integrity.atomic_dir`, which writes them.

Everything here works on numpy tensors and JSON, without MindSpore or model classes; building and filling
models from these tensors is `checkpoint/pretrained.py`.
"""
import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from mindvl_ms.config import MindVLConfig, TextConfig, from_hf_dict, load, to_hf_dict
from mindvl_ms.config.model import text_from_hf, vision_from_hf
from mindvl_ms.checkpoint import hf_deepseek
from mindvl_ms.checkpoint.integrity import atomic_dir, tensor_checksums, verify_checkpoint, verify_except_tensors
from mindvl_ms.checkpoint.io import DEFAULT_SHARD_BYTES, FileSpan, RawTensor, TensorFile, TensorSpec, read_tensors, \
    weight_files, write_json, write_sharded, write_tensors

PATCH = "visual.patch_embed.proj.weight"
NATIVE = "mindvl-native"


def read_config_json(path: str) -> dict:
    fn = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if not os.path.isfile(fn):
        raise FileNotFoundError(f"{path}: no config.json (expected a checkpoint directory)")
    with open(fn, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{fn}: not valid JSON: {e}") from None


def is_native(cfg_json: dict) -> bool:
    return cfg_json.get("format") == NATIVE


def config_from_dir(path: str) -> MindVLConfig:
    d = read_config_json(path)
    if is_native(d):
        return load(MindVLConfig, d["config"], source=os.path.join(path, "config.json"))
    return from_hf_dict(d)


def normalize_hf_name(name: str) -> str:
    """transformers in-memory names -> checkpoint-file names."""
    if name.startswith("model.visual."):
        return name[len("model."):]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def hf_to_native(tensors: Dict[str, RawTensor], cfg: MindVLConfig) -> Dict[str, RawTensor]:
    out = {}
    for name, t in tensors.items():
        name = normalize_hf_name(name)
        if name == PATCH and t.data.ndim == 5:
            t = t.reshape(t.shape[0], -1)
        out[name] = t
    if cfg.text.model_type == "deepseek_v3":
        out = hf_deepseek.hf_to_native(out, cfg.text)
    return out


def native_to_hf(tensors: Dict[str, RawTensor], cfg: MindVLConfig) -> Dict[str, RawTensor]:
    if cfg.text.model_type == "deepseek_v3":
        tensors = hf_deepseek.native_to_hf(tensors, cfg.text)
    v = cfg.vision
    out = dict(tensors)
    if PATCH in out:
        out[PATCH] = out[PATCH].reshape(v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size,
                                        v.patch_size)
    return out


# -- streamed sources: a checkpoint's tensors renamed and reshaped for the other layout, read one by one ---

@dataclass
class Source:
    """One output tensor of a conversion: where its bytes are (`file`, `name`) and what it is called and
    shaped as on the other side (`spec`). A rename and a reshape touch no data, so each tensor is read once,
    when it is written or loaded."""

    file: str
    name: str
    spec: TensorSpec


class Sources:
    """The tensors of a checkpoint as another layout names them (`specs`), read one at a time (`read`,
    `items`) from files kept open until `close`. Memory: the tensor being read."""

    def __init__(self, path: str, rename: Callable[[str, tuple], Tuple[str, tuple]],
                 checksums: Optional[Dict[str, Dict[str, str]]] = None):
        self._files: Dict[str, TensorFile] = {}
        self.checksums = checksums or {}  # absolute file -> {tensor: CRC32C}: copies verify against them
        self.by_name: Dict[str, Source] = {}
        for name, fn in weight_files(path).items():
            info = self._open(fn).header[name]
            out, shape = rename(name, tuple(info["shape"]))
            self.by_name[out] = Source(fn, name, TensorSpec(out, info["dtype"], shape))

    def _open(self, fn: str) -> TensorFile:
        if fn not in self._files:
            self._files[fn] = TensorFile(fn)
        return self._files[fn]

    @property
    def specs(self) -> List[TensorSpec]:
        return [s.spec for s in self.by_name.values()]

    def read(self, out_name: str) -> np.ndarray:
        src = self.by_name[out_name]
        return self._open(src.file).read(src.name).reshape(src.spec.shape)

    def span(self, out_name: str) -> FileSpan:
        """Where the bytes of `out_name` are (unchanged by the rename and reshape): a writer copies them."""
        src = self.by_name[out_name]
        span = self._open(src.file).span(src.name)
        span.crc32c = self.checksums.get(os.path.abspath(src.file), {}).get(src.name)
        span.where = f"{src.file}: tensor '{src.name}'"
        return span

    def items(self) -> Iterator[Tuple[str, RawTensor]]:
        """(output name, RawTensor) in file order (each file read front to back)."""
        for out in sorted(self.by_name, key=lambda k: (self.by_name[k].file, self._offset(self.by_name[k]))):
            yield out, RawTensor(self.read(out), self.by_name[out].spec.dtype)

    def _offset(self, src: Source) -> int:
        return self._open(src.file).header[src.name]["data_offsets"][0]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "Sources":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _hf_rename(name: str, shape: tuple) -> Tuple[str, tuple]:
    """HF (file or transformers in-memory) name -> native name; the Conv3d patch embedding flattened."""
    name = normalize_hf_name(name)
    if name == PATCH and len(shape) == 5:
        shape = (shape[0], int(np.prod(shape[1:])))
    return name, shape


def _native_rename(cfg: MindVLConfig) -> Callable[[str, tuple], Tuple[str, tuple]]:
    v = cfg.vision

    def rename(name: str, shape: tuple) -> Tuple[str, tuple]:
        if name == PATCH:
            shape = (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        return name, shape
    return rename


def _keep(name: str, shape: tuple) -> Tuple[str, tuple]:
    return name, shape


def open_sources(path: str, d: dict, to: str, cfg: Optional[MindVLConfig] = None,
                 checksums: Optional[Dict[str, Dict[str, str]]] = None) -> Optional[Sources]:
    """Streamed `Sources` of the checkpoint `path` (config.json `d`) in layout `to` ('native' or 'hf'); None
    for DeepSeek-V3 language models, whose experts are stacked/unstacked across tensors (those go through
    the in-memory `hf_to_native` / `native_to_hf`). `checksums`: what copied spans are verified against."""
    text_only = is_text_only(d)
    if text_only:
        model_type = (d.get("config") or {}).get("model_type") if is_native(d) else d.get("model_type")
    else:
        cfg = cfg or config_from_dir(path)
        model_type = cfg.text.model_type
    if model_type == "deepseek_v3":
        return None
    if is_native(d) == (to == "native"):
        rename = _keep
    elif to == "native":
        rename = (lambda n, s: (normalize_hf_name(n), s)) if text_only else _hf_rename
    else:
        rename = _keep if text_only else _native_rename(cfg)
    return Sources(path, rename, checksums)


# -- checkpoint directories <-> native-named tensors ------------------------------------------------

def open_checkpoint(path: str, cfg: Optional[MindVLConfig] = None):
    """(config, native-named `Sources`) of a native or HF MindVL directory, verified first: what a load
    streams into a model (`pretrained.load_pretrained`). A DeepSeek-V3 language model comes back as a
    dict of tensors read in memory (its experts are restacked)."""
    verify_checkpoint(path)
    d = read_config_json(path)
    cfg = cfg or config_from_dir(path)
    sources = open_sources(path, d, "native", cfg)
    if sources is None:
        tensors = read_tensors(path)
        sources = tensors if is_native(d) else hf_to_native(tensors, cfg)
    return cfg, sources



def write_checkpoint(path: str, cfg: MindVLConfig, tensors: Dict[str, RawTensor], format: str = "native",
                     max_shard_bytes: Optional[int] = DEFAULT_SHARD_BYTES,
                     extra: Optional[Callable[[str], None]] = None) -> None:
    """Atomically write a checkpoint directory in native or HF layout from native-named tensors;
    `extra(tmp_dir)` writes further files (the processor) inside the same atomic directory."""
    if format not in ("native", "hf"):
        raise ValueError(f"format must be 'native' or 'hf', got {format!r}")
    with atomic_dir(path) as tmp:
        if format == "hf":
            write_json(os.path.join(tmp, "config.json"), to_hf_dict(cfg))
            write_tensors(tmp, native_to_hf(tensors, cfg), max_shard_bytes)
        else:
            write_json(os.path.join(tmp, "config.json"), {"format": NATIVE, "config": dataclasses.asdict(cfg)})
            write_tensors(tmp, tensors, max_shard_bytes)
        if extra is not None:
            extra(tmp)


# -- conversions used by the CLI ------------------------------------------------------------------------

def is_text_only(cfg_json: dict) -> bool:
    """An LLM-only checkpoint (HF Qwen2/Qwen3/DeepSeek-V3, or a native text checkpoint)."""
    if is_native(cfg_json):
        return cfg_json.get("kind") == "text"
    return "vision_config" not in cfg_json


def _text_tensors_to_native(tensors: Dict[str, RawTensor], text) -> Dict[str, RawTensor]:
    tensors = {normalize_hf_name(k): v for k, v in tensors.items()}
    if text.model_type == "deepseek_v3":
        tensors = hf_deepseek.hf_to_native(tensors, text)
    return tensors


def _convert_text(src: str, dst: str, to: str, d: dict, max_shard_bytes: Optional[int],
                  extra: Optional[Callable[[str], None]]) -> Dict[str, RawTensor]:
    """Text-only LLM checkpoints: HF <-> native {"kind": "text"} (the HF config.json is kept verbatim)."""
    tensors = read_tensors(src)
    if is_native(d):
        text = load(TextConfig, d["config"], source=os.path.join(src, "config.json"))
        hf_cfg = d.get("hf_config") or {}
    else:
        text = text_from_hf(d)
        hf_cfg = d
        tensors = _text_tensors_to_native(tensors, text)
    with atomic_dir(dst) as tmp:
        if to == "hf":
            out = tensors
            if text.model_type == "deepseek_v3":
                out = hf_deepseek.native_to_hf(tensors, text)
            write_json(os.path.join(tmp, "config.json"), hf_cfg)
            write_tensors(tmp, out, max_shard_bytes)
        else:
            write_json(os.path.join(tmp, "config.json"), {"format": NATIVE, "kind": "text",
                                                          "config": dataclasses.asdict(text), "hf_config": hf_cfg})
            write_tensors(tmp, tensors, max_shard_bytes)
        if extra is not None:
            extra(tmp)
    return tensors


def _converted_config(d: dict, to: str, src: str) -> dict:
    """The config.json of `src` (read as `d`) converted to layout `to`."""
    if is_text_only(d):
        if to == "hf":
            return d.get("hf_config") or {}
        text = text_from_hf(d)
        return {"format": NATIVE, "kind": "text", "config": dataclasses.asdict(text), "hf_config": d}
    cfg = config_from_dir(src)
    return to_hf_dict(cfg) if to == "hf" else {"format": NATIVE, "config": dataclasses.asdict(cfg)}


def convert(src: str, dst: str, to: str, max_shard_bytes: Optional[int] = DEFAULT_SHARD_BYTES,
            extra: Optional[Callable[[str], None]] = None) -> Dict[str, int]:
    """hf -> native (to='native') or native -> hf (to='hf'), tensors copied bit-exactly, in shards of at most
    `max_shard_bytes` (None: one file) with Hugging Face's index. Works for MindVL (Qwen2.5-VL layout) and
    for text-only Qwen2/Qwen3/DeepSeek-V3 checkpoints. `src` is verified first; `extra(tmp_dir)` writes
    further files (the processor) into the output before its checksums.

    Streamed: the output headers come from the input headers (renames and the patch embedding's reshape
    need no data), then each tensor's bytes are copied once through two 8 MB buffers (one written by a
    background thread while the next is read: `io.Copier`), checked against the
    input's per-tensor checksums and checksummed for the output's manifest on the way, so the input is
    read once, the output never read back, and memory stays two buffers whatever the checkpoint's size.
    DeepSeek-V3 language models, whose experts are restacked, are converted in memory."""
    manifest = verify_except_tensors(src)  # the tensor bytes are verified as they are copied
    d = read_config_json(src)
    if is_native(d) == (to == "native"):
        raise ValueError(f"{src} is already a {'native' if is_native(d) else 'Hugging Face'} checkpoint")
    sources = open_sources(src, d, to, checksums=tensor_checksums(src, manifest))
    if sources is None:
        verify_checkpoint(src)
        return _convert_in_memory(src, dst, to, d, max_shard_bytes, extra)
    with sources, atomic_dir(dst) as tmp:
        write_json(os.path.join(tmp, "config.json"), _converted_config(d, to, src))
        write_sharded(tmp, sources.specs, sources.span, max_shard_bytes)
        if extra is not None:
            extra(tmp)
    specs = sources.specs
    return {"tensors": len(specs), "parameters": int(sum(np.prod(s.shape, dtype=np.int64) for s in specs))}


def _convert_in_memory(src: str, dst: str, to: str, d: dict, max_shard_bytes: Optional[int],
                       extra: Optional[Callable[[str], None]]) -> Dict[str, int]:
    """`convert` of DeepSeek-V3 language models (experts stacked/unstacked across tensors)."""
    if is_text_only(d):
        tensors = _convert_text(src, dst, to, d, max_shard_bytes, extra)
    else:
        cfg = config_from_dir(src)
        tensors = read_tensors(src)
        if not is_native(d):
            tensors = hf_to_native(tensors, cfg)
        write_checkpoint(dst, cfg, tensors, format=to, max_shard_bytes=max_shard_bytes, extra=extra)
    return {"tensors": len(tensors), "parameters": int(sum(np.prod(t.shape) for t in tensors.values()))}


# -- what checkpoint/pretrained.py builds models from ---------------------------------------------------

def read_text_checkpoint(path: str) -> Tuple[TextConfig, Dict[str, RawTensor]]:
    """(text config, native-named tensors) of a text-only LLM checkpoint, HF or native, verified first."""
    verify_checkpoint(path)
    d = read_config_json(path)
    if is_native(d):
        text = load(TextConfig, d["config"], source=os.path.join(path, "config.json"))
        return text, read_tensors(path)
    text = text_from_hf(d)
    return text, _text_tensors_to_native(read_tensors(path), text)


def init_sources(vision_from: str, llm_from: str):
    """The pieces of the MindVL initialisation (`pretrained.init_from_pretrained`): the combined config,
    the vision tower's tensors (`visual.*` without the projector `visual.merger.*`) and the language
    model's (`model.*`, `lm_head.*`), native-named. Returns (config, vision tensors, LLM tensors)."""
    verify_checkpoint(vision_from)
    if os.path.abspath(llm_from) != os.path.abspath(vision_from):
        verify_checkpoint(llm_from)
    vd, ld = read_config_json(vision_from), read_config_json(llm_from)
    vision = config_from_dir(vision_from).vision if is_native(vd) else vision_from_hf(vd.get("vision_config") or vd)
    if is_native(ld):
        text = load(TextConfig, ld["config"]) if ld.get("kind") == "text" else config_from_dir(llm_from).text
    else:
        text = text_from_hf(ld)
    vision.out_hidden_size = text.hidden_size
    cfg = MindVLConfig(vision=vision, text=text)
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        if k in vd:
            setattr(cfg, k, vd[k])
    cfg.validate()
    vt = read_tensors(vision_from)
    if not is_native(vd):
        vt = hf_to_native(vt, from_hf_dict(vd))
    vt = {k: v for k, v in vt.items() if is_vision_tower(k)}
    lt = read_tensors(llm_from)
    if not is_native(ld):
        lt = _text_tensors_to_native(lt, text)
    lt = {k: v for k, v in lt.items() if re.match(r"^(model\.|lm_head\.)", k)}
    return cfg, vt, lt


def is_vision_tower(name: str) -> bool:
    """A vision-encoder parameter other than the projector (`visual.merger.*`)."""
    return name.startswith("visual.") and not name.startswith("visual.merger.")
