"""`mindvl eval` and `mindvl search-resolution` (eval/benchmark.py and eval/resolution_search.py).

    mindvl eval --ckpt DIR --data FILE.jsonl|BENCH.tsv [--metric NAME] [--min-pixels N --max-pixels N] [--out DIR]
    mindvl search-resolution --ckpt DIR [DIR ...] --data FILE [FILE ...] [--save]
"""
from __future__ import annotations

import argparse
import json
import os


_FORMAT = "@BENCHMARK_FORMAT@"  # filled in by _FormatHelp when a help is shown


class _FormatHelp(argparse.HelpFormatter):
    """Writes the benchmark format into a help text when it is shown: the metric names come from
    eval.metrics, which loads the data package: building the parser (`mindvl --help`) must not."""

    def _fill_text(self, text, width, indent):
        if _FORMAT in text:
            from mindvl_ms.eval.metrics import METRICS, TASK_METRIC

            text = text.replace(_FORMAT, (
                "Benchmark files: this project's JSONL or VLMEvalKit's TSV (.tsv: base64 images, options in "
                "columns A, B, ..., VLMEvalKit's prompts and rule-based answer extraction, without its LLM judge). "
                "JSONL lines use the training format; the reference answer is the last assistant turn or an "
                "'answers' list. A 'task' field names the benchmark (default: the file name) and chooses the "
                "metric unless a 'metric' field (or --metric) does. Metrics: " + ", ".join(METRICS) + ". "
                "Defaults by the start of the task or TSV file name: "
                + ", ".join(f"{k}->{v}" for k, v in TASK_METRIC.items()) + "; else exact_match. A TSV with "
                "option columns is circular (rows index + k*1000000 are shifted copies of question index) when "
                "its name contains mmbench, ccbench, circular or mmcr, else multiple_choice. docs/DATA.md has "
                "the details."))
        return super()._fill_text(text, width, indent)


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="score a checkpoint on JSONL or VLMEvalKit TSV benchmarks",
                              description="Batched greedy generation over a benchmark; writes predictions.jsonl "
                                          "and scores.json. " + _FORMAT, formatter_class=_FormatHelp)
    p.add_argument("--ckpt", required=True, help="checkpoint directory")
    p.add_argument("--data", required=True, nargs="+", help="benchmark file(s): JSONL, or VLMEvalKit .tsv")
    p.add_argument("--out", default="eval_out", help="output directory (one subdirectory per file when several)")
    p.add_argument("--min-pixels", type=int, help="smallest resized image area in pixels (default: the checkpoint's "
                                                  "inference_config.json, else preprocessor_config.json, else 3136)")
    p.add_argument("--max-pixels", type=int, help="largest resized image area in pixels (default as --min-pixels; "
                                                  "built-in 1280*28*28)")
    _add_common(p)
    p.set_defaults(func=_run_eval)

    s = subparsers.add_parser(
        "search-resolution", help="test-time grid search over min/max pixels",
        description="Evaluate checkpoints over a min_pixels x max_pixels grid (units of 28x28 pixels), reusing "
                    "vision features and answers where images resize identically. Writes resolution_search.json, "
                    "resolution_table.md and resolution_grid.png (score over the grid per checkpoint and "
                    "benchmark). " + _FORMAT,
        formatter_class=_FormatHelp)
    s.add_argument("--ckpt", required=True, nargs="+", help="checkpoint directories (one plot row per checkpoint)")
    s.add_argument("--data", required=True, nargs="+", help="benchmark file(s): JSONL, or VLMEvalKit .tsv")
    s.add_argument("--out", default="resolution_search", help="output directory")
    s.add_argument("--min-grid", type=int, nargs="+", default=[4, 16, 32, 64],
                   help="min_pixels values in units of 28*28 (default 4 16 32 64)")
    s.add_argument("--max-grid", type=int, nargs="+", default=[1280, 2048, 2560, 3072, 4096, 8192],
                   help="max_pixels values in units of 28*28 (default 1280 2048 2560 3072 4096 8192)")
    s.add_argument("--save", action="store_true",
                   help="write the best-average setting into each checkpoint's inference_config.json")
    s.add_argument("--no-plot", action="store_true", help="skip the PNG")
    _add_common(s)
    s.set_defaults(func=_run_search_resolution)


def _run_eval(args: argparse.Namespace) -> int:
    from mindvl_ms.checkpoint.integrity import skip_verification
    from mindvl_ms.infer.generate import use_graph_mode
    from mindvl_ms.eval.benchmark import evaluate, load_backend
    from mindvl_ms.ops.process import freeze_imported_objects

    freeze_imported_objects()
    use_graph_mode()
    os.makedirs(args.out, exist_ok=True)  # an unwritable output fails before the model is loaded
    with skip_verification(args.no_verify):
        backend = load_backend(args.ckpt, args.max_new_tokens)  # loaded once for all files
    for data in args.data:
        out = args.out if len(args.data) == 1 else os.path.join(args.out, os.path.splitext(os.path.basename(data))[0])
        res = evaluate(args.ckpt, data, out, backend=backend, min_pixels=args.min_pixels, max_pixels=args.max_pixels,
                       batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, limit=args.limit,
                       metric=args.metric, image_dir=args.image_dir)
        print(f"{data}: min_pixels={res['min_pixels']} max_pixels={res['max_pixels']} ({res['pixels_from']})")
        for task, t in res["tasks"].items():
            print(f"  {task} [{t['metric']}]: {100 * t['primary']:.2f}  ({_values(t)})")
            for key in [k for k in t if k.startswith("by_")]:
                for name, sub in t[key].items():
                    print(f"    {key[3:]} {name}: {100 * sub['primary']:.2f}  ({_values(sub)})")
        print(f"  average {100 * res['average']:.2f}; predictions and scores in {out}")
    return 0


def _values(agg: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in agg.items()
                     if k not in ("metric", "primary") and not k.startswith("by_"))


def _run_search_resolution(args: argparse.Namespace) -> int:
    from mindvl_ms.checkpoint.integrity import skip_verification
    from mindvl_ms.infer.generate import use_graph_mode
    from mindvl_ms.eval.resolution_search import search, summary
    from mindvl_ms.ops.process import freeze_imported_objects

    freeze_imported_objects()
    use_graph_mode()
    with skip_verification(args.no_verify):
        res = search(args.ckpt, args.data, args.out, min_grid=args.min_grid, max_grid=args.max_grid,
                     batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, limit=args.limit,
                     save=args.save, plot=not args.no_plot, metric=args.metric, image_dir=args.image_dir)
    print(summary(res))
    print(f"table, scores and plot in {args.out}")
    if args.save:
        for c, b in res["best"].items():
            print(f"saved {json.dumps({k: b['average'][k] for k in ('min_pixels', 'max_pixels')})} "
                  f"to {os.path.join(c, 'inference_config.json')}")
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-verify", action="store_true",
                   help="do not verify the checkpoints' checksums.json (trusted fast paths; the "
                        "safetensors headers are still checked)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per generation batch (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="greedy decoding length limit (default 128)")
    p.add_argument("--limit", type=int, help="use only the first N lines of each file (of a TSV: the first N "
                                             "questions, a circular one with its copies) for quick checks")
    p.add_argument("--metric", help="metric of questions that name none, before the benchmark's default "
                                    "(exact_match, anls, vqa_accuracy, relaxed_accuracy, ocrbench, multiple_choice, "
                                    "circular, ...)")
    p.add_argument("--image-dir", help="where a TSV's base64 images are decoded, once per distinct image "
                                       "(default OUT/images)")
