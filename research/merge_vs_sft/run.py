"""(a) Merged vs individual SFT variants over 3 seeds (MindVL section 5.3 / 6.3, Table 6).

    python research/merge_vs_sft/run.py            # 3 x `mindvl demo --config research/scale.yaml --set seed=S`

Each seed runs the whole demo pipeline (its own data draw, init, warm-up, multitask, two SFT variants at
256 and 512 tokens per row from the same multitask checkpoint, uniform linear merge with the project's
`checkpoint.merge.merge`, held-out evaluation of sft_256, sft_512 and merged). Writes results.json,
results.md and merge_vs_sft.png here.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

SEEDS = tuple(int(x) for x in os.environ.get("RESEARCH_SEEDS", "0,1,2").split(","))  # partial reruns: RESEARCH_SEEDS=0
MODELS = ("sft_256", "sft_512", "merged")
TASKS = ("vqa", "ocr", "grounding")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    runs = {s: common.demo(f"scale_seed{s}", [f"seed={s}"]) for s in SEEDS}
    scores = {m: {t: [runs[s]["scores"][m][t] for s in SEEDS] for t in TASKS} for m in MODELS}
    for m in MODELS:
        scores[m]["average"] = [float(np.mean([runs[s]["scores"][m][t] for t in TASKS])) for s in SEEDS]
    base = {t: [runs[s]["baselines"][t]["score"] for s in SEEDS] for t in TASKS}
    rows = []
    for m in MODELS:
        rows.append([m] + [f"{100 * np.mean(scores[m][t]):.1f} ± {100 * np.std(scores[m][t], ddof=1):.1f}"
                           for t in TASKS + ("average",)]
                    + [" / ".join(common.pct(x) for x in scores[m]["average"])])
    rows.append(["blind baseline"] + [f"{100 * np.mean(base[t]):.1f}" for t in TASKS] + ["", ""])
    if len(SEEDS) < 2:  # one seed: no spread
        rows = [[r[0]] + [c.split(" ± ")[0] for c in r[1:5]] + r[5:] for r in rows]
    wins = sum(scores["merged"]["average"][i] >= max(scores["sft_256"]["average"][i], scores["sft_512"]["average"][i])
               for i in range(len(SEEDS)))
    table = common.md_table(["model", "VQA EM", "OCR EM", "grounding Acc@0.5", "average", "average per seed (0/1/2)"],
                            rows)
    table += (f"\n\nmean ± sample std over seeds {list(SEEDS)} (held-out %); merged >= both variants on the average in "
              f"{wins}/{len(SEEDS)} seeds.\n")
    plt = common.plt()
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.4), sharey=False)
    for ax, t in zip(axes, TASKS + ("average",)):
        for i, m in enumerate(MODELS):
            v = 100 * np.asarray(scores[m][t])
            ax.bar(i, v.mean(), yerr=v.std(ddof=1), capsize=4, color=("#8da0cb", "#66c2a5", "#fc8d62")[i])
            ax.scatter(np.full(len(v), i) + np.linspace(-0.12, 0.12, len(v)), v, color="k", s=12, zorder=3)
        if t != "average":
            ax.axhline(100 * np.mean(base[t]), color="grey", ls="--", lw=1, label="blind baseline")
        ax.set_xticks(range(len(MODELS)), MODELS)
        ax.set_title(t)
        ax.set_ylabel("held-out %")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"merged vs individual SFT variants, seeds {list(SEEDS)} (bars: mean ± std, dots: seeds)")
    fig.tight_layout()
    fig.savefig(os.path.join(here, "merge_vs_sft.png"), dpi=110)
    common.save(here, {"seeds": list(SEEDS), "scores": scores, "baselines": base, "merged_best_in": wins,
                       "runs": {s: {"wall_s": runs[s]["wall_s"], "cached": runs[s]["cached"],
                                    "commit": runs[s]["commit"], "stages": runs[s]["stages"],
                                    "out_dir": runs[s]["out_dir"]} for s in SEEDS}}, table)


if __name__ == "__main__":
    main()
