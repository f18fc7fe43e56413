"""`mindvl search-resolution`: test-time grid over min/max pixels (MindVL section 5.4, Figure 4).

    mindvl search-resolution --ckpt ckpt/merged ckpt/sft_2k --data docvqa.jsonl ocrbench.jsonl --out search/
    mindvl search-resolution --ckpt ckpt/merged --data ocr.jsonl --min-grid 4 16 --max-grid 1280 4096 --save

Grid (in units of 28x28 pixels, configurable): min_pixels {4, 16, 32, 64} x max_pixels {1280, 2048, 2560,
3072, 4096, 8192}; settings with min > max are skipped. For every checkpoint and setting all benchmark
files are evaluated (metrics.py, one primary 0..1 score per benchmark/task).

Caching: per checkpoint, vision features are cached on (image, resized h, w) (benchmark.VisionCache), and a
sample whose images all resize exactly as in an earlier setting reuses that setting's greedy answer, since
its model inputs are identical. Small images are often unchanged by max_pixels, so most of the grid is
free. A caller that evaluated a checkpoint already (`mindvl demo`) passes that evaluation's answers in, so the
settings that resize as it did are free too. The report counts generated vs reused answers and encoded vs
reused images.

Outputs in --out: resolution_search.json (every setting's scores, the best setting per checkpoint and
benchmark, and the best average), resolution_table.md, resolution_grid.png (one heatmap per checkpoint and
benchmark, and of the average: the score at every min_pixels x max_pixels setting, the best one framed;
a spread over a few settings, as the paper's Figure 4 box plots show it, hides which setting is best).
`--save` writes the best-average setting into each checkpoint's inference_config.json, which `mindvl eval`
(and generation) use by default. Benchmark files are JSONL or VLMEvalKit TSV (benchmark.load_items; a
TSV's images are decoded into --out/images).
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from tqdm import tqdm

from mindvl_ms.eval.benchmark import INFERENCE_CONFIG, Sizes, VisionCache, load_backend, load_items, predict, score

UNIT = 28 * 28
MIN_GRID = (4, 16, 32, 64)
MAX_GRID = (1280, 2048, 2560, 3072, 4096, 8192)


def grid(min_grid: Sequence[int] = MIN_GRID, max_grid: Sequence[int] = MAX_GRID) -> List[tuple]:
    """(min_pixels, max_pixels) settings in pixels, min-major order, skipping min > max."""
    out = [(lo * UNIT, hi * UNIT) for lo in min_grid for hi in max_grid if lo <= hi]
    if not out:
        raise ValueError(f"empty grid: every min in {list(min_grid)} exceeds every max in {list(max_grid)}")
    return out


def _name(ckpt: str) -> str:
    return os.path.basename(os.path.normpath(ckpt)) or ckpt


def search(ckpts: Sequence[str], data: Sequence[str], out_dir: str,
           backend_factory: Optional[Callable[[str], object]] = None, min_grid: Sequence[int] = MIN_GRID,
           max_grid: Sequence[int] = MAX_GRID, batch_size: int = 8, max_new_tokens: int = 128,
           limit: Optional[int] = None, save: bool = False, plot: bool = True, progress: bool = True,
           metric: Optional[str] = None, image_dir: Optional[str] = None,
           pred_caches: Optional[Dict[str, dict]] = None) -> dict:
    """Evaluate every checkpoint at every grid setting; write the table, plot and JSON; returns the JSON.
    `metric`: of questions that name none; `image_dir`: where TSV images go (default out_dir/images);
    `pred_caches`: {checkpoint: the `pred_cache` an `evaluate` of it through the same backend filled}, whose
    answers count as generated already (the setting that evaluation used costs nothing again)."""
    settings = grid(min_grid, max_grid)
    image_dir = image_dir or os.path.join(out_dir, "images")
    items = [it for path in data for it in load_items(path, limit, metric, image_dir)]
    factory = backend_factory or (lambda c: load_backend(c, max_new_tokens))
    rows, best, caching = [], {}, {}
    for ckpt in ckpts:
        backend, vcache, sizes = factory(ckpt), VisionCache(), Sizes()
        pcache = dict((pred_caches or {}).get(ckpt, {}))
        stats = {"generated": 0, "reused": 0}
        bar = tqdm(settings, desc=f"search {_name(ckpt)}", unit="setting", disable=not progress)
        for lo, hi in bar:
            bar.set_postfix_str(f"min={lo // UNIT} max={hi // UNIT} generated={stats['generated']}")
            preds, _, st = predict(items, backend, lo, hi, batch_size, max_new_tokens, vcache, sizes, pcache,
                                   progress=False)
            stats["generated"] += st["generated"]
            stats["reused"] += st["reused"]
            _, tasks = score(items, preds)
            scores = {t: v["primary"] for t, v in tasks.items()}
            rows.append({"checkpoint": ckpt, "min_pixels": lo, "max_pixels": hi, "scores": scores,
                         "average": sum(scores.values()) / len(scores), "details": tasks})
        caching[ckpt] = dict(stats, vision_encoded=vcache.misses, vision_reused=vcache.hits)
        mine = [r for r in rows if r["checkpoint"] == ckpt]
        per_task = {}
        for t in mine[0]["scores"]:
            r = max(mine, key=lambda r: r["scores"][t])  # first (smallest) setting wins ties
            per_task[t] = {"min_pixels": r["min_pixels"], "max_pixels": r["max_pixels"], "score": r["scores"][t]}
        top = max(mine, key=lambda r: r["average"])
        best[ckpt] = {"per_task": per_task, "average": {"min_pixels": top["min_pixels"],
                                                        "max_pixels": top["max_pixels"], "score": top["average"]}}
        if save:
            save_inference_config(ckpt, top["min_pixels"], top["max_pixels"], data, top["average"], per_task)
    result = {"grid_units": UNIT, "min_grid": list(min_grid), "max_grid": list(max_grid), "data": list(data),
              "rows": rows, "best": best, "caching": caching}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "resolution_search.json"), "w") as f:
        json.dump(result, f, indent=2)
    table = format_table(result)
    with open(os.path.join(out_dir, "resolution_table.md"), "w") as f:
        f.write(table + "\n")
    if plot:
        result["plot"] = grid_plot(result, os.path.join(out_dir, "resolution_grid.png"))
    return result


def save_inference_config(ckpt: str, min_pixels: int, max_pixels: int, data: Sequence[str], score_: float,
                          per_task: dict) -> str:
    """Write (merge into) ckpt/inference_config.json; `mindvl eval` reads min/max_pixels from it."""
    path = os.path.join(ckpt, INFERENCE_CONFIG)
    cfg = {}
    if os.path.isfile(path):
        with open(path) as f:
            cfg = json.load(f)
    cfg.update({"min_pixels": int(min_pixels), "max_pixels": int(max_pixels),
                "resolution_search": {"data": [os.path.abspath(d) for d in data], "average_score": score_,
                                      "per_task_best": per_task,
                                      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}})
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(tmp, path)
    return path


def format_table(result: dict) -> str:
    """Markdown table: one row per (checkpoint, setting), a column per benchmark, best marked with *."""
    tasks = sorted({t for r in result["rows"] for t in r["scores"]})
    lines = ["| checkpoint | min_pixels (x28x28) | max_pixels (x28x28) | " + " | ".join(tasks) + " | average |",
             "|" + " --- |" * (len(tasks) + 4)]
    for r in result["rows"]:
        b = result["best"][r["checkpoint"]]
        cells = []
        for t in tasks:
            star = "*" if (b["per_task"][t]["min_pixels"], b["per_task"][t]["max_pixels"]) == (
                r["min_pixels"], r["max_pixels"]) else ""
            cells.append(f"{100 * r['scores'][t]:.1f}{star}")
        star = "*" if (b["average"]["min_pixels"], b["average"]["max_pixels"]) == (r["min_pixels"], r["max_pixels"]) \
            else ""
        lines.append(f"| {_name(r['checkpoint'])} | {r['min_pixels'] // UNIT} | {r['max_pixels'] // UNIT} | "
                     + " | ".join(cells) + f" | {100 * r['average']:.1f}{star} |")
    return "\n".join(lines)


def _grid_scores(result: dict, ckpt: str, key: Optional[str]) -> np.ndarray:
    """Scores in % as [min_grid, max_grid] (NaN where min > max) of one checkpoint; key None: the average."""
    mins, maxs = result["min_grid"], result["max_grid"]
    out = np.full((len(mins), len(maxs)), np.nan)
    for r in result["rows"]:
        if r["checkpoint"] == ckpt:
            v = r["average"] if key is None else r["scores"][key]
            out[mins.index(r["min_pixels"] // UNIT), maxs.index(r["max_pixels"] // UNIT)] = 100 * v
    return out


def grid_plot(result: dict, path: str) -> str:
    """PNG of the score over the grid: a heatmap (rows min_pixels, columns max_pixels, units of 28x28) per
    checkpoint (row of panels) and benchmark (column; plus the average with several benchmarks), each cell
    annotated, the best setting framed. The grid's shape is in the PNG's Description text."""
    tasks = sorted({t for r in result["rows"] for t in r["scores"]})
    ckpts = list(dict.fromkeys(r["checkpoint"] for r in result["rows"]))
    keys = tasks + ([None] if len(tasks) > 1 else [])
    mins, maxs = result["min_grid"], result["max_grid"]
    cell_w, cell_h = 0.62, 0.42
    fig = Figure(figsize=(max(len(keys) * (1.5 + cell_w * len(maxs)) + 1.2, 5.5),
                      max(len(ckpts) * (1.3 + cell_h * len(mins)) + 0.7, 2.8)), layout="constrained")
    axes = fig.subplots(len(ckpts), len(keys), squeeze=False)  # no pyplot: no global backend, nothing to close
    image = None
    for i, ckpt in enumerate(ckpts):
        for j, key in enumerate(keys):
            ax, vals = axes[i][j], _grid_scores(result, ckpt, key)
            image = ax.imshow(vals, cmap="viridis", vmin=0, vmax=100, aspect="auto")
            best = np.unravel_index(np.nanargmax(vals), vals.shape)  # first (smallest) setting wins ties
            for (a, b), v in np.ndenumerate(vals):
                label, color = ("min>max", "grey") if np.isnan(v) else (f"{v:.1f}", "black" if v > 60 else "white")
                ax.text(b, a, label, ha="center", va="center", fontsize=7, color=color)
            ax.add_patch(_frame(best))
            ax.set_xticks(range(len(maxs)), [str(m) for m in maxs], fontsize=7)
            ax.set_yticks(range(len(mins)), [str(m) for m in mins], fontsize=7)
            ax.set_title(f"{_name(ckpt)}: {key or 'average'}", fontsize=9)
            if i == len(ckpts) - 1:
                ax.set_xlabel("max_pixels (x28x28)", fontsize=8)
            if j == 0:
                ax.set_ylabel("min_pixels (x28x28)", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.8, label="score (%)")
    fig.suptitle("score over the test-time resolution grid (best framed)", fontsize=10)
    shape = {"min_grid": mins, "max_grid": maxs, "checkpoints": [_name(c) for c in ckpts], "panels": len(keys)}
    fig.savefig(path, dpi=120, metadata={"Title": "resolution search", "Description": json.dumps(shape)})
    return path


def _frame(cell) -> Rectangle:
    return Rectangle((cell[1] - 0.5, cell[0] - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2)


def summary(result: dict) -> str:
    """Human-readable report: the table, the best settings and the cache use."""
    out = [format_table(result), ""]
    for ckpt, b in result["best"].items():
        a = b["average"]
        out.append(f"{_name(ckpt)}: best average {100 * a['score']:.1f} at min_pixels={a['min_pixels'] // UNIT}x28x28 "
                   f"max_pixels={a['max_pixels'] // UNIT}x28x28")
        for t, v in b["per_task"].items():
            out.append(f"  {t}: best {100 * v['score']:.1f} at min {v['min_pixels'] // UNIT}, max {v['max_pixels'] // UNIT}")
        c = result["caching"][ckpt]
        out.append(f"  answers generated {c['generated']}, reused {c['reused']}; images encoded "
                   f"{c['vision_encoded']}, reused {c['vision_reused']}")
    return "\n".join(out)
