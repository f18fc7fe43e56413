"""`mindvl demo --post-train`: openPangu-VL's post-training (SFT -> DPO -> GRPO) in miniature on the demo model.

    mindvl demo --out runs/demo                 # the three-stage demo: writes runs/demo/merged
    mindvl demo --out runs/demo --post-train    # this: post-trains runs/demo/merged
    from mindvl_ms.recipes.demo.post import run_post_train; run_post_train("runs/demo")

Steps (everything lands in OUT/post, the demo run's files are only read):
1. prompts   new grounding images (`grounding_data.grounding_image`, a seed stream the demo never uses):
             RL prompt lines (`messages` + image + `answer` + `reward: grounding_iou`), disjoint from
             the demo's train and held-out splits.
2. before    greedy held-out grounding of the merged checkpoint (OUT/data/heldout_grounding.jsonl: the
             demo's held-out split, which no stage trains on); the demo's own evaluation of it
             (OUT/eval/merged/grounding) is read when its checkpoint, data and pixel limits match.
3. rollout   `infer.rollout.rollout_pairs` (what `mindvl rollout` runs): k samples per prompt from the
             merged model, scored by box IoU; a prompt gives a preference pair when its best sample
             scores above `high` and its worst below `low`.
4. train     configs/demo/post.yaml's chain through `run_training`: a DPO stage on those pairs (with the
             NTP mix on the demo's VQA and OCR training data) from the merged checkpoint, then a GRPO stage
             on the prompts with the IoU reward from the DPO checkpoint.
5. after     held-out grounding of the DPO and GRPO checkpoints; the table compares Acc@IoU0.5, the
             stricter Acc@IoU0.75 and the mean IoU (GRPO's reward) of the three.

Paths in the YAML that start with `runs/demo/` are the demo's default OUT and are rewritten to --out.
Each phase (`post_phases`) runs in its own spawned process (`processes.in_child`), as in the demo, unless
`demo.phase_processes` is false (then in the calling process).
"""
from __future__ import annotations

import copy
import json
import os
import time
from typing import Any, Dict, List, Optional

import numpy as np

from mindvl_ms.config.base import ConfigError, read_yaml, set_dotted
from mindvl_ms.config.packaged import packaged_path, resolve_config
from mindvl_ms.config.train import load_run_config
from mindvl_ms.recipes.demo.grounding_data import GROUND_SIZE, grounding_image
from mindvl_ms.recipes.demo.lines import write_jsonl
from mindvl_ms.recipes.demo.post_phases import eval_phase, reusable_eval, rollout_phase, stage_metrics, train_phase
from mindvl_ms.recipes.demo.processes import in_child
from mindvl_ms.recipes.demo.report import format_post_report


DEFAULT_PREFIX = "runs/demo/"


def rewrite_paths(obj: Any, out_dir: str) -> Any:
    """Every string of a raw YAML tree that starts with runs/demo/ re-rooted at out_dir."""
    if isinstance(obj, dict):
        return {k: rewrite_paths(v, out_dir) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rewrite_paths(v, out_dir) for v in obj]
    if isinstance(obj, str) and obj.startswith(DEFAULT_PREFIX):
        return os.path.join(out_dir, obj[len(DEFAULT_PREFIX):])
    return obj


def load_post_config(path: str, out_dir: str, overrides: Optional[List[str]] = None):
    """(RunConfig, demo section) of a post-training demo YAML, its runs/demo/ paths moved to out_dir.
    Overrides starting with `demo.` (e.g. demo.rollout.k=8) set the demo section, the others the run config."""
    raw = read_yaml(path)
    demo = raw.pop("demo", None)
    if not isinstance(demo, dict):
        raise ConfigError(f"{path}: missing the `demo:` section (prompts, rollout, eval settings)")
    rest = []
    for o in overrides or []:
        key, eq, val = o.partition("=")
        if not key.startswith("demo."):
            rest.append(o)
            continue
        *parents, leaf = key[len("demo."):].split(".")
        node: Any = demo
        for k in parents:
            node = node.get(k) if isinstance(node, dict) else None
        if not eq or not isinstance(node, dict) or leaf not in node:
            raise ConfigError(f"--set {o!r}: the demo section has no {key[len('demo.'):]!r} "
                              f"(expected demo.KEY=VALUE, KEY one of {sorted(demo)} or below)")
        set_dotted(demo, key[len("demo."):], val)
    if not isinstance(demo.get("phase_processes", True), bool):
        raise ConfigError(f"{path}: demo.phase_processes must be true or false, got {demo['phase_processes']!r}")
    if not isinstance(demo.get("prompts"), int) or demo["prompts"] < 1:
        raise ConfigError(f"{path}: demo.prompts (the number of RL prompt images) must be an integer >= 1, "
                          f"got {demo.get('prompts')!r}")
    cfg = load_run_config(data=rewrite_paths(raw, os.path.abspath(out_dir)), overrides=rest)
    kinds = [s.type for s in cfg.stages]
    if kinds != ["dpo", "grpo"]:
        raise ConfigError(f"{path}: the post-training demo runs a dpo then a grpo stage, got {kinds}")
    return cfg, demo


def write_prompts(out_dir: str, n: int, seed: int) -> str:
    """n grounding RL prompt lines on new images (OUT/post/data); returns the JSONL path."""
    img_dir = os.path.join(out_dir, "images")
    os.makedirs(img_dir, exist_ok=True)
    rng = np.random.default_rng([seed, 1000])  # write_demo_data's streams are [seed, 0..2]
    lines = []
    for i in range(n):
        im, name, answer, box = grounding_image(rng)
        rel = f"images/prompt_{i:05d}.png"
        im.save(os.path.join(out_dir, rel))
        lines.append({"id": f"post-prompt-{i}", "images": [rel], "image_sizes": [list(GROUND_SIZE)],
                      "messages": [{"role": "user", "content": f"<image>\nWhere is the {name}?"}],
                      "answer": answer, "reward": "grounding_iou", "meta": {"box_pixels": list(box)}})
    path = os.path.join(out_dir, "prompts.jsonl")
    write_jsonl(path, lines)
    return path


def run_post_train(out_dir: str = "runs/demo", config: Optional[str] = None, overrides: Optional[List[str]] = None,
                   progress: bool = True) -> Dict[str, Any]:
    """Post-train OUT/merged of a finished `mindvl demo --out OUT`; returns the report (OUT/post/post_report.json)."""
    t0 = time.perf_counter()
    path = resolve_config(config)[0] if config else packaged_path("demo/post_train.yaml")
    run_cfg, demo = load_post_config(path, out_dir, overrides)
    heldout = os.path.join(out_dir, "data", "heldout_grounding.jsonl")
    for need in (run_cfg.init_from, heldout):
        if not os.path.exists(need):
            raise ConfigError(f"{need} not found: run `mindvl demo --out {out_dir}` first (the post-training "
                              f"demo starts from its merged checkpoint and scores on its held-out split)")
    post = os.path.join(out_dir, "post")
    dpo, grpo = run_cfg.stages
    prompts = grpo.data["sources"][0]["path"]
    write_prompts(os.path.dirname(prompts), int(demo["prompts"]), run_cfg.seed)
    pairs = dpo.data["sources"][0]["path"]
    spawn = demo.get("phase_processes", True)
    rollout = in_child(rollout_phase, run_cfg.init_from, prompts, pairs, run_cfg.data, demo.get("rollout") or {},
                       run_cfg.seed, progress, spawn=spawn)
    if rollout["pairs"] < dpo.global_batch_size:
        raise ValueError(f"rollout gave {rollout['pairs']} preference pairs, fewer than one DPO batch "
                         f"({dpo.global_batch_size}); widen demo.rollout.high/low or raise k")
    t_roll = time.perf_counter()
    ckpts = in_child(train_phase, copy.deepcopy(run_cfg), os.path.join(post, "train"), progress, spawn=spawn)
    t_train = time.perf_counter()
    named = {"merged": run_cfg.init_from, "dpo": ckpts["dpo"], "grpo": ckpts["grpo"]}
    done = os.path.join(out_dir, "eval", "merged", "grounding")  # the demo's own evaluation of merged
    reuse = {"merged": done} if reusable_eval(done, run_cfg.init_from, heldout, run_cfg.data) else {}
    scores = in_child(eval_phase, named, heldout, run_cfg.data, demo, os.path.join(post, "eval"), progress, reuse,
                      spawn=spawn)
    t_end = time.perf_counter()
    report = {"config": os.path.abspath(path), "out_dir": os.path.abspath(post), "seed": run_cfg.seed,
              "checkpoints": named, "rollout": rollout, "prompts": prompts,
              "stages": stage_metrics(os.path.join(post, "train", "metrics.jsonl")), "heldout": scores,
              "wall_time_s": {"rollout": t_roll - t0, "train": t_train - t_roll, "eval": t_end - t_train,
                              "total": t_end - t0}}
    with open(os.path.join(post, "post_report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(format_post_report(report))
    return report
