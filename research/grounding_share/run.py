"""(e) Grounding data share, 1x vs 2x, against grounding and VQA scores (openPangu-VL section 5.2.1,
Figure 4(a): grounding data 7% -> 14% gave > 3 points on RefCOCO, no loss on general VQA).

    python research/grounding_share/run.py [--seeds 0 1 2] [--smoke]

Arms are the SFT stage (its two variants and their merge) trained from the base's multitask checkpoint
(`common.branch`) with each seed, differing only in the mix weight of the grounding source
(data.sources.2.weight; VQA stays at 1.0 and OCR at 2.0), with the same number of optimizer steps, so more
grounding means fewer VQA/OCR samples seen (a share, as in the paper):
  1x  grounding weight 1.0
  2x  grounding weight 2.0 (the demo recipe as is: experiment (a)'s run, `common.recipe_branch`)
Writes results.json, results.md and grounding_share.png (mean ± sd over seeds).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from mindvl_ms.recipes.demo.config import load_demo_config  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = ("vqa", "ocr", "grounding")
ARMS = {"1x": 1.0, "2x": 2.0}


def arm_sets(w):
    return [] if w == 2.0 else [f"data.sources.2.weight={w}"]


def arm_run(arm, seed):
    """2x is the recipe as is (the run experiments (a) and (c) share); 1x its own branch."""
    w = ARMS[arm]
    return common.recipe_branch(seed) if w == 2.0 else common.branch(f"grounding_{arm}", seed, arm_sets(w))


def demo_runs(seeds):
    """{label: the call that trains (or reads the cached) demo run}, arm by arm, seed by seed."""
    return {f"{'sft' if ARMS[a] == 2.0 else 'grounding_' + a}_seed{s}": (lambda a=a, s=s: arm_run(a, s))
            for a in ARMS for s in seeds}


def sample_shares():
    """Each arm's share of samples per task (train sizes x weights)."""

    out = {}
    for a, w in ARMS.items():
        cfg, demo = load_demo_config(common.S.recipe, "/", ["seed=0", *arm_sets(w)])
        n = {t: demo["data_sizes"][t][0] * s.weight for t, s in zip(TASKS, cfg.data.sources)}
        out[a] = {t: n[t] / sum(n.values()) for t in TASKS}
    return out


def main():
    args = common.parse_args(__doc__)
    runs = common.runs_by_arm(list(ARMS), args.seeds, arm_run)
    arms = {}
    for a, rs in runs.items():
        arms[a] = {t: [r["scores"]["merged"][t] for r in rs] for t in TASKS}
        arms[a]["average"] = [float(np.mean([r["scores"]["merged"][t] for t in TASKS])) for r in rs]
    shares = sample_shares()
    base = common.base()
    blind = {t: [base["baselines"][t]["score"]] for t in TASKS}   # one base, one data draw
    table = common.arms_table(arms, TASKS + ("average",), ["VQA EM", "OCR EM", "grounding Acc@0.5", "average"],
                              reference="2x")
    table += "\n" + common.blind_rows(base, TASKS)
    table += (f"\nmerged checkpoint after the SFT stage from the base's multitask checkpoint, held-out %, mean ± "
              f"sample sd over seeds {args.seeds}, same number of optimizer steps per arm; grounding share of the samples: "
              + ", ".join(f"{a} {100 * shares[a]['grounding']:.0f}%" for a in ARMS) + ". "
              + common.effect_sentence(arms, "2x") + " On grounding: "
              + common.verdict(arms["1x"]["grounding"], arms["2x"]["grounding"]) + ".\n")
    common.bar_plot({f"grounding {a} ({100 * shares[a]['grounding']:.0f}% of samples)": m for a, m in arms.items()},
                    TASKS, {t: float(np.mean(v)) for t, v in blind.items()},
                    os.path.join(common.results_dir(HERE), "grounding_share.png"),
                    f"grounding data share, seeds {args.seeds}")
    common.save(HERE, {"seeds": args.seeds, "weights": ARMS, "shares": shares, "baselines": blind,
                       "arms": {a: {"scores": arms[a], "runs": [{"commit": r["commit"], "wall_s": r["wall_s"],
                                                                 "cached": r["cached"], "key": r["key"]}
                                                                for r in runs[a]]} for a in ARMS}}, table)


if __name__ == "__main__":
    main()
