"""`mindvl merge`: weight averaging and friends (see mindvl_ms/checkpoint/merge.py for the maths).

    mindvl merge RUN_2K RUN_4K RUN_8K --out merged
    mindvl merge SFT --base LLM --method task_arithmetic --only model.layers --out merged
"""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "merge", help="average checkpoints (linear, task arithmetic, TIES)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Merge checkpoints tensor by tensor, streamed in small chunks merged on two threads (memory stays far "
                    "below one checkpoint).\n\n"
                    "linear:           sum w_i ckpt_i / sum w_i  (weights default to 1, i.e. a uniform average)\n"
                    "task_arithmetic:  base + scale * sum w_i (ckpt_i - base)  (weights default to 1/N)\n"
                    "ties:             base + scale * TIES(ckpt_i - base): keep the top --density fraction of\n"
                    "                  each task vector by magnitude, elect a sign per element, average the\n"
                    "                  values agreeing with it (weighted by w_i, default 1)\n\n"
                    "All inputs must hold the same keys, shapes and dtypes (differences are listed). The output\n"
                    "is a checkpoint directory like the first input (same shards unless one is over --max-shard-mb,\n"
                    "config.json and other files) "
                    "with a merge_record.json. Works on native and Hugging Face Qwen2.5-VL directories.",
        epilog="examples:\n"
               "  mindvl merge sft_2k sft_4k sft_8k --out mindvl_merged\n"
               "  mindvl merge sft_4k --base deepseek_v3 --method task_arithmetic --weights 0.5 "
               "--only model.layers --out merged")
    p.add_argument("ckpts", nargs="+", metavar="CKPT", help="checkpoint directories (or .safetensors files)")
    p.add_argument("--out", required=True, help="output checkpoint directory (must not exist or be empty)")
    p.add_argument("--method", choices=["linear", "task_arithmetic", "ties"], default="linear",
                   help="merging rule (default: linear)")
    p.add_argument("--weights", type=float, nargs="+", help="one weight per CKPT (see above for defaults)")
    p.add_argument("--base", help="base checkpoint for task_arithmetic and ties")
    p.add_argument("--density", type=float, default=0.2, help="ties: fraction of each task vector kept (default 0.2)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="task_arithmetic/ties: factor on the merged task vector (default 1)")
    p.add_argument("--only", nargs="+", metavar="PREFIX",
                   help="merge only tensors whose name starts with a PREFIX (e.g. model.layers); "
                        "the rest is copied from the first CKPT")
    p.add_argument("--max-shard-mb", type=float, default=2048,
                   help="an output file over this many MiB is regrouped into Hugging Face-named shards with an "
                        "index (default 2048; 0: keep the first CKPT's files as they are)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-verify", action="store_true",
                   help="do not verify the checkpoints' checksums.json (trusted fast paths; the "
                        "safetensors headers are still checked)")
    p.set_defaults(func=_run_merge)


def _run_merge(args: argparse.Namespace) -> int:
    from mindvl_ms.checkpoint.integrity import skip_verification
    from mindvl_ms.checkpoint.merge import merge

    with skip_verification(args.no_verify):
        rec = merge(args.ckpts, args.out, method=args.method, weights=args.weights, base=args.base,
                    density=args.density, scale=args.scale, only=args.only, overwrite=args.overwrite,
                    progress=not args.quiet, max_shard_bytes=int(args.max_shard_mb * 2 ** 20) or None)
    ws = ", ".join(f"{i['path']} x {i['weight']:g}" for i in rec["inputs"])
    print(f"merged ({rec['method']}) {ws} -> {args.out}: {rec['merged_tensors']} tensors merged, "
          f"{rec['copied_tensors']} copied from the first input")
    return 0
