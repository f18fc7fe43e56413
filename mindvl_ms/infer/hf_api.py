"""`MindVLForConditionalGeneration`: the MindVL Cell with Hugging Face style loading, saving and calls.

    model = MindVLForConditionalGeneration.from_pretrained(path)   # native or HF Qwen2.5-VL directory
    inputs = processor(messages=[...], images=[...])        # input_ids [B, L], attention_mask, pixel_values,
    out = model(**inputs)                                    #   image_grid_thw, labels (numpy or MindSpore)
    out.logits        # float32 [B, L, V], aligned with input_ids (zeros at padding)
    out.loss          # [] mean next-token cross entropy over labels != -100 (None without labels)
    ids = model.generate(**inputs, max_new_tokens=32, do_sample=False)   # int64 numpy [B, L + new]
    model.save_pretrained(out_dir, format="hf")              # or "native"

Design: a subclass of the pure Cell `models.mindvl.MindVLModel` (same parameters, same compiled
`construct`), and a thin layer over its positional path, not a second implementation. Keyword arrays are
turned into one sample per row (the attention mask picks the row's tokens, so left or right padding both
work; images are assigned to rows in order, as transformers concatenates them) and handed to the
host-side `build_model_inputs`; the compiled `construct` runs on its INPUT_NAMES arrays; the loss is the
trainer's token-mean `TrainLoss` on the builder's next-token targets (the same shift as transformers: the
label of position t+1 is the target of position t, never across rows). `generate` calls
`mindvl_ms.infer.generate.generate` (KV-cache engine) with the same samples and returns prompt + new
tokens per row, padded on the right with `pad_token_id` as transformers does. Loading and saving are
`checkpoint.pretrained`'s, with this class as the one to build.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

import mindspore as ms
from mindspore import Tensor

from mindvl_ms.config import MindVLConfig
from mindvl_ms.checkpoint.pretrained import load_pretrained, save_pretrained
from mindvl_ms.data.collate import INPUT_NAMES, build_model_inputs, model_args
from mindvl_ms.infer.generate import generate as generate_ids
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.train.loss import TrainLoss

KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "labels")


@dataclass
class MindVLOutput:
    """What `model(**inputs)` returns (attribute or key access, like transformers' ModelOutput)."""

    logits: Any                      # Tensor float32 [B, L, V]
    loss: Any = None                 # Tensor [] when labels were given
    aux_loss: Any = None             # Tensor [] (MoE auxiliary loss, 0 for dense models)
    expert_load: Any = None          # Tensor [layers, E]

    def __getitem__(self, key: str):
        return getattr(self, key)

    def keys(self) -> List[str]:
        return [k for k in ("loss", "logits", "aux_loss", "expert_load") if getattr(self, k) is not None]


def to_numpy(x) -> Optional[np.ndarray]:
    """numpy, MindSpore Tensor, torch tensor or nested lists -> numpy (None stays None)."""
    if x is None:
        return None
    if hasattr(x, "asnumpy"):
        return x.asnumpy()
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _image_runs(ids: np.ndarray, image_token_id: int) -> int:
    """Number of contiguous <|image_pad|> runs (one per image) in a row."""
    is_img = ids == image_token_id
    return int(np.sum(is_img[1:] & ~is_img[:-1]) + (1 if is_img.size and is_img[0] else 0))


def split_rows(config, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
               labels=None) -> List[Dict[str, np.ndarray]]:
    """Keyword batch -> one sample dict per row (tokens where attention_mask != 0, the row's images)."""
    ids = to_numpy(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {ids.shape}")
    mask = np.ones_like(ids) if attention_mask is None else to_numpy(attention_mask).reshape(ids.shape)
    lab = None if labels is None else to_numpy(labels).reshape(ids.shape)
    pv, grid = to_numpy(pixel_values), to_numpy(image_grid_thw)
    if (pv is None) != (grid is None):
        raise ValueError("pixel_values and image_grid_thw must be given together")
    grid = None if grid is None else grid.reshape(-1, 3).astype(np.int64)
    patch_start = np.concatenate([[0], np.cumsum(grid.prod(axis=1))]) if grid is not None else None
    rows, img = [], 0
    for r in range(ids.shape[0]):
        keep = mask[r] != 0
        s: Dict[str, np.ndarray] = {"input_ids": ids[r][keep].astype(np.int64)}
        if lab is not None:
            s["labels"] = lab[r][keep].astype(np.int64)
        n_img = _image_runs(s["input_ids"], config.image_token_id)
        if n_img:
            if grid is None or img + n_img > len(grid):
                raise ValueError(f"row {r} holds {n_img} image(s) but only {0 if grid is None else len(grid) - img} "
                                 "image_grid_thw entries are left")
            s["image_grid_thw"] = grid[img:img + n_img]
            s["pixel_values"] = pv[patch_start[img]:patch_start[img + n_img]]
            img += n_img
        rows.append(s)
    if grid is not None and img != len(grid):
        raise ValueError(f"{len(grid)} images given but the rows hold {img} image placeholders")
    return rows


def _positions(mask: np.ndarray) -> List[np.ndarray]:
    return [np.flatnonzero(m != 0) for m in mask]


_TOKEN_MEAN: Dict[tuple, TrainLoss] = {}  # (logits dtype, id dtypes) -> the keyword call's loss, any shape


def _token_mean(logits: Tensor, ids: List[Tensor]) -> TrainLoss:
    """The token-mean loss Cell for these dtypes, with dynamic input shapes: one graph compile per process for
    every batch and length (a new Cell per call would compile on every call)."""
    key = (logits.dtype,) + tuple(t.dtype for t in ids)
    if key not in _TOKEN_MEAN:
        loss = TrainLoss("token_mean")
        scalar = Tensor(shape=[], dtype=ms.float32)
        loss.set_inputs(Tensor(shape=[None, None, None], dtype=logits.dtype),
                        *[Tensor(shape=[None, None], dtype=t.dtype) for t in ids], scalar, scalar)
        _TOKEN_MEAN[key] = loss
    return _TOKEN_MEAN[key]


def forward(model, input_ids=None, attention_mask=None, pixel_values=None, image_grid_thw=None, labels=None,
            **unknown) -> MindVLOutput:
    """`model(**inputs)`; see the module docstring."""
    if unknown:
        raise TypeError(f"MindVL keyword call: unknown argument(s) {sorted(unknown)}; takes {', '.join(KEYS)}")
    if input_ids is None:
        raise TypeError("MindVL keyword call needs input_ids")
    if tuple(model.INPUT_NAMES) != INPUT_NAMES:
        raise TypeError(f"{type(model).__name__} takes {model.INPUT_NAMES} positionally; keyword calls need the "
                        "MindVLModel input layout (data.collate.INPUT_NAMES)")
    rows = split_rows(model.config, input_ids, attention_mask, pixel_values, image_grid_thw, labels)
    shape = to_numpy(input_ids).reshape(len(rows), -1).shape
    batch = build_model_inputs([[s] for s in rows], model.config, pad_to=shape[1])
    if getattr(model, "_dynamic_shape_inputs", None) is None:
        model.set_dynamic_inputs()  # one compile for every length and image size
    logits, aux_loss, expert_load = model(*model_args(batch))  # [B, L, V], builder layout (tokens first)
    loss = None
    if labels is not None:
        sup = float((batch["targets"] != -100).sum())
        ids = [Tensor(batch[k]) for k in ("targets", "segment_ids", "token_index")]
        loss = _token_mean(logits, ids)(logits, *ids, Tensor(sup, ms.float32),
                                        Tensor(float(batch["num_samples"]), ms.float32))
    mask = np.ones(shape, np.int64) if attention_mask is None else to_numpy(attention_mask).reshape(shape)
    pos = _positions(mask)
    if any(not np.array_equal(p, np.arange(p.size)) for p in pos):  # left/inner padding: back to input columns
        src = logits.asnumpy()
        out = np.zeros_like(src)
        for r, p in enumerate(pos):
            out[r, p] = src[r, :p.size]
        logits = Tensor(out)
    return MindVLOutput(logits=logits, loss=loss, aux_loss=aux_loss, expert_load=expert_load)


def generate(model, input_ids=None, attention_mask=None, pixel_values=None, image_grid_thw=None, labels=None,
             max_new_tokens: int = 32, do_sample: bool = False, eos_token_id=None, pad_token_id: Optional[int] = None,
             **sampling) -> np.ndarray:
    """`model.generate(**inputs, ...)` -> int64 [B, L + n]: the prompt columns as given, then the new tokens,
    right-padded with pad_token_id (default: the first eos id, else 0). `labels` (a processor output) are
    not used. Further options are those of `mindvl_ms.infer.generate.generate` (temperature, top_k, top_p,
    repetition_penalty, seed, use_cache, ...)."""
    if input_ids is None:
        raise TypeError("generate needs input_ids")
    rows = split_rows(model.config, input_ids, attention_mask, pixel_values, image_grid_thw, None)
    eos = () if eos_token_id is None else tuple(int(i) for i in np.atleast_1d(eos_token_id))
    new = generate_ids(model, rows, max_new_tokens, do_sample=do_sample, eos_token_ids=eos, **sampling)
    prompt = to_numpy(input_ids).reshape(len(rows), -1).astype(np.int64)
    width = max((len(t) for t in new), default=0)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    tail = np.full((len(rows), width), pad, np.int64)
    for r, t in enumerate(new):
        tail[r, :len(t)] = t
    return np.concatenate([prompt, tail], axis=1)


class MindVLForConditionalGeneration(MindVLModel):
    """`MindVLModel` with from_pretrained / save_pretrained, `model(**inputs)` and `model.generate(**inputs)`."""

    def __call__(self, *args, **kwargs):
        """Positional INPUT_NAMES arrays: the compiled graph, returning (logits, aux_loss, expert_load).
        Keywords only, as a processor returns them (`model(**inputs)`): a MindVLOutput with .logits and,
        given labels, .loss, computed through that same positional path."""
        if kwargs and not args:
            return forward(self, **kwargs)
        return super().__call__(*args, **kwargs)

    def generate(self, **inputs) -> np.ndarray:
        """`model.generate(**processor_outputs, max_new_tokens=..., do_sample=...)` -> token ids [B, L + n]
        (prompt then new tokens), through mindvl_ms.infer.generate's KV-cache engine."""
        return generate(self, **inputs)

    @classmethod
    def from_pretrained(cls, path: str, config: Optional[MindVLConfig] = None) -> "MindVLForConditionalGeneration":
        """Load a native or Hugging Face Qwen2.5-VL directory (config.json + safetensors, sharded too)."""
        return load_pretrained(cls, path, config)

    def save_pretrained(self, path: str, format: str = "native", max_shard_bytes: Optional[int] = None) -> None:
        """Write config.json + safetensors; format 'hf' writes transformers' Qwen2.5-VL layout."""
        save_pretrained(self, path, format=format, max_shard_bytes=max_shard_bytes)
