"""`mindvl demo [--out DIR] [--quick] [--seeds S ...]`: the tiny three-stage MindVL example, end to end on CPU.

MindSpore is imported inside the handler so `mindvl --help` stays fast.
"""
from __future__ import annotations

import argparse
import logging
import sys

DESCRIPTION = """\
Train a tiny MindVL from scratch (real Qwen3 tokenizer, 2-block ViT, 4-layer Qwen3 decoder) and score
it against image-blind baselines:
  1. data      easy-VQA questions/images (the easy_vqa package), plus generated OCR images (words
               rendered with DejaVu Sans Mono) and grounding images (coloured shapes; answers as
               <|box_start|>(x1,y1),(x2,y2)<|box_end|>, coordinates 0..999); train and held-out splits
  2. warm-up   projector only
  3. multitask all parameters, all tasks
  4. SFT       two variants at different sequence lengths and pixel budgets, each from the multitask
               checkpoint (the sft stage's `variants`, as MindVL's 2K/4K/8K SFT)
  5. merge     uniform weight averaging of the SFT variants into OUT/merged, by the trainer (`merge:`)
  6. evaluate  greedy generation on the held-out splits: easy-VQA exact match (vs the majority-answer
               baseline), OCR exact match and grounding Acc@IoU0.5 (vs chance: the best image-blind
               constant answer); merged vs individual SFT scores; a small test-time resolution search
               on the OCR split
Prints per-stage loss, the accuracy table and where the artefacts are; everything is also in
OUT/report.json. A full run takes 16 to 24 minutes on 2 idle CPU cores, depending on the CPU, --quick
about a minute (measured times: docs/DEMO.md and docs/PERFORMANCE.md).

--post-train then post-trains OUT/merged as openPangu-VL does after SFT (rollout -> DPO -> GRPO with the
box-IoU reward on new grounding images) and scores held-out grounding before and after
(configs/demo/post_train.yaml; OUT/post/post_report.json)."""

EPILOG = """\
examples:
  mindvl demo                       # full run into runs/demo
  mindvl demo --quick --out /tmp/d  # the CI-sized run
  mindvl demo --set stages.1.max_lr=2e-3 --set seed=1   # change the recipe (configs/demo/full.yaml)
  mindvl demo --seeds 0 1 2 --out runs/seeds   # one run per seed (runs/seeds/seed_<s>), the per-seed table
  mindvl demo --post-train          # then DPO -> GRPO on runs/demo/merged (configs/demo/post_train.yaml)"""


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="tiny MindVL: warm-up -> multitask -> SFT -> merge -> evaluate on CPU",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    p.add_argument("--quick", action="store_true",
                   help="small data and few steps (configs/demo/quick.yaml): checks the pipeline, does not "
                        "train long enough to beat the baselines reliably")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="demo YAML (default: configs/demo/full.yaml, or quick.yaml with --quick)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run-config value, e.g. --set stages.1.epochs=2 (repeatable)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, metavar="S",
                   help="run the demo once per seed, one after the other, each into OUT/seed_<S> (its own data: the "
                        "seed draws it), then print the merged checkpoint's scores per seed against the targets, "
                        "with mean, sd and min over seeds (also OUT/seeds.json)")
    p.add_argument("--post-train", action="store_true",
                   help="post-train OUT/merged of a finished demo with the same --out: rollout -> DPO -> GRPO "
                        "on grounding, held-out scores before and after (configs/demo/post_train.yaml)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mindvl_ms.config.base import ConfigError  # after the logging set-up: imports may log
    from mindvl_ms.recipes.demo.post import run_post_train
    from mindvl_ms.recipes.demo.run import run_demo
    from mindvl_ms.recipes.demo.seeds import run_seeds

    try:
        if args.seeds is not None and args.post_train:
            raise ConfigError("--post-train takes one finished demo (--out), not --seeds")
        if args.seeds is not None:
            run_seeds(args.out, args.seeds, quick=args.quick, config=args.config, overrides=args.set,
                      progress=not args.no_progress)
        elif args.post_train:
            if args.quick:
                raise ConfigError("--post-train takes the run's own YAML (--config), not --quick")
            run_post_train(args.out, config=args.config, overrides=args.set, progress=not args.no_progress)
        else:
            run_demo(args.out, quick=args.quick, config=args.config, overrides=args.set,
                     progress=not args.no_progress)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0
