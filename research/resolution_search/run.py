"""(b) Test-time resolution search (MindVL section 5.4 and 6.3, Figure 4).

    python research/resolution_search/run.py [--seeds 0 1 2] [--smoke]

For each seed, the merged checkpoint of experiment (a)'s run of that seed (`common.recipe_branch`: the SFT
variants from the base's multitask checkpoint, merged) goes through the project's search
(`mindvl_ms.eval.resolution_search.search`, what `mindvl search-resolution` runs) over a min_pixels x
max_pixels grid on the first SEARCH_LIMIT samples of each held-out split (the search's own `limit`; the base's
data: the same samples for every seed). The grid (GRID x GRID, min <= max, in units of 28x28 px) is wide enough that the demo's images
(easy-VQA 64x64, OCR 224x56, grounding 112x112) are resized differently: its five min = max settings give
five different sizes for every image (`check_grid` asserts it on the held-out images before the search;
tests/research/test_scale.py on the demo's sizes). The generation backend is the demo's
(`mindvl_ms.recipes.demo.evaluation.eval_backend`: the processor the demo trained with, no system turn).
Writes results.json, results.md (per setting: the resized sizes, the scores as mean ± sd over seeds, the
verdict against the training resolution (16, 16)) and resolution.png.
"""
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import mindspore as ms  # noqa: E402
from mindvl_ms.data.image import image_size, smart_resize  # noqa: E402
from mindvl_ms.eval.resolution_search import UNIT, grid, search  # noqa: E402
from mindvl_ms.recipes.demo.config import load_demo_config  # noqa: E402
from mindvl_ms.recipes.demo.evaluation import eval_backend  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GRID = (4, 9, 16, 36, 64)      # units of 28x28 px, for min_pixels and max_pixels; training used 16 (12,544 px)
TRAIN = (16, 16)
TASKS = ("vqa", "ocr", "grounding")
SEARCH_LIMIT = 100   # held-out samples per task the search scores (`search(limit=...)`: the first lines)


def resized_sizes(settings, image_sizes):
    """{(min units, max units): ((h, w) per image size)}: what the processor's smart_resize makes of each
    (width, height) in image_sizes at each setting."""
    return {(lo, hi): tuple(smart_resize(h, w, 28, lo * UNIT, hi * UNIT) for w, h in image_sizes)
            for lo, hi in settings}


def check_grid(settings, image_sizes):
    """Raise unless every image size gets at least len(GRID) different resized sizes over the settings (a
    grid whose settings all resize alike cannot show a resolution effect)."""
    sizes = resized_sizes(settings, image_sizes)
    for i, wh in enumerate(image_sizes):
        distinct = {v[i] for v in sizes.values()}
        if len(distinct) < len(GRID):
            raise AssertionError(f"image size {wh}: only {len(distinct)} resized sizes over the grid {settings}")
    return sizes


def heldout_image_sizes(data_files):
    """The distinct (width, height) of the held-out images, read from their headers."""
    out = set()
    for path in data_files:
        with open(path, encoding="utf-8") as f:
            for ln in f:
                for im in json.loads(ln).get("images", []):
                    out.add(image_size(im if os.path.isabs(im) else os.path.join(os.path.dirname(path), im)))
    return sorted(out)


def search_seed(rep, run_cfg, demo, data, out):
    """The search over the grid for one run's merged checkpoint on `data` (a file per task):
    {(min, max): {task: score, average}}."""
    mnt = int(demo["max_new_tokens"])
    res = search([rep["merge"]["checkpoint"]], data, out,
                 backend_factory=lambda c: eval_backend(c, run_cfg.data, mnt), min_grid=GRID, max_grid=GRID,
                 batch_size=int(demo["eval_batch_size"]), max_new_tokens=mnt, limit=SEARCH_LIMIT, progress=False)
    return ({(r["min_pixels"] // UNIT, r["max_pixels"] // UNIT): dict(r["scores"], average=r["average"])
             for r in res["rows"]}, res["caching"])


def search_one(rep, seed, out):
    """search_seed on the held-out splits of `rep` (a recipe branch's report): (scores, caching) of the seed."""
    data_dir = os.path.join(rep["out_dir"], "data")
    run_cfg, demo = load_demo_config(rep["config"], data_dir, [f"seed={seed}"])
    data = [os.path.join(data_dir, f"heldout_{t}.jsonl") for t in TASKS]
    return search_seed(rep, run_cfg, demo, data, out)


def demo_runs(seeds):
    """{label: the call that trains (or reads the cached) demo run}: the recipe branch of each seed."""
    return common.recipe_runs(seeds)


def main():
    args = common.parse_args(__doc__)
    reps = common.in_parallel(list(demo_runs(args.seeds).values()))
    settings = [(lo // UNIT, hi // UNIT) for lo, hi in grid(GRID, GRID)]
    data = [os.path.join(reps[0]["out_dir"], "data", f"heldout_{t}.jsonl") for t in TASKS]  # every seed's: the base's
    image_sizes = heldout_image_sizes(data)
    sizes = check_grid(settings, image_sizes)
    t0 = time.perf_counter()
    # one seed after the other, in this process: a search keeps ~1.5 cores busy, so two at once gain nothing
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    found = [search_one(rep, s, os.path.join(common.OUT, "resolution_search", f"seed{s}"))
             for rep, s in zip(reps, args.seeds)]
    per_seed = [scores for scores, _ in found]
    caching = {s: list(cache.values())[0] for s, (_, cache) in zip(args.seeds, found)}
    wall = time.perf_counter() - t0
    arms = {k: {t: [sc[k][t] for sc in per_seed] for t in TASKS + ("average",)} for k in settings}
    rows = []
    for k in settings:
        rows.append([f"({k[0]}, {k[1]})", " / ".join(f"{w}x{h}" for h, w in sizes[k])]
                    + [common.fmt(arms[k][t]) for t in TASKS + ("average",)]
                    + ["-" if k == TRAIN else common.verdict(arms[k]["average"], arms[TRAIN]["average"])])
    table = common.md_table(["(min, max) units of 28x28 px", "resized " + " / ".join(f"{w}x{h}" for w, h in image_sizes),
                             "VQA EM", "OCR EM", "grounding Acc@0.5", "average", "average: vs (16, 16)"], rows)
    named = {f"({k[0]}, {k[1]})": v for k, v in arms.items()}
    table += (f"\n\nmerged checkpoint of experiment (a)'s run of each seed, held-out % on the first "
              + f"{SEARCH_LIMIT} samples of each task"
              + f", mean ± sample sd over seeds {args.seeds}. "
              + common.effect_sentence(named, f"({TRAIN[0]}, {TRAIN[1]})") + " Caching per seed: "
              + "; ".join(f"seed {s}: {c['generated']} answers generated, {c['reused']} reused"
                          for s, c in caching.items()) + f". Search wall time {wall:.0f}s.\n")
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(9, 3.6))
    for t in TASKS + ("average",):
        m = [100 * np.mean(arms[k][t]) for k in settings]
        e = [100 * np.std(arms[k][t], ddof=1) if len(args.seeds) > 1 else 0 for k in settings]
        ax.errorbar(range(len(settings)), m, yerr=e, capsize=3, marker="o", label=t)
    ax.set_xticks(range(len(settings)), [f"{lo},{hi}" for lo, hi in settings], fontsize=7)
    ax.set_xlabel("(min, max) pixels in units of 28x28")
    ax.set_ylabel("held-out % (mean ± sd)")
    ax.set_title(f"test-time resolution search, merged checkpoints, seeds {args.seeds}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(common.results_dir(HERE), "resolution.png"), dpi=100)
    common.save(HERE, {"seeds": args.seeds, "grid": list(GRID), "image_sizes": image_sizes,
                       "resized": {f"{k[0]},{k[1]}": v for k, v in sizes.items()},
                       "scores": {f"{k[0]},{k[1]}": v for k, v in arms.items()}, "caching": caching,
                       "search_wall_s": wall, "samples_per_task": SEARCH_LIMIT}, table)


if __name__ == "__main__":
    main()
