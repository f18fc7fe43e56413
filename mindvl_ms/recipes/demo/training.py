"""The demo's training phases, each in its own process (`processes.in_child`).

Stages whose names do not start with `sft` run chained in one `run_training` call (warm-up trains the
projector only, multitask trains everything). Every `sft*` stage is a variant: each starts from the last
pre-SFT checkpoint in its own run, so the variants (two sequence lengths) can be averaged by
`checkpoint.merge.merge` like MindVL's 2K/4K/8K SFT merge. Training uses the plain MindVL model; the
train step runs the LM head only at supervised positions, in chunks (`train.loss_head`).
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, List, Optional

import mindspore as ms
import numpy as np

from mindvl_ms.checkpoint.pretrained import load_pretrained
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.recipes.demo.processes import child_setup, in_child
from mindvl_ms.recipes.demo.rows import DemoRows
from mindvl_ms.train import run_training


def train_model(run_cfg, init_from: Optional[str] = None):
    """The model a phase trains: `init_from`'s weights, or run_cfg.model initialised from run_cfg.seed."""
    ms.set_seed(run_cfg.seed)
    return load_pretrained(MindVLModel, init_from) if init_from else MindVLModel(run_cfg.model)


def _stage_loss(summary: Dict[str, Any], metrics_path: str) -> Dict[str, Dict[str, float]]:
    """Per stage: first, last and mean-of-last-10 training loss from the metrics log."""
    recs: Dict[str, List[float]] = {}
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            recs.setdefault(r["stage"], []).append(float(r["loss"]))
    out = {}
    for st in summary["stages"]:
        losses = recs.get(st["stage"], [])
        if losses:
            out[st["stage"]] = {"steps": st["steps"], "first_loss": losses[0], "final_loss": losses[-1],
                                "last10_mean": float(np.mean(losses[-10:])), "checkpoint": st["checkpoint"],
                                "plot": st.get("plot")}
    return out


def run_stages(run_cfg, out_dir: str, init_from: Optional[str], progress: bool) -> Dict[str, Any]:
    """`run_training` over run_cfg.stages from random init or `init_from`; per-stage losses and packing."""
    child_setup()
    rows = DemoRows(progress=progress)
    summary = run_training(run_cfg, out_dir, model=train_model(run_cfg, init_from), data_factory=rows,
                           collate=rows.collate(run_cfg.model), progress=progress)
    return {"stages": _stage_loss(summary, os.path.join(out_dir, "metrics.jsonl")),
            "checkpoint": summary["stages"][-1]["checkpoint"], "packing": rows.reports}


def train_all(run_cfg, out_dir: str, progress: bool = True) -> Dict[str, Any]:
    """Pre-SFT stages chained, then each SFT variant from the last pre-SFT checkpoint (one process each)."""
    pre = [s for s in run_cfg.stages if not s.name.startswith("sft")]
    sft = [s for s in run_cfg.stages if s.name.startswith("sft")]
    if not pre or len(sft) < 2:
        raise ValueError("the demo recipe needs pre-SFT stages and at least two `sft*` stages to merge, got "
                         f"{[s.name for s in run_cfg.stages]}")
    cfg = copy.deepcopy(run_cfg)
    cfg.stages = pre
    res = in_child(run_stages, cfg, os.path.join(out_dir, "train"), None, progress)
    stages, packing, base = dict(res["stages"]), dict(res["packing"]), res["checkpoint"]
    sft_ckpts = {}
    for s in sft:
        cfg = copy.deepcopy(run_cfg)
        cfg.stages = [s]
        res = in_child(run_stages, cfg, os.path.join(out_dir, s.name), base, progress)
        stages.update(res["stages"])
        packing.update(res["packing"])
        sft_ckpts[s.name] = res["checkpoint"]
    return {"stages": stages, "packing": packing, "pre_sft_checkpoint": base, "sft_checkpoints": sft_ckpts}
