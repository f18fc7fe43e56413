"""The demo's evaluation phase alone, timed: `recipes.demo.evaluation.evaluate_phase` (every SFT variant and
the merged checkpoint on the three held-out splits, then the resolution search on the OCR split of merged)
on a finished `mindvl demo` run directory, in this process, with the run's own config, data and checkpoints.

    python bench/time_demo_eval.py RUN [--out DIR]

Prints the phase's wall time and the held-out scores (they must equal those of RUN/report.json). Predictions
go to DIR (default: a temporary directory), so the run directory is not touched; compare two trees' DIRs
file by file to check that a change leaves every prediction as it was.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mindspore as ms  # noqa: E402

from mindvl_ms.recipes.demo.config import load_demo_config  # noqa: E402
from mindvl_ms.recipes.demo.evaluation import evaluate_phase  # noqa: E402

TASKS = ("vqa", "ocr", "grounding")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a finished `mindvl demo --out RUN` directory (report.json, data/, merged/)")
    ap.add_argument("--out", default=None, help="where the predictions go (default: a temporary directory)")
    args = ap.parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    with open(os.path.join(args.run, "report.json"), encoding="utf-8") as f:
        rep = json.load(f)
    run_cfg, demo = load_demo_config(rep["config"], os.path.join(args.run, "data"), vocab_subset=True)
    heldout = {t: os.path.join(args.run, "data", f"heldout_{t}.jsonl") for t in TASKS}
    variants = {os.path.basename(os.path.dirname(i["path"])): i["path"] for i in rep["merge"]["inputs"]}
    ckpts = dict(variants if demo.get("eval_variants", True) else {}, merged=rep["merge"]["checkpoint"])
    out = args.out or tempfile.mkdtemp(prefix="demo_eval_")
    t0 = time.perf_counter()
    scores, found = evaluate_phase(ckpts, heldout, run_cfg.data, demo, out, progress=False)
    wall = time.perf_counter() - t0
    same = all(abs(scores[n][t] - rep["scores"][n][t]) < 1e-12 for n in scores for t in scores[n])
    print(json.dumps(scores))
    print(f"resolution search best {found['best_score']:.4f}; predictions in {out}")
    print(f"evaluation phase: {wall:.1f} s for {len(ckpts)} checkpoints; scores equal RUN/report.json's: {same}")


if __name__ == "__main__":
    main()
