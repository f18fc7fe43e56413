"""(e) Grounding data share, 1x vs 2x, against grounding and VQA scores (openPangu-VL section 5.2.1,
Figure 4(a): grounding data 7% -> 14% gave > 3 points on RefCOCO, no loss on general VQA).

    python research/grounding_share/run.py

Arms of `mindvl demo --config research/scale.yaml --set seed=0` that differ only in the mix weight of the
grounding source (data.sources.2.weight; VQA and OCR stay at 2.0), with the same number of optimizer
steps, so more grounding means fewer VQA/OCR samples seen (a share, as in the paper):
  1x  grounding weight 1.0
  2x  grounding weight 2.0 (the recipe as is: the seed-0 run of experiment (a))
Writes results.json, results.md and grounding_share.png here.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

TASKS = ("vqa", "ocr", "grounding")
ARMS = {"1x": 1.0, "2x": 2.0}
NAMES = {"1x": "grounding_1x_seed0", "2x": "scale_seed0"}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    runs = {}
    for a, w in ARMS.items():
        sets = ["seed=0"] + ([] if w == 2.0 else [f"data.sources.2.weight={w}"])
        runs[a] = common.demo(NAMES[a], sets)
    from mindvl_ms.recipes.demo.config import load_demo_config

    sizes = {}
    for a, w in ARMS.items():
        cfg, demo = load_demo_config(common.SCALE, "/", ["seed=0", f"data.sources.2.weight={w}"])
        n = {t: demo["data_sizes"][t][0] * s.weight for t, s in zip(TASKS, cfg.data.sources)}
        sizes[a] = {t: n[t] / sum(n.values()) for t in TASKS}
    rows = [[a, f"{100 * sizes[a]['grounding']:.0f}%"] + [common.pct(r["scores"][m][t]) for m in ("merged",)
                                                          for t in TASKS]
            + [" / ".join(common.pct(r["scores"][m]["grounding"]) for m in ("sft_256", "sft_512"))]
            for a, r in runs.items()]
    base = runs["2x"]["baselines"]
    rows.append(["blind baseline", ""] + [common.pct(base[t]["score"]) for t in TASKS] + [""])
    table = common.md_table(["grounding weight", "grounding share of samples", "VQA EM", "OCR EM",
                             "grounding Acc@0.5", "grounding of sft_256 / sft_512"], rows)
    table += "\n\nmerged checkpoint unless noted, held-out %, seed 0, same number of optimizer steps per arm.\n"
    plt = common.plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    w = 0.8 / len(runs)
    for i, (a, r) in enumerate(runs.items()):
        ax.bar(np.arange(len(TASKS)) + (i - 0.5) * w, [100 * r["scores"]["merged"][t] for t in TASKS], w,
               label=f"grounding {a} ({100 * sizes[a]['grounding']:.0f}% of samples)")
    ax.scatter(np.arange(len(TASKS)), [100 * base[t]["score"] for t in TASKS], marker="_", s=600, color="k",
               label="blind baseline", zorder=3)
    ax.set_xticks(range(len(TASKS)), TASKS)
    ax.set_ylabel("held-out % (merged)")
    ax.set_title("grounding data share, seed 0")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(here, "grounding_share.png"), dpi=110)
    common.save(here, {"seed": 0, "weights": ARMS, "shares": sizes,
                       "arms": {a: {"scores": r["scores"], "stages": r["stages"], "wall_s": r["wall_s"],
                                    "commit": r["commit"]} for a, r in runs.items()}, "baselines": base}, table)


if __name__ == "__main__":
    main()
