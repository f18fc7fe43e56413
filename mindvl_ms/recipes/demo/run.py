"""The `mindvl demo` pipeline: data -> warm-up -> multitask -> SFT x 2 sequence lengths -> merge -> eval.

    from mindvl_ms.recipes.demo.run import run_demo
    report = run_demo("runs/demo", quick=False)      # what `mindvl demo` does

The steps, one module each:
- `config`: one YAML (configs/demo/full.yaml, or quick.yaml for `--quick`) is a normal training run
  config plus a `demo:` section (data sizes, model YAML, evaluation settings).
- `prepare`: the data (`datasets`: JSONL + images, with image-blind baselines) and, with `demo.vocab:
  data`, the model's vocabulary restricted to the token ids the data uses.
- `training`: one `run_training` over the stages on packed rows (`rows.DemoRows`); the SFT stage's
  variants each start from the multitask checkpoint and the trainer averages them uniformly into
  OUT/merged (the stage's `variants` and `merge`, as in any run config).
- `evaluation`: held-out scores of the variants and the merged checkpoint, and the resolution search.
- `processes`: each phase (training, evaluation) runs in its own spawned process (`demo.phase_processes`;
  --quick runs them in the demo's process).
- `report`: the printed summary.
- `seeds`: `mindvl demo --seeds 0 1 2`, the demo once per seed (OUT/seed_<s>) and the per-seed table of the
  merged checkpoint's scores against the demo's targets.
Everything lands in OUT: data/, a directory per trained stage (warmup/, multitask/, sft_256/, sft_512/:
checkpoints and loss plots) with metrics.jsonl and summary.json, merged/, eval/, resolution_search/ and
report.json (the printed summary, machine readable).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

import mindspore as ms

from mindvl_ms.config.packaged import resolve_config
from mindvl_ms.recipes.demo.config import config_path, data_seed, load_demo_config
from mindvl_ms.recipes.demo.evaluation import evaluate_phase, vqa_scores_by_type
from mindvl_ms.recipes.demo.prepare import restrict_vocab, write_data
from mindvl_ms.recipes.demo.processes import in_child
from mindvl_ms.recipes.demo.report import format_report
from mindvl_ms.recipes.demo.training import train_all


def run_demo(out_dir: str = "runs/demo", quick: bool = False, config: Optional[str] = None,
             overrides: Optional[List[str]] = None, progress: bool = True) -> Dict[str, Any]:
    """The whole demo; returns the report (also OUT/report.json) and prints it."""
    t0 = time.perf_counter()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    path = resolve_config(config)[0] if config else config_path(quick)
    data_dir = os.path.join(out_dir, "data")
    run_cfg, demo = load_demo_config(path, data_dir, overrides, vocab_subset=False)  # restrict_vocab redoes it
    seed = data_seed(demo, run_cfg.seed)
    info = write_data(demo, data_dir, seed, progress)
    info["vocab"] = restrict_vocab(run_cfg, demo, data_dir, list(info["files"]["heldout"].values()))
    t_data = time.perf_counter()
    spawn = demo.get("phase_processes", True)
    trained = train_all(run_cfg, out_dir, progress=progress, spawn=spawn)
    t_train = time.perf_counter()
    merged = trained["merged"]
    with open(os.path.join(merged, "merge_record.json"), encoding="utf-8") as f:
        record = json.load(f)
    ckpts = dict(trained["sft_checkpoints"] if demo.get("eval_variants", True) else {}, merged=merged)
    scores, search = in_child(evaluate_phase, ckpts, info["files"]["heldout"], run_cfg.data, demo, out_dir,
                              progress, spawn=spawn)
    scores_by_type = {n: vqa_scores_by_type(os.path.join(out_dir, "eval", n, "vqa", "predictions.jsonl"))
                      for n in ckpts} if "vqa" in scores.get("merged", {}) else {}
    t_end = time.perf_counter()
    report = {"config": os.path.abspath(path), "out_dir": os.path.abspath(out_dir), "quick": quick,
              "seed": run_cfg.seed, "data_seed": seed,
              "stages": trained["stages"], "packing": trained["packing"], "baselines": info["baselines"],
              "vocab": info["vocab"], "scores": scores, "vqa_by_type": scores_by_type,
              "merge": {"checkpoint": merged, "inputs": record["inputs"]}, "resolution_search": search,
              "wall_time_s": {"data": t_data - t0, "train": t_train - t_data, "eval": t_end - t_train,
                              "total": t_end - t0}}
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)
    print(format_report(report))
    return report
