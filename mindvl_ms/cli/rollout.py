"""`mindvl rollout`: sample k answers per prompt, score them with a verifier, write preference pairs."""
from __future__ import annotations

import argparse
import json
import logging


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "rollout", help="sample k answers per prompt, score them with a verifier, write preference pairs",
        description="Sample k candidates per RL prompt line (messages + images + answer [+ reward]) with the "
                    "KV-cache engine, score each with a verifier, and write a preference pair (chosen above "
                    "--high, rejected below --low) for every prompt that has both. The output is a DPO "
                    "stage's data.sources file.",
        epilog="example:\n  mindvl rollout --ckpt runs/x/sft/checkpoint-000100 --data prompts.jsonl "
               "--out pairs.jsonl -k 4 --reward grounding_iou",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint directory (native or HF)")
    p.add_argument("--data", required=True, help="RL prompt JSONL (see `mindvl data validate`)")
    p.add_argument("--out", required=True, help="preference JSONL to write")
    p.add_argument("-k", type=int, default=4, help="candidates per prompt (default 4, as the report)")
    p.add_argument("--reward", default="exact_match",
                   help="verifier when a line names none: exact_match, numeric, grounding_iou, boxed_format "
                        "or package.module:function (default exact_match)")
    p.add_argument("--format-weight", type=float, default=0.0, help="add this x the \\boxed{} format reward")
    p.add_argument("--high", type=float, default=0.75, help="chosen must score above this (default 0.75)")
    p.add_argument("--low", type=float, default=0.25, help="rejected must score below this (default 0.25)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: seed, line index)")
    p.set_defaults(func=_run_rollout)


def _run_rollout(args) -> int:
    from mindvl_ms.data.preference import read_post_file
    from mindvl_ms.infer.generate import load_model, load_processor, use_graph_mode
    from mindvl_ms.infer.rollout import rollout_pairs, write_pairs
    from mindvl_ms.ops.process import freeze_imported_objects
    from mindvl_ms.train.post.rewards import Verifier

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.k < 2:
        raise ValueError(f"-k {args.k}: a pair needs at least 2 candidates")
    if args.low > args.high:
        raise ValueError(f"--low {args.low} is above --high {args.high}")
    verifier = Verifier(args.reward, 1.0, args.format_weight)
    prompts = read_post_file(args.data, "prompt")
    freeze_imported_objects()
    use_graph_mode()
    model = load_model(args.ckpt)
    proc = load_processor(args.ckpt, model.config)
    lines, summary = rollout_pairs(model, proc, prompts, verifier, args.k, args.seed, args.max_new_tokens,
                                   args.temperature, args.top_p, args.high, args.low, progress=True)
    write_pairs(lines, args.out)
    summary["out"] = args.out
    print(json.dumps(summary, indent=2))
    return 0
