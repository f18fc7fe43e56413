"""(c) Balanced vs token-mean loss on a mix whose answer lengths differ by task (openPangu-VL section 4.4,
equation 1; Figure 4(c), section 5.2.2 Observation 2).

    python research/balanced_loss/run.py

Three arms of `mindvl demo --config research/scale.yaml --set seed=0`, the loss set on every stage:
  token_mean           the recipe as is (stage.loss.type: token_mean) - the seed-0 run of experiment (a)
  balanced (1, 1)      stage.loss = {type: balanced, lambda1: 1, lambda2: 1}: eq. 1 with both terms
  balanced (0, 1)      stage.loss = {type: balanced, lambda1: 0, lambda2: 1}: per-sample term only (the
                       full demo recipe's choice)
The mix: easy-VQA (one-word answers), OCR (one word) and grounding (a box: ~20 tokens). Also measures the
answer length per task (tokens, with the project's tokenizer) and each task's share of the supervised
tokens. Writes results.json, results.md and balanced_loss.png here.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

TASKS = ("vqa", "ocr", "grounding")
STAGES = 3  # warmup, multitask, sft (its two variants inherit the stage's loss)


def loss_sets(l1, l2):
    return [f"stages.{i}.loss.{k}={v}" for i in range(STAGES)
            for k, v in (("type", "balanced"), ("lambda1", l1), ("lambda2", l2))]


ARMS = {"token_mean": [], "balanced (1,1)": loss_sets(1.0, 1.0), "balanced (0,1)": loss_sets(0.0, 1.0)}
NAMES = {"token_mean": "scale_seed0", "balanced (1,1)": "loss_balanced_11_seed0",
         "balanced (0,1)": "loss_balanced_01_seed0"}


def answer_lengths(data_dir):
    from mindvl_ms.data.tokenizer import load_tokenizer

    tok = load_tokenizer().tok
    out = {}
    for t in TASKS:
        with open(os.path.join(data_dir, f"train_{t}.jsonl"), encoding="utf-8") as f:
            lens = [len(tok.encode(json.loads(ln)["messages"][-1]["content"]).ids) + 2  # + <|im_end|> and \n
                    for ln in f]
        out[t] = {"mean": float(np.mean(lens)), "min": int(min(lens)), "max": int(max(lens)), "n": len(lens)}
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    runs = {a: common.demo(NAMES[a], ["seed=0"] + s) for a, s in ARMS.items()}
    lens = answer_lengths(os.path.join(runs["token_mean"]["out_dir"], "data"))
    tot = sum(lens[t]["mean"] * lens[t]["n"] for t in TASKS)
    share = {t: lens[t]["mean"] * lens[t]["n"] / tot for t in TASKS}
    rows = [[a] + [common.pct(r["scores"]["merged"][t]) for t in TASKS]
            + [common.pct(float(np.mean([r["scores"]["merged"][t] for t in TASKS]))),
               f"{r['stages']['multitask']['final_loss']:.3f}"] for a, r in runs.items()]
    base = runs["token_mean"]["baselines"]
    rows.append(["blind baseline"] + [common.pct(base[t]["score"]) for t in TASKS] + ["", ""])
    table = common.md_table(["loss (lambda1, lambda2)", "VQA EM", "OCR EM", "grounding Acc@0.5", "average",
                             "multitask final loss (own objective)"], rows)
    table += ("\n\nmerged checkpoint, held-out %, seed 0. Supervised answer tokens per sample (incl. <|im_end|>): "
              + ", ".join(f"{t} {lens[t]['mean']:.1f} ({lens[t]['min']}-{lens[t]['max']})" for t in TASKS)
              + "; share of the supervised tokens in the train mix (weights equal): "
              + ", ".join(f"{t} {100 * share[t]:.0f}%" for t in TASKS) + ".\n")
    plt = common.plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    w = 0.8 / len(runs)
    for i, (a, r) in enumerate(runs.items()):
        ax.bar(np.arange(len(TASKS)) + (i - 1) * w, [100 * r["scores"]["merged"][t] for t in TASKS], w, label=a)
    ax.scatter(np.arange(len(TASKS)), [100 * base[t]["score"] for t in TASKS], marker="_", s=600, color="k",
               label="blind baseline", zorder=3)
    ax.set_xticks(range(len(TASKS)), [f"{t}\n({lens[t]['mean']:.0f} answer tokens)" for t in TASKS])
    ax.set_ylabel("held-out % (merged)")
    ax.set_title("token-mean vs balanced loss (openPangu-VL eq. 1), seed 0")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(here, "balanced_loss.png"), dpi=110)
    common.save(here, {"seed": 0, "arms": {a: {"sets": ARMS[a], "scores": r["scores"], "stages": r["stages"],
                                               "wall_s": r["wall_s"], "commit": r["commit"]}
                                           for a, r in runs.items()},
                       "answer_tokens": lens, "token_share": share, "baselines": base}, table)


if __name__ == "__main__":
    main()
