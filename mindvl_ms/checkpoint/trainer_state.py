"""Training checkpoints: model weights + optimizer + LR/step + RNG + data-loader state, written atomically.

Layout of OUT/<stage>/checkpoint-<step>/ (docs/CHECKPOINTS.md):
    config.json             native model config (when the model has a `.config`)
    model.safetensors       weights, through `checkpoint.io` (HF Qwen2.5-VL parameter names)
    tokenizer files, preprocessor_config.json, chat_template.json   the stage's processor (written by
                            `extra`, see data/processor_files.py)
    optimizer.safetensors   AdamW moments, step, loss scale (fp32/int32, bit-exact round trip)
    trainer_state.json      stage index/name, step, total steps, consumed rows/tokens, data-loader
                            state, numpy/python RNG state, non-finite counters, metrics position
    checksums.json          CRC32C of every file above (and of each tensor), verified on resume
                            (`integrity.py`)
and OUT/latest.json names the newest complete checkpoint.

Atomicity: the directory is written under a temporary name and renamed into place
(`integrity.atomic_dir`), then `latest.json` is replaced with `os.replace`. A kill at any moment leaves
either the previous `latest.json` (pointing at a complete checkpoint) or the new one; leftover
temporary directories are ignored by `find_latest` and removed by `clean_partial`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from typing import Any, Dict, Optional

import numpy as np

from mindvl_ms.checkpoint.hf import NATIVE
from mindvl_ms.checkpoint.integrity import atomic_dir, verify_checkpoint
from mindvl_ms.checkpoint.io import OPTIM, STATE, RawTensor, read_file, read_tensors, write_file, write_json, \
    write_tensors
from mindvl_ms.checkpoint.pretrained import model_tensors

LATEST = "latest.json"


def rng_state() -> Dict[str, Any]:
    """numpy global and python `random` states as JSON."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    py = random.getstate()
    return {"numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            "python": [py[0], list(py[1]), py[2]]}


def set_rng_state(s: Dict[str, Any]) -> None:
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, np.array(keys, np.uint32), pos, has_gauss, gauss))
    v, st, g = s["python"]
    random.setstate((v, tuple(st), g))


def save_checkpoint(path: str, model, optim_params: Dict[str, Any], state: Dict[str, Any],
                    out_dir: Optional[str] = None, extra=None) -> str:
    """Write a complete checkpoint directory atomically; then point OUT/latest.json at it.
    `extra(tmp_dir)` writes further files (the processor) inside the same atomic directory."""
    with atomic_dir(path) as tmp:
        cfg = getattr(model, "config", None)
        if cfg is not None and dataclasses.is_dataclass(cfg):
            write_json(os.path.join(tmp, "config.json"), {"format": NATIVE, "config": dataclasses.asdict(cfg)})
        write_tensors(tmp, model_tensors(model))
        write_file(os.path.join(tmp, OPTIM), {k: RawTensor.of(np.asarray(p.asnumpy())) for k, p in optim_params.items()},
                   {"format": "mindvl-optimizer"})
        write_json(os.path.join(tmp, STATE), {**state, "rng": rng_state()})
        if extra is not None:
            extra(tmp)
    if out_dir is not None:
        write_latest(out_dir, path, state)
    return path


def write_latest(out_dir: str, path: str, state: Dict[str, Any]) -> None:
    tmp = os.path.join(out_dir, f".{LATEST}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"path": os.path.relpath(path, out_dir), "stage_index": state.get("stage_index"),
                   "stage": state.get("stage"), "step": state.get("step"),
                   "stage_done": state.get("stage_done", False)}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out_dir, LATEST))


def is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in (STATE, OPTIM)) and (
        os.path.isfile(os.path.join(path, "model.safetensors")) or
        os.path.isfile(os.path.join(path, "model.safetensors.index.json")))


def find_latest(resume: str) -> str:
    """`resume` is a run directory (uses latest.json) or a checkpoint directory; returns the checkpoint."""
    if os.path.isfile(os.path.join(resume, STATE)):
        path = resume
    else:
        latest = os.path.join(resume, LATEST)
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"--resume {resume}: neither a checkpoint (no {STATE}) nor a run directory "
                                    f"(no {LATEST})")
        with open(latest, encoding="utf-8") as f:
            path = os.path.join(resume, json.load(f)["path"])
    if not is_complete(path):
        raise FileNotFoundError(f"--resume: checkpoint {path} is incomplete (missing {STATE}, {OPTIM} or weights)")
    return path


def load_checkpoint(path: str):
    """(state dict, model tensors {name: RawTensor}, optimizer arrays {name: np.ndarray}); every file is
    verified against the checkpoint's checksums first (`integrity.verify_checkpoint`)."""
    verify_checkpoint(path, model_only=False)
    with open(os.path.join(path, STATE), encoding="utf-8") as f:
        try:
            state = json.load(f)
        except ValueError as e:
            raise ValueError(f"{os.path.join(path, STATE)}: not valid JSON ({e}); resume from an earlier "
                             f"checkpoint directory") from None
    tensors = read_tensors(path)
    optim = {k: v.data for k, v in read_file(os.path.join(path, OPTIM)).items()}
    return state, tensors, optim


def clean_partial(directory: str) -> int:
    """Remove temporary directories left by an interrupted save; returns how many were removed."""
    n = 0
    if not os.path.isdir(directory):
        return 0
    for name in os.listdir(directory):
        if name.startswith(".") and ".tmp-" in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            n += 1
    return n


def prune(stage_dir: str, keep_last: int, protect: str = "") -> None:
    """Keep the newest `keep_last` checkpoints of a stage (plus `protect`). A pruned checkpoint is renamed
    to a temporary name first and deleted after, so a crash in the middle of the deletion leaves no
    half-deleted `checkpoint-*` directory, only a temporary one that `clean_partial` removes."""
    cks = sorted(d for d in os.listdir(stage_dir) if d.startswith("checkpoint-"))
    for d in cks[:-keep_last]:
        full = os.path.join(stage_dir, d)
        if os.path.abspath(full) != os.path.abspath(protect):
            doomed = os.path.join(stage_dir, f".{d}.tmp-pruned")
            shutil.rmtree(doomed, ignore_errors=True)  # a leftover of an earlier interrupted prune
            os.replace(full, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
