"""(b) Test-time resolution search (MindVL section 5.4 and 6.3, Figure 4).

    python research/resolution_search/run.py

Takes the three checkpoints of the seed-0 run of experiment (a) (`mindvl demo --config research/scale.yaml
--set seed=0`, trained if missing) and runs the project's search (`mindvl_ms.eval.resolution_search.search`,
what `mindvl search-resolution` runs) over a min_pixels x max_pixels grid on all three held-out splits. The
generation backend is the demo's (`mindvl_ms.recipes.demo.evaluation.eval_backend`: the processor the demo trained with,
no system turn), as `mindvl demo` itself does for its search. Writes results.json, results.md,
resolution_grid.png (the project's plot: per checkpoint and benchmark, a heatmap of the score over the grid)
and resolution_table.md here.
"""
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

MIN_GRID = (1, 4, 16)          # units of 28x28 pixels; training used 16 (12,544 px) for every image
MAX_GRID = (4, 8, 16, 32, 64)


def main():
    import mindspore as ms

    from mindvl_ms.recipes.demo.config import load_demo_config
    from mindvl_ms.recipes.demo.evaluation import eval_backend
    from mindvl_ms.eval.resolution_search import UNIT, search

    here = os.path.dirname(os.path.abspath(__file__))
    rep = common.demo("scale_seed0", ["seed=0"])
    run_dir = rep["out_dir"]
    run_cfg, demo = load_demo_config(common.SCALE, os.path.join(run_dir, "data"), ["seed=0"])
    out = os.path.join(common.OUT, "resolution_search")
    links = os.path.join(out, "ckpts")          # the plot labels a checkpoint by its directory name
    os.makedirs(links, exist_ok=True)
    srcs = {os.path.basename(os.path.dirname(os.path.dirname(i["path"]))): i["path"] for i in rep["merge"]["inputs"]}
    srcs["merged"] = rep["merge"]["checkpoint"]
    ckpts = []
    for name, src in srcs.items():
        dst = os.path.join(links, name)
        if os.path.islink(dst):
            os.unlink(dst)
        os.symlink(os.path.abspath(src), dst)
        ckpts.append(dst)
    data = [os.path.join(run_dir, "data", f"heldout_{t}.jsonl") for t in ("vqa", "ocr", "grounding")]
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    mnt = int(demo["max_new_tokens"])
    import time
    t0 = time.perf_counter()
    res = search(ckpts, data, out, backend_factory=lambda c: eval_backend(c, run_cfg.data, mnt), min_grid=MIN_GRID,
                 max_grid=MAX_GRID, batch_size=int(demo["eval_batch_size"]), max_new_tokens=mnt, progress=False)
    wall = time.perf_counter() - t0
    for f in ("resolution_grid.png", "resolution_table.md"):
        shutil.copy(os.path.join(out, f), os.path.join(here, f))
    tasks = sorted(res["rows"][0]["scores"])
    rows = []
    summary = {}
    for c in ckpts:
        name = os.path.basename(c)
        mine = [r for r in res["rows"] if r["checkpoint"] == c]
        summary[name] = {}
        for t in tasks + ["average"]:
            v = np.array([r["scores"][t] if t != "average" else r["average"] for r in mine])
            summary[name][t] = {"min": float(v.min()), "median": float(np.median(v)), "max": float(v.max())}
        at_train = [r for r in mine if r["min_pixels"] == r["max_pixels"] == 16 * UNIT][0]
        b = res["best"][c]["average"]
        rows.append([name] + [" / ".join(common.pct(summary[name][t][k]) for k in ("min", "median", "max"))
                              for t in tasks + ["average"]]
                    + [common.pct(at_train["average"]),
                       f"{common.pct(b['score'])} at ({b['min_pixels'] // UNIT}, {b['max_pixels'] // UNIT})"])
    table = common.md_table(["checkpoint"] + [f"{t} min/median/max" for t in tasks] + ["average min/median/max",
                            "average at training res (16,16)", "best average at (min, max)"], rows)
    table += (f"\n\n{len(res['rows']) // len(ckpts)} grid settings per checkpoint (min {list(MIN_GRID)} x max "
              f"{list(MAX_GRID)} in units of 28x28 px, min <= max); held-out %, seed 0. Caching: "
              + "; ".join(f"{os.path.basename(k)}: {v['generated']} answers generated, {v['reused']} reused"
                          for k, v in res["caching"].items()) + f". Search wall time {wall:.0f}s.\n")
    common.save(here, {"seed": 0, "min_grid": list(MIN_GRID), "max_grid": list(MAX_GRID), "summary": summary,
                       "best": {os.path.basename(k): v for k, v in res["best"].items()},
                       "rows": [{k: (os.path.basename(v) if k == "checkpoint" else v) for k, v in r.items()
                                 if k != "details"} for r in res["rows"]],
                       "caching": {os.path.basename(k): v for k, v in res["caching"].items()},
                       "search_wall_s": wall, "train_run": {"commit": rep["commit"], "wall_s": rep["wall_s"]}},
                table)


if __name__ == "__main__":
    main()
