"""(a) Merged vs individual SFT variants (MindVL section 5.3 / 6.3, Table 6).

    python research/merge_vs_sft/run.py [--seeds 0 1 2] [--smoke]

For each seed, `common.recipe_branch`: the demo recipe's `sft` stage trained from the base's multitask
checkpoint (`common.base`: `mindvl demo --set seed=0`, trained once) with that seed, its two variants
branched from the checkpoint by the trainer (the stage's `variants`, RunConfig.schedule()) and differing as
MindVL's do, in row length AND pixel budget: sft_256 (rows of 256, every image at 3,136 px) and sft_512
(rows of 512, 12,544 px); then their uniform linear merge (`merge:`) and the held-out evaluation (500 VQA /
300 OCR / 300 grounding) of sft_256, sft_512 and merged. Writes results.json, results.md and
merge_vs_sft.png (mean ± sd over seeds).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("sft_256", "sft_512", "merged")
TASKS = ("vqa", "ocr", "grounding")


def demo_runs(seeds):
    """{label: the call that trains (or reads the cached) demo run}: the recipe branch of each seed."""
    return common.recipe_runs(seeds)


def main():
    args = common.parse_args(__doc__)
    runs = common.in_parallel(list(demo_runs(args.seeds).values()))
    base = common.base()
    arms = {}
    for m in MODELS:
        arms[m] = {t: [r["scores"][m][t] for r in runs] for t in TASKS}
        arms[m]["average"] = [float(np.mean([r["scores"][m][t] for t in TASKS])) for r in runs]
    blind = {t: [base["baselines"][t]["score"]] for t in TASKS}   # one base, one data draw
    wins = sum(arms["merged"]["average"][i] >= max(arms["sft_256"]["average"][i], arms["sft_512"]["average"][i])
               for i in range(len(runs)))
    table = common.arms_table(arms, TASKS + ("average",), ["VQA EM", "OCR EM", "grounding Acc@0.5", "average"],
                              reference="merged")
    table += "\n" + common.blind_rows(base, TASKS)
    table += (f"\nheld-out %, mean ± sample sd over seeds {args.seeds}; average per seed: "
              + "; ".join(f"{m} " + " / ".join(common.pct(x) for x in arms[m]["average"]) for m in MODELS)
              + f". merged >= both variants on the average in {wins}/{len(runs)} seeds. "
              + common.effect_sentence(arms, "merged") + " The base run itself (the demo, seed 0, its own SFT "
              + "stage at 12,544 px for both variants), average: " + "; ".join(
                  f"{m} {common.pct(np.mean([base['scores'][m][t] for t in TASKS]))}" for m in MODELS
                  if m in base["scores"]) + ".\n")
    common.bar_plot(arms, TASKS + ("average",), None, os.path.join(common.results_dir(HERE), "merge_vs_sft.png"),
                    f"merged vs individual SFT variants, seeds {args.seeds}")
    common.save(HERE, {"seeds": args.seeds, "scores": arms, "baselines": blind, "merged_best_in": wins,
                       "base": {k: base[k] for k in ("commit", "key", "wall_s", "cached", "out_dir")},
                       "runs": {s: {"wall_s": r["wall_s"], "cached": r["cached"], "commit": r["commit"],
                                    "key": r["key"], "stages": r["stages"], "out_dir": r["out_dir"]}
                                for s, r in zip(args.seeds, runs)}}, table)


if __name__ == "__main__":
    main()
