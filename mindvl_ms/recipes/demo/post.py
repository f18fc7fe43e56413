"""`mindvl demo --post-train`: openPangu-VL's post-training (SFT -> DPO -> GRPO) in miniature on the demo model.

    mindvl demo --out runs/demo                 # the three-stage demo: writes runs/demo/merged
    mindvl demo --out runs/demo --post-train    # this: post-trains runs/demo/merged
    from mindvl_ms.recipes.demo.post import run_post_train; run_post_train("runs/demo")

Steps (everything lands in OUT/post, the demo run's files are only read):
1. prompts   new grounding images (`demo.datasets.grounding_image`, a seed stream the demo never uses):
             RL prompt lines (`messages` + image + `answer` + `reward: grounding_iou`), disjoint from
             the demo's train and held-out splits.
2. before    greedy held-out grounding of the merged checkpoint (OUT/data/heldout_grounding.jsonl: the
             demo's held-out split, which no stage trains on); the demo's own evaluation of it
             (OUT/eval/merged/grounding) is read when its checkpoint, data and pixel limits match.
3. rollout   `train.post.rollout.rollout_pairs` (what `mindvl rollout` runs): k samples per prompt from the
             merged model, scored by box IoU; a prompt gives a preference pair when its best sample
             scores above `high` and its worst below `low`.
4. train     configs/demo/post.yaml's chain through `run_training`: a DPO stage on those pairs (with the
             NTP mix on the demo's VQA and OCR training data) from the merged checkpoint, then a GRPO stage
             on the prompts with the IoU reward from the DPO checkpoint.
5. after     held-out grounding of the DPO and GRPO checkpoints; the table compares Acc@IoU0.5, the
             stricter Acc@IoU0.75 and the mean IoU (GRPO's reward) of the three.

Paths in the YAML that start with `runs/demo/` are the demo's default OUT and are rewritten to --out.
Each phase runs in its own spawned process (`run.in_child`), as in the demo.
"""
from __future__ import annotations

import copy
import json
import os
import time
from typing import Any, Dict, List, Optional

import numpy as np

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
    from mindvl_ms.config.base import ConfigError, read_yaml, set_dotted
    from mindvl_ms.config.train import load_run_config

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
    if not isinstance(demo.get("prompts"), int) or demo["prompts"] < 1:
        raise ConfigError(f"{path}: demo.prompts (the number of RL prompt images) must be an integer >= 1, "
                          f"got {demo.get('prompts')!r}")
    cfg = load_run_config(data=rewrite_paths(raw, os.path.abspath(out_dir)), overrides=rest)
    kinds = [s.type for s in cfg.stages]
    if kinds != ["dpo", "grpo"]:
        raise ConfigError(f"{path}: the post-training demo runs a dpo then a grpo stage, got {kinds}")
    return cfg, demo


# ------------------------------------------------------------------------------------------- data

def write_prompts(out_dir: str, n: int, seed: int) -> str:
    """n grounding RL prompt lines on new images (OUT/post/data); returns the JSONL path."""
    from mindvl_ms.recipes.demo.datasets import GROUND_SIZE, grounding_image, write_jsonl

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


# ------------------------------------------------------------------------------------------- phases

def rollout_phase(ckpt: str, prompts: str, out: str, data_cfg, ro: Dict[str, Any], seed: int,
                  progress: bool) -> Dict[str, Any]:
    """`mindvl rollout` on the prompts with the processor the demo trained with; writes the pairs."""
    from mindvl_ms.data.preference import read_post_file
    from mindvl_ms.data.processor import MindVLProcessor
    from mindvl_ms.infer.generate import load_model
    from mindvl_ms.train.post.rewards import Verifier
    from mindvl_ms.train.post.rollout import rollout_pairs, write_pairs
    from mindvl_ms.recipes.demo.run import child_setup

    child_setup()
    lines, summary = rollout_pairs(load_model(ckpt), MindVLProcessor(config=data_cfg), read_post_file(prompts, "prompt"),
                                   Verifier("grounding_iou"), int(ro.get("k", 4)), seed,
                                   int(ro.get("max_new_tokens", 24)), float(ro.get("temperature", 1.0)), 1.0,
                                   float(ro.get("high", 0.75)), float(ro.get("low", 0.25)), progress=progress)
    write_pairs(lines, out)
    return dict(summary, out=out)


def train_phase(run_cfg, out_dir: str, progress: bool) -> Dict[str, Any]:
    from mindvl_ms.train import run_training
    from mindvl_ms.recipes.demo.run import child_setup

    child_setup()
    summary = run_training(run_cfg, out_dir, progress=progress)
    return {s["stage"]: s["checkpoint"] for s in summary["stages"]}


def heldout_iou(predictions: str, heldout: str) -> Dict[str, float]:
    """Mean IoU (GRPO's reward on held-out images) and Acc@IoU0.75 of greedy predictions, boxes read by the
    evaluation's parser (`eval.metrics.parse_box`: the printed answer, grounding tags dropped)."""
    from mindvl_ms.data.grounding import box_iou
    from mindvl_ms.eval.metrics import parse_box

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


def eval_phase(ckpts: Dict[str, str], heldout: str, data_cfg, demo: Dict[str, Any], out_dir: str,
               progress: bool, reuse: Optional[Dict[str, str]] = None) -> Dict[str, Dict[str, float]]:
    """{checkpoint name: {acc_iou50, acc_iou75, mean_iou, n, source}} on the held-out grounding split;
    `reuse` maps a name to an existing evaluation directory of that checkpoint (read, not rerun)."""
    from mindvl_ms.eval.benchmark import evaluate
    from mindvl_ms.recipes.demo.run import child_setup, eval_backend

    child_setup()
    reuse = reuse or {}
    out = {}
    tokens = int(demo.get("max_new_tokens", 24))
    for name, ckpt in ckpts.items():
        d = reuse.get(name) or os.path.join(out_dir, name)
        if name in reuse:
            with open(os.path.join(d, "scores.json"), encoding="utf-8") as f:
                res = json.load(f)
        else:
            res = evaluate(ckpt, heldout, d, backend=eval_backend(ckpt, data_cfg, tokens),
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


# ------------------------------------------------------------------------------------------- the job

def run_post_train(out_dir: str = "runs/demo", config: Optional[str] = None, overrides: Optional[List[str]] = None,
                   progress: bool = True) -> Dict[str, Any]:
    """Post-train OUT/merged of a finished `mindvl demo --out OUT`; returns the report (OUT/post/post_report.json)."""
    from mindvl_ms.config.base import ConfigError
    from mindvl_ms.config.packaged import packaged_path, resolve_config
    from mindvl_ms.recipes.demo.run import in_child

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
    rollout = in_child(rollout_phase, run_cfg.init_from, prompts, pairs, run_cfg.data, demo.get("rollout") or {},
                       run_cfg.seed, progress)
    if rollout["pairs"] < dpo.global_batch_size:
        raise ValueError(f"rollout gave {rollout['pairs']} preference pairs, fewer than one DPO batch "
                         f"({dpo.global_batch_size}); widen demo.rollout.high/low or raise k")
    t_roll = time.perf_counter()
    ckpts = in_child(train_phase, copy.deepcopy(run_cfg), os.path.join(post, "train"), progress)
    t_train = time.perf_counter()
    named = {"merged": run_cfg.init_from, "dpo": ckpts["dpo"], "grpo": ckpts["grpo"]}
    done = os.path.join(out_dir, "eval", "merged", "grounding")  # the demo's own evaluation of merged
    reuse = {"merged": done} if reusable_eval(done, run_cfg.init_from, heldout, run_cfg.data) else {}
    scores = in_child(eval_phase, named, heldout, run_cfg.data, demo, os.path.join(post, "eval"), progress, reuse)
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


def format_post_report(r: Dict[str, Any]) -> str:
    ro, st, h = r["rollout"], r["stages"], r["heldout"]
    lines = ["", f"== mindvl demo --post-train (seed {r['seed']}) ==",
             f"  rollout   {ro['prompts']} prompts x {ro['k']} samples: mean IoU {ro['mean_score']:.3f}, best-of-k "
             f"{ro['best_of_k']:.3f} -> {ro['pairs']} preference pairs"]
    if "dpo" in st:
        d = st["dpo"]
        lines.append(f"  dpo       {d['steps']} steps: loss {d['loss'][0]:.3f} -> {d['loss'][1]:.3f}, margin "
                     f"{d['margin'][0]:.3f} -> {d['margin'][1]:.3f} (first / last 5 steps)")
    if "grpo" in st:
        g = st["grpo"]
        lines.append(f"  grpo      {g['steps']} steps: reward {g['reward_mean'][0]:.3f} -> {g['reward_mean'][1]:.3f}, "
                     f"clip fraction {g['clip_frac'][1]:.3f}, entropy {g['entropy'][0]:.3f} -> {g['entropy'][1]:.3f}")
    n = next(iter(h.values()))["n"]
    lines.append(f"== held-out grounding ({n} images, greedy) ==")
    lines.append(f"  {'checkpoint':<12}{'Acc@IoU0.5':>12}{'Acc@IoU0.75':>13}{'mean IoU':>10}")
    for name, s in h.items():
        lines.append(f"  {name:<12}{100 * s['acc_iou50']:>11.1f}%{100 * s['acc_iou75']:>12.1f}%{s['mean_iou']:>10.3f}")
    w = r["wall_time_s"]
    lines.append(f"== wall time {w['total'] / 60:.1f} min (prompts + rollout {w['rollout']:.0f}s, DPO + GRPO "
                 f"{w['train']:.0f}s, eval {w['eval']:.0f}s); report: {r['out_dir']}/post_report.json ==")
    return "\n".join(lines)
