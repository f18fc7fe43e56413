"""Models <-> checkpoint directories: build a model from a checkpoint, fill one, write one.

    model = load_pretrained(MindVLModel, path)             # native or HF Qwen2.5-VL directory, sharded too
    save_pretrained(model, out, format="hf")               # or "native"
    load_into(model, tensors)                              # native-named RawTensors into the parameters
    init_from_pretrained(MindVLModel, vit_dir, llm_dir, out)   # the MindVL initialisation

The model class is the caller's (`load_pretrained`, `init_from_pretrained` take it as their first
argument): this layer knows checkpoint layouts, not which Cell a command wants, so the trainer builds the
plain `models.mindvl.MindVLModel` and the Hugging-Face-style API builds its subclass
(`infer.hf_api.MindVLForConditionalGeneration`) through the same functions. Text-only LLMs
(`load_text_model`) pick their class from the checkpoint's model_type. Name and layout mapping lives in
`checkpoint/hf.py`, which needs no MindSpore. Loads verify the directory's checksums and saves write them
(`checkpoint/integrity.py`).
"""
from typing import Callable, Dict, Optional, Tuple, Union

import numpy as np

import mindspore as ms
from mindspore.nn.utils import no_init_parameters

from mindvl_ms.config import MindVLConfig
from mindvl_ms.checkpoint.hf import Sources, init_sources, is_vision_tower, open_checkpoint, read_text_checkpoint, \
    write_checkpoint
from mindvl_ms.checkpoint.io import RawTensor, to_bf16_bits
from mindvl_ms.models.moe import DeepseekV3ForCausalLM
from mindvl_ms.models.text import TextForCausalLM

_NUMPY = {ms.float32: np.float32, ms.float16: np.float16, ms.float64: np.float64, ms.int32: np.int32,
          ms.int64: np.int64}  # parameter dtype -> numpy dtype, without a deprecated call per parameter
TEXT_MODELS = {"deepseek_v3": DeepseekV3ForCausalLM}  # any other model_type: TextForCausalLM (Qwen2/Qwen3)


def model_tensors(model, dtype: Optional[str] = None) -> Dict[str, RawTensor]:
    """Parameters of a MindSpore model as RawTensors (fp32 unless `dtype` is F16/BF16)."""
    out = {}
    for name, p in model.parameters_and_names():
        arr = p.asnumpy()
        if dtype == "BF16":
            out[name] = RawTensor(to_bf16_bits(arr.astype(np.float32)), "BF16")
        elif dtype == "F16":
            out[name] = RawTensor.of(arr.astype(np.float16))
        else:
            out[name] = RawTensor.of(arr)
    return out


def _check(params: Dict[str, object], shapes: Dict[str, tuple], strict: bool) -> Tuple[list, list]:
    """(missing, unexpected) names; a shape mismatch, or (if strict) any missing or unexpected name, is a
    ValueError listing them."""
    missing = sorted(set(params) - set(shapes))
    unexpected = sorted(set(shapes) - set(params))
    bad = [f"{k}: checkpoint {list(shapes[k])} vs model {list(params[k].shape)}"
           for k in sorted(set(params) & set(shapes)) if tuple(shapes[k]) != tuple(params[k].shape)]
    if bad:
        raise ValueError("shape mismatch:\n  " + "\n  ".join(bad))
    if strict and (missing or unexpected):
        raise ValueError(f"checkpoint does not match the model: missing {missing[:20]}"
                         f"{' ...' if len(missing) > 20 else ''}; unexpected {unexpected[:20]}"
                         f"{' ...' if len(unexpected) > 20 else ''}")
    return missing, unexpected


def cast_for(t: RawTensor, dtype, owned: bool) -> np.ndarray:
    """A tensor's values as a C-contiguous numpy array of `dtype`, made with one allocation at most: bf16
    bits are widened in place of their uint32 copy, and an `owned` array (a fresh read nobody else holds)
    already of `dtype` is returned as is. Nothing passes through float64."""
    dtype = np.dtype(dtype)
    if t.dtype == "BF16":
        wide = t.data.astype(np.uint32)
        wide <<= 16
        out = wide.view(np.float32)
        return out if dtype == np.float32 else out.astype(dtype)
    if owned and t.data.dtype == dtype and t.data.flags.c_contiguous:
        return t.data
    return np.array(t.data, dtype=dtype, order="C")


def place(param, t: RawTensor, owned: bool = False) -> None:
    """Set one parameter from one tensor, cast to the parameter's dtype. The parameter takes the cast
    array's memory (`Tensor.from_numpy`), so a tensor exists once: read, cast, placed."""
    np_dtype = _NUMPY.get(param.dtype) or ms.dtype_to_nptype(param.dtype)
    param.set_data(ms.Tensor.from_numpy(cast_for(t, np_dtype, owned)))


def load_into(model, tensors: Dict[str, RawTensor], strict: bool = True,
              prefix_filter: Optional[Callable[[str], bool]] = None) -> Dict[str, list]:
    """Copy tensors into the model's parameters by name; shape mismatches and (if strict) missing or
    unexpected names are a ValueError listing them. Returns {"missing": [...], "unexpected": [...]}."""
    params = dict(model.parameters_and_names())
    if prefix_filter is not None:
        params = {k: v for k, v in params.items() if prefix_filter(k)}
        tensors = {k: v for k, v in tensors.items() if prefix_filter(k)}
    missing, unexpected = _check(params, {k: tuple(t.shape) for k, t in tensors.items()}, strict)
    for k in sorted(set(params) & set(tensors)):
        place(params[k], tensors[k])
    return {"missing": missing, "unexpected": unexpected}


def stream_into(model, sources: Union[Sources, Dict[str, RawTensor]]) -> None:
    """Fill every parameter of `model` from a checkpoint's `Sources` (or a dict), strictly, reading,
    casting and placing one tensor at a time: the peak is the model plus about one tensor."""
    if isinstance(sources, dict):
        load_into(model, sources)
        return
    params = dict(model.parameters_and_names())
    _check(params, {s.name: tuple(s.shape) for s in sources.specs}, strict=True)
    for name, t in sources.items():
        place(params[name], t, owned=True)
        del t


def build_unfilled(cls, cfg: MindVLConfig):
    """`cls(cfg)` whose parameters hold no values yet (MindSpore's `no_init_parameters`): a model that a
    checkpoint is about to fill skips drawing random weights it would throw away, which costs time
    and a second full copy of the model while the checkpoint's values are placed. Every parameter must
    then be set (`stream_into`, strict)."""
    with no_init_parameters():
        return cls(cfg)


def load_pretrained(cls, path: str, config: Optional[MindVLConfig] = None, dtype=None):
    """`cls(config)` with the weights of a native or HF directory (`config` defaults to the directory's),
    streamed tensor by tensor into a model built without random weights (peak memory: docs/PERFORMANCE.md,
    ## checkpoint). `dtype` (e.g. ms.float16): every parameter in that dtype, each tensor cast to it on
    its way in (no float32 copy of the model)."""
    cfg, sources = open_checkpoint(path, config)
    try:
        model = build_unfilled(cls, cfg)
        if dtype is not None:
            for p in model.get_parameters():
                p.set_dtype(dtype)
        stream_into(model, sources)
    finally:
        if isinstance(sources, Sources):
            sources.close()
    return model


def save_pretrained(model, path: str, format: str = "native", max_shard_bytes: Optional[int] = None,
                    extra: Optional[Callable[[str], None]] = None) -> None:
    """config.json + safetensors of `model` (its `.config`), written atomically with their checksums;
    format 'hf' writes transformers' layout; `extra(tmp_dir)` adds files (the processor) before the checksums."""
    write_checkpoint(path, model.config, model_tensors(model), format, max_shard_bytes, extra)


def load_text_model(path: str):
    """A text-only causal LM (TextForCausalLM or DeepseekV3ForCausalLM) from an HF or native text checkpoint."""
    text, tensors = read_text_checkpoint(path)
    model = TEXT_MODELS.get(text.model_type, TextForCausalLM)(text)
    load_into(model, tensors)
    return model


def init_from_pretrained(cls, vision_from: str, llm_from: str, out: str, seed: int = 0,
                         extra: Optional[Callable[[str], None]] = None) -> MindVLConfig:
    """The MindVL initialisation: ViT from a Qwen2.5-VL checkpoint, LLM from a Qwen3 (or Qwen2/DeepSeek-V3)
    checkpoint, projector (`visual.merger.*`) freshly initialised (from `seed`) in a `cls(config)`. Writes
    a native checkpoint to `out` (`extra(tmp_dir)` as in `save_pretrained`); returns its config."""
    cfg, vt, lt = init_sources(vision_from, llm_from)
    ms.set_seed(seed)
    model = cls(cfg)
    load_into(model, vt, strict=False, prefix_filter=is_vision_tower)
    load_into(model, lt, strict=False, prefix_filter=lambda k: not k.startswith("visual."))
    missing = [k for k, _ in model.parameters_and_names()
               if not k.startswith("visual.merger.") and k not in vt and k not in lt]
    if missing:
        raise ValueError(f"init: parameters found in neither checkpoint: {missing[:20]}")
    save_pretrained(model, out, extra=extra)
    return cfg
