"""(c) Balanced vs token-mean loss on a mix whose answer lengths differ by task (openPangu-VL section 4.4,
equation 1; Figure 4(c), section 5.2.2 Observation 2).

    python research/balanced_loss/run.py [--seeds 0 1 2] [--smoke]

Every arm is the SFT stage (its two variants and their merge) trained from the base's multitask checkpoint
(`common.branch`: the base is `mindvl demo --set seed=0`, trained once) with each seed, the loss set on
that stage (the variants inherit it):
  token_mean                 stage.loss.type: token_mean
  balanced (1,1)             eq. 1 with both terms, tau1 0.1, tau2 2 (the defaults)
  balanced (0,1)             the per-sample term only (the demo recipe as is: experiment (a)'s run)
  balanced (1,1), tau=0      both terms with tau1 = tau2 = 0: every token weight is the same constant, so the
                             loss is the token mean + the mean of per-sample means (no order or magnitude
                             re-weighting; tests/research/test_balanced_arm.py checks this against numpy)
The mix: easy-VQA (one-word answers), OCR (one word) and grounding (a box: ~20 tokens). Also measures the
answer length per task (tokens, with the project's tokenizer) and each task's share of the supervised
tokens. Writes results.json, results.md and balanced_loss.png (mean ± sd over seeds).
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from mindvl_ms.data.tokenizer import load_tokenizer  # noqa: E402
from mindvl_ms.recipes.demo.config import load_demo_config  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = ("vqa", "ocr", "grounding")


def loss_sets(**loss):
    """--set lines for the branch's one stage (index 0: the SFT stage with its variants)."""
    return [f"stages.0.loss.{k}={v}" for k, v in loss.items()]


ARMS = {"token_mean": loss_sets(type="token_mean"),
        "balanced (1,1)": loss_sets(type="balanced", lambda1=1.0, lambda2=1.0),
        "balanced (0,1)": None,   # the recipe's own loss: common.recipe_branch
        "balanced (1,1), tau=0": loss_sets(type="balanced", lambda1=1.0, lambda2=1.0, tau1=0.0, tau2=0.0)}
SLUGS = {"token_mean": "loss_token_mean", "balanced (1,1)": "loss_balanced_11", "balanced (0,1)": "loss_balanced_01",
         "balanced (1,1), tau=0": "loss_balanced_11_tau0"}


def answer_lengths(data_dir):
    tok = load_tokenizer().tok
    out = {}
    for t in TASKS:
        with open(os.path.join(data_dir, f"train_{t}.jsonl"), encoding="utf-8") as f:
            lens = [len(tok.encode(json.loads(ln)["messages"][-1]["content"]).ids) + 2  # + <|im_end|> and \n
                    for ln in f]
        out[t] = {"mean": float(np.mean(lens)), "min": int(min(lens)), "max": int(max(lens)), "n": len(lens)}
    return out


def arm_run(arm, seed):
    """An arm's run of a seed: the recipe's shared branch for the recipe's loss, else its own branch."""
    sets = ARMS[arm]
    return common.recipe_branch(seed) if sets is None else common.branch(SLUGS[arm], seed, sets)


def demo_runs(seeds):
    """{label: the call that trains (or reads the cached) demo run}, arm by arm, seed by seed."""
    return {f"{'sft' if ARMS[a] is None else SLUGS[a]}_seed{s}": (lambda a=a, s=s: arm_run(a, s))
            for a in ARMS for s in seeds}


def scores(runs):
    """{task and average: [per seed]} of the merged checkpoint."""
    out = {t: [r["scores"]["merged"][t] for r in runs] for t in TASKS}
    out["average"] = [float(np.mean([r["scores"]["merged"][t] for t in TASKS])) for r in runs]
    return out


def main():
    args = common.parse_args(__doc__)
    runs = common.runs_by_arm(list(ARMS), args.seeds, arm_run)
    arms = {a: scores(rs) for a, rs in runs.items()}
    base = common.base()
    lens = answer_lengths(os.path.join(base["out_dir"], "data"))
    cfg, _ = load_demo_config(common.S.recipe, "/")
    weight = {t: s.weight for t, s in zip(TASKS, cfg.data.sources)}   # the recipe's mix weights
    tot = sum(lens[t]["mean"] * lens[t]["n"] * weight[t] for t in TASKS)
    share = {t: lens[t]["mean"] * lens[t]["n"] * weight[t] / tot for t in TASKS}
    blind = {t: [base["baselines"][t]["score"]] for t in TASKS}   # one base, one data draw
    table = common.arms_table(arms, TASKS + ("average",), ["VQA EM", "OCR EM", "grounding Acc@0.5", "average"],
                              reference="token_mean")
    table += "\n" + common.blind_rows(base, TASKS)
    table += (f"\nmerged checkpoint after the SFT stage from the base's multitask checkpoint, held-out %, mean ± "
              f"sample sd over seeds {args.seeds}. " + common.effect_sentence(arms, "token_mean")
              + " Supervised answer tokens per sample (incl. <|im_end|>): "
              + ", ".join(f"{t} {lens[t]['mean']:.1f} ({lens[t]['min']}-{lens[t]['max']})" for t in TASKS)
              + "; share of the supervised tokens in the train mix (source weights "
              + ", ".join(f"{t} {weight[t]:g}" for t in TASKS) + "): "
              + ", ".join(f"{t} {100 * share[t]:.0f}%" for t in TASKS) + ".\n")
    common.bar_plot(arms, TASKS, {t: float(np.mean(v)) for t, v in blind.items()},
                    os.path.join(common.results_dir(HERE), "balanced_loss.png"),
                    f"token-mean vs balanced loss (openPangu-VL eq. 1), seeds {args.seeds}")
    common.save(HERE, {"seeds": args.seeds, "arms": {a: {"sets": ARMS[a], "scores": arms[a],
                                                         "runs": [{"commit": r["commit"], "wall_s": r["wall_s"],
                                                                   "cached": r["cached"], "key": r["key"]}
                                                                  for r in runs[a]]} for a in ARMS},
                       "answer_tokens": lens, "token_share": share, "baselines": blind}, table)


if __name__ == "__main__":
    main()
