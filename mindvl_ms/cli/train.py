"""`mindvl train --config FILE [--set key=value ...] [--resume DIR] [--out DIR]`.

Runs the stages of a run YAML (see configs/stage/ and `mindvl_ms/config/train.py`), writing
checkpoints, metrics.jsonl, loss/LR plots and summary.json under --out. Under msrun
(`scripts/msrun_train.sh N mindvl train ...`) every worker runs this same command.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train one stage or a chain of stages from a YAML config",
        description="Train MindVL from a run YAML: stages run in order (warm-up -> multitask -> SFT), each "
                    "starting from the previous stage's weights. Writes OUT/<stage>/checkpoint-*, "
                    "OUT/metrics.jsonl, OUT/<stage>/loss_lr.png and OUT/summary.json.",
        epilog="examples:\n  mindvl train --config configs/stage/tiny-cpu.yaml --set 'data.sources=[{path: train.jsonl}]'\n"
               "  mindvl train --config run.yaml --resume runs/x     # continue an interrupted run\n"
               "  scripts/msrun_train.sh 2 mindvl train --config run.yaml   # 2 data-parallel workers",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True,
                   help="run YAML (may `_include_` model/stage/parallel YAMLs); a path that does not exist here "
                        "is looked up in the packaged configs (configs/stage/tiny-cpu.yaml works from any directory)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set stages.0.max_lr=1e-4 --set seed=7 (repeatable)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a run directory (its latest.json) or a checkpoint directory")
    p.add_argument("--resume-allow-data-change", action="store_true",
                   help="with --resume: continue even though the data sources differ from the checkpoint's "
                        "(the change is logged and recorded in trainer_state.json)")
    p.add_argument("--out", default="runs/train", help="output directory (default: runs/train)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs and metrics only)")
    p.add_argument("--no-verify", action="store_true",
                   help="resume (and init_from) without verifying the checkpoint's checksums.json (trusted fast "
                        "paths; the safetensors headers are still checked)")
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    from mindvl_ms.checkpoint.integrity import skip_verification
    from mindvl_ms.config.base import ConfigError
    from mindvl_ms.config.packaged import resolve_config
    from mindvl_ms.infer.rollout import EngineSampler
    from mindvl_ms.train import TrainingStopped, load_run_config, run_training
    from mindvl_ms.ops.process import freeze_imported_objects

    freeze_imported_objects()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_run_config(resolve_config(args.config)[0], args.set)
        with skip_verification(args.no_verify):
            summary = run_training(cfg, args.out, resume=args.resume, progress=not args.no_progress,
                                   allow_data_change=args.resume_allow_data_change, sampler=EngineSampler())
    except ConfigError as e:
        msg = str(e)
        print(f"config error: {msg if msg.startswith(args.config) else f'{args.config}: {msg}'}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in summary.items() if k != "params"}, indent=2, default=str))
    return 0
