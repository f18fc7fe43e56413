"""The phases of `mindvl demo --post-train` (`post.run_post_train`), each run in its own process
(`processes.in_child`; in the calling one with `demo.phase_processes: false`): the rollout that makes the
preference pairs, the DPO -> GRPO training chain, and the held-out grounding evaluation with the figures
GRPO's IoU reward speaks to."""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from mindvl_ms.data.grounding import box_iou
from mindvl_ms.data.preference import read_post_file
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.eval.benchmark import evaluate
from mindvl_ms.eval.metrics import parse_box
from mindvl_ms.infer.rollout import EngineSampler, rollout_pairs, write_pairs
from mindvl_ms.recipes.demo.evaluation import cached_backend, eval_backend
from mindvl_ms.recipes.demo.processes import child_setup
from mindvl_ms.train import run_training
from mindvl_ms.train.post.rewards import Verifier

log = logging.getLogger(__name__)


def rollout_phase(ckpt: str, prompts: str, out: str, data_cfg, ro: Dict[str, Any], seed: int,
                  progress: bool) -> Dict[str, Any]:
    """`mindvl rollout` on the prompts with the processor the demo trained with; writes the pairs. The model
    is the demo evaluation's of ckpt (`evaluation.eval_backend`, cached per checkpoint): in a process that
    evaluated ckpt already its compiled graphs serve the rollout (the rollout only reads the weights)."""
    child_setup()
    proc = MindVLProcessor(config=data_cfg)
    model = eval_backend(ckpt, data_cfg, int(ro.get("max_new_tokens", 24))).model
    lines, summary = rollout_pairs(model, proc, read_post_file(prompts, "prompt"),
                                   Verifier("grounding_iou"), int(ro.get("k", 4)), seed,
                                   int(ro.get("max_new_tokens", 24)), float(ro.get("temperature", 1.0)), 1.0,
                                   float(ro.get("high", 0.75)), float(ro.get("low", 0.25)), progress=progress)
    write_pairs(lines, out)
    return dict(summary, pairs=len(lines), out=out)


def train_phase(run_cfg, out_dir: str, progress: bool) -> Dict[str, Any]:
    """The run config's DPO -> GRPO chain (configs/demo/post.yaml); {stage: its last checkpoint}."""
    child_setup()
    summary = run_training(run_cfg, out_dir, progress=progress, sampler=EngineSampler())
    return {s["stage"]: s["checkpoint"] for s in summary["stages"]}


def heldout_iou(predictions: str, heldout: str) -> Dict[str, float]:
    """Mean IoU (GRPO's reward on held-out images) and Acc@IoU0.75 of greedy predictions, boxes read by the
    evaluation's parser (`eval.metrics.parse_box`: the printed answer, grounding tags dropped)."""
    gold = {}
    with open(heldout, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            gold[n] = parse_box(json.loads(line)["messages"][-1]["content"])
    ious = []
    with open(predictions, encoding="utf-8") as f:
        for line in f:
            p = json.loads(line)
            box = parse_box(p["prediction"])
            ious.append(0.0 if box is None else float(box_iou(box, gold[p["line"]])))
    iou = np.asarray(ious, np.float64)
    return {"n": int(iou.size), "mean_iou": float(iou.mean()), "acc_iou75": float((iou >= 0.75).mean())}


def reusable_eval(d: str, ckpt: str, heldout: str, data_cfg) -> bool:
    """True when d holds a `mindvl eval` of ckpt on heldout at the run's pixel limits (the demo's own
    evaluation of the merged checkpoint: same path, settings and greedy decoding, so the same predictions)."""
    path = os.path.join(d, "scores.json")
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(d, "predictions.jsonl")):
        return False
    with open(path, encoding="utf-8") as f:
        s = json.load(f)
    same = lambda a, b: bool(a and b) and os.path.abspath(a) == os.path.abspath(b)  # noqa: E731
    return same(s.get("checkpoint"), ckpt) and same(s.get("data"), heldout) and \
        (s.get("min_pixels"), s.get("max_pixels")) == (data_cfg.image.min_pixels, data_cfg.image.max_pixels)


@contextlib.contextmanager
def kept_checkpoint_restored(ckpts: Dict[str, str], data_cfg, tokens: int) -> Iterator[None]:
    """While the block evaluates `ckpts` through `evaluation.eval_backend` (each next checkpoint takes over
    the model kept in this process, so its compiled graphs serve them all): the one of `ckpts` kept on entry
    (the merged checkpoint of the demo's evaluation and rollout, when the phases run in one process) is
    loaded back into that model on exit, so it is kept again and answers with its own weights."""
    owner = next((c for c in ckpts.values() if cached_backend(c) is not None), None)
    try:
        yield
    finally:
        if owner is not None:
            eval_backend(owner, data_cfg, tokens)


def eval_phase(ckpts: Dict[str, str], heldout: str, data_cfg, demo: Dict[str, Any], out_dir: str,
               progress: bool, reuse: Optional[Dict[str, str]] = None) -> Dict[str, Dict[str, float]]:
    """{checkpoint name: {acc_iou50, acc_iou75, mean_iou, n, source}} on the held-out grounding split;
    `reuse` maps a name to an existing evaluation directory of that checkpoint (read, not rerun). The
    checkpoints share one model (`evaluation.eval_backend`), the one kept in the process when there is one,
    which gets its own checkpoint back afterwards (`kept_checkpoint_restored`)."""
    child_setup()
    reuse = reuse or {}
    out = {}
    tokens = int(demo.get("max_new_tokens", 24))
    with kept_checkpoint_restored(ckpts, data_cfg, tokens):
        for name, ckpt in ckpts.items():
            d = reuse.get(name) or os.path.join(out_dir, name)
            if name in reuse:
                with open(os.path.join(d, "scores.json"), encoding="utf-8") as f:
                    res = json.load(f)
            else:
                backend = eval_backend(ckpt, data_cfg, tokens)
                res = evaluate(ckpt, heldout, d, backend=backend,
                               min_pixels=data_cfg.image.min_pixels, max_pixels=data_cfg.image.max_pixels,
                               batch_size=int(demo.get("eval_batch_size", 8)), max_new_tokens=tokens,
                               progress=progress)
            out[name] = dict(source=d, acc_iou50=res["tasks"]["grounding"]["primary"],
                             **heldout_iou(os.path.join(d, "predictions.jsonl"), heldout))
    return out


def stage_metrics(metrics: str) -> Dict[str, Dict[str, Any]]:
    """Per post-training stage: steps and the first/last 5-step means of its logged metrics."""
    recs: Dict[str, List[Dict[str, Any]]] = {}
    with open(metrics, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            recs.setdefault(r["stage"], []).append(r)
    keys = {"dpo": ("loss", "margin", "pref_accuracy"), "grpo": ("reward_mean", "reward_std", "clip_frac",
                                                              "entropy", "response_length")}
    out = {}
    for stage, rs in recs.items():
        ks = [k for k in keys.get(stage, ("loss",)) if k in rs[0]]
        out[stage] = {"steps": len(rs), **{k: [float(np.mean([r[k] for r in rs[:5]])),
                                                float(np.mean([r[k] for r in rs[-5:]]))] for k in ks}}
    return out
