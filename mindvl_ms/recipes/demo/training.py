"""The demo's training phase (in its own process unless `demo.phase_processes` is false,
`processes.in_child`): one `run_training` over every stage.

Warm-up trains the projector only, multitask trains everything, and the `sft` stage's `variants` (two row
lengths and pixel budgets) each start from the multitask checkpoint and are merged by the trainer
(`merge:` of the stage; MindVL's 2K/4K/8K SFT merge, section 5.3). Training uses the plain MindVL model;
the train step runs the LM head only at supervised positions, in chunks (`train.loss_head`).
"""
from __future__ import annotations

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
    """`run_training` over run_cfg.stages from random init or `init_from`: per-stage losses, packing, the
    variants' final checkpoints and the merges."""
    child_setup()
    rows = DemoRows(progress=progress)
    summary = run_training(run_cfg, out_dir, model=train_model(run_cfg, init_from), data_factory=rows,
                           collate=rows.collate(run_cfg.model), progress=progress)
    return {"stages": _stage_loss(summary, os.path.join(out_dir, "metrics.jsonl")),
            "checkpoint": summary["stages"][-1]["checkpoint"], "packing": rows.reports,
            "variants": {s["stage"]: s["checkpoint"] for s in summary["stages"] if "variant_of" in s},
            "merges": summary["merges"]}


def train_all(run_cfg, out_dir: str, progress: bool = True, spawn: bool = True) -> Dict[str, Any]:
    """Every stage in one spawned process (in this one with spawn=False), the run in OUT itself
    (OUT/<stage>/, OUT/metrics.jsonl); the recipe needs SFT variants to merge. The run config's `init_from`,
    when set, is the checkpoint the stages start from instead of a random init (research/ trains its arms'
    SFT stage from one multitask checkpoint)."""
    if not any(s.variants for s in run_cfg.stages):
        raise ValueError("the demo recipe needs a stage with `variants` (the SFT variants it merges), got "
                         f"{[s.name for s in run_cfg.stages]}")
    res = in_child(run_stages, run_cfg, out_dir, run_cfg.init_from or None, progress, spawn=spawn)
    return {"stages": res["stages"], "packing": res["packing"], "sft_checkpoints": res["variants"],
            "merged": res["merges"][-1]["checkpoint"]}
