"""The demo's evaluation phase: `eval.benchmark.evaluate` (batched greedy generation through
`mindvl_ms.infer.generate`) on each task's held-out split for the SFT variants and the merged checkpoint,
`eval.resolution_search.search` on the OCR split of the merged checkpoint, and easy-VQA's exact match
per question type."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import numpy as np

from mindvl_ms.checkpoint.hf import Sources, open_checkpoint
from mindvl_ms.checkpoint.pretrained import stream_into
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.eval.benchmark import evaluate
from mindvl_ms.eval.resolution_search import search
from mindvl_ms.infer.generate import EvalBackend, get_engine, load_model
from mindvl_ms.recipes.demo.processes import child_setup
from mindvl_ms.recipes.demo.vqa_data import VQA_TYPES, vqa_type


_BACKENDS: Dict[str, Any] = {}


def stream_checkpoint(model, ckpt: str) -> bool:
    """ckpt's weights into `model`, tensor by tensor, when ckpt's model config is the model's; else False
    (nothing loaded). The graphs compiled on the model (vision, prefill, decode) then run the new weights."""
    cfg, sources = open_checkpoint(ckpt)
    try:
        if cfg != model.config:
            return False
        stream_into(model, sources)
        get_engine(model).image_cache.clear()  # image features computed with the previous weights
        return True
    finally:
        if isinstance(sources, Sources):
            sources.close()


def eval_backend(ckpt: str, data_cfg, max_new_tokens: int):
    """The generation backend of `mindvl eval` for ckpt, with the processor the demo trained with (no system
    turn), kept per checkpoint in this process (its compiled graphs serve the evaluation, the resolution
    search and the rollout). A checkpoint not kept yet takes over the model of a kept one with the same model
    config (the SFT variants and their merge all have one): its weights are streamed in, so the graphs
    compiled on that model serve it too (three graph compiles fewer per checkpoint), and the other
    checkpoint is no longer kept (the model no longer holds its weights)."""
    key = os.path.abspath(ckpt)
    if key not in _BACKENDS:
        model = None
        for kept, backend in list(_BACKENDS.items()):
            if stream_checkpoint(backend.model, ckpt):
                model = _BACKENDS.pop(kept).model
                break
        _BACKENDS[key] = EvalBackend(model if model is not None else load_model(ckpt),
                                     MindVLProcessor(config=data_cfg), max_new_tokens)
    return _BACKENDS[key]


def cached_backend(ckpt: str):
    """The backend `eval_backend` built for ckpt in this process (its graphs compiled), or None; builds nothing."""
    return _BACKENDS.get(os.path.abspath(ckpt))


def evaluate_all(ckpts: Dict[str, str], heldout: Dict[str, str], data_cfg, demo: Dict[str, Any],
                 out_dir: str, progress: bool = True,
                 answers: Optional[Dict[str, dict]] = None) -> Dict[str, Dict[str, float]]:
    """{checkpoint name: {task: primary score}} on every held-out split. `answers`, if given, receives each
    checkpoint's generated answers ({name: `benchmark.predict`'s pred_cache}) for the resolution search."""
    scores: Dict[str, Dict[str, float]] = {}
    img = data_cfg.image
    for name, ckpt in ckpts.items():
        backend = eval_backend(ckpt, data_cfg, int(demo.get("max_new_tokens", 24)))
        scores[name] = {}
        cache = {} if answers is None else answers.setdefault(name, {})
        for task, path in heldout.items():
            res = evaluate(ckpt, path, os.path.join(out_dir, name, task), backend=backend,
                           min_pixels=img.min_pixels, max_pixels=img.max_pixels,
                           batch_size=int(demo.get("eval_batch_size", 16)),
                           max_new_tokens=int(demo.get("max_new_tokens", 24)), progress=progress,
                           pred_cache=cache)
            scores[name][task] = res["tasks"][task]["primary"]
    return scores


def resolution_search(ckpt: str, data: str, data_cfg, demo: Dict[str, Any], out_dir: str,
                      progress: bool = True, answers: Optional[dict] = None) -> Dict[str, Any]:
    """`eval.resolution_search.search` of ckpt on one split over `demo.resolution_grid` (units of 28x28
    pixels), through the same backend as the evaluation: the best setting and every setting's score.
    `answers`: the evaluation's answers of ckpt (`evaluate_all`), reused where a setting resizes the split's
    images as the evaluation did (the evaluation's own setting is in the default grid)."""
    grid = demo.get("resolution_grid") or {"min": [4, 16], "max": [8, 16, 32]}
    res = search([ckpt], [data], out_dir, backend_factory=lambda c: eval_backend(c, data_cfg, int(
        demo.get("max_new_tokens", 24))), min_grid=grid["min"], max_grid=grid["max"],
        batch_size=int(demo.get("eval_batch_size", 16)), max_new_tokens=int(demo.get("max_new_tokens", 24)),
        progress=progress, pred_caches={ckpt: answers or {}})
    best = res["best"][ckpt]["average"]
    return {"settings": len(res["rows"]), "best_min_pixels": best["min_pixels"],
            "best_max_pixels": best["max_pixels"], "best_score": best["score"],
            "scores": [(r["min_pixels"], r["max_pixels"], r["average"]) for r in res["rows"]],
            "table": os.path.join(out_dir, "resolution_table.md"), "plot": res.get("plot"),
            "caching": res["caching"][ckpt]}


def evaluate_phase(ckpts: Dict[str, str], heldout: Dict[str, str], data_cfg, demo: Dict[str, Any], out_dir: str,
                   progress: bool = True):
    """Held-out scores of every checkpoint, then the resolution search on the OCR split of `merged`."""
    child_setup()
    answers: Dict[str, dict] = {}
    scores = evaluate_all(ckpts, heldout, data_cfg, demo, os.path.join(out_dir, "eval"), progress, answers)
    found = resolution_search(ckpts["merged"], heldout["ocr"], data_cfg, demo,
                              os.path.join(out_dir, "resolution_search"), progress, answers["merged"])
    return scores, found


def vqa_scores_by_type(predictions: str) -> Dict[str, float]:
    """Exact match per easy-VQA question type (yes/no, colour, shape) from an eval predictions.jsonl."""
    by: Dict[str, List[float]] = {t: [] for t in VQA_TYPES}
    with open(predictions, encoding="utf-8") as f:
        for line in f:
            p = json.loads(line)
            by[vqa_type(p)].append(float(p["score"]))
    return {t: float(np.mean(v)) if v else float("nan") for t, v in by.items()}
