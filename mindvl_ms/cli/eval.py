"""`mindvl eval` and `mindvl search-resolution` (eval/benchmark.py and eval/resolution_search.py).

    mindvl eval --ckpt DIR --data FILE.jsonl [--min-pixels N --max-pixels N] [--out DIR]
    mindvl search-resolution --ckpt DIR [DIR ...] --data FILE.jsonl [FILE ...] [--save]
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
                "Benchmark lines use the training JSONL format; the reference answer is the last assistant turn "
                "or an 'answers' list. A 'task' field names the benchmark (default: the file name) and chooses "
                "the metric unless a 'metric' field does. Metrics: " + ", ".join(METRICS) + ". Task defaults: "
                + ", ".join(f"{k}->{v}" for k, v in TASK_METRIC.items()) + "."))
        return super()._fill_text(text, width, indent)


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="score a checkpoint on JSONL benchmarks",
                              description="Batched greedy generation over a benchmark; writes predictions.jsonl "
                                          "and scores.json. " + _FORMAT, formatter_class=_FormatHelp)
    p.add_argument("--ckpt", required=True, help="checkpoint directory")
    p.add_argument("--data", required=True, nargs="+", help="benchmark JSONL file(s)")
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
                    "resolution_table.md and a Figure-4 style box plot resolution_boxplot.png. " + _FORMAT,
        formatter_class=_FormatHelp)
    s.add_argument("--ckpt", required=True, nargs="+", help="checkpoint directories (one box per checkpoint)")
    s.add_argument("--data", required=True, nargs="+", help="benchmark JSONL file(s)")
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
    from mindvl_ms.infer.generate import use_graph_mode
    from mindvl_ms.eval.benchmark import evaluate, load_backend

    use_graph_mode()
    os.makedirs(args.out, exist_ok=True)  # an unwritable output fails before the model is loaded
    backend = load_backend(args.ckpt, args.max_new_tokens)  # loaded once for all files
    for data in args.data:
        out = args.out if len(args.data) == 1 else os.path.join(args.out, os.path.splitext(os.path.basename(data))[0])
        res = evaluate(args.ckpt, data, out, backend=backend, min_pixels=args.min_pixels, max_pixels=args.max_pixels,
                       batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, limit=args.limit)
        print(f"{data}: min_pixels={res['min_pixels']} max_pixels={res['max_pixels']} ({res['pixels_from']})")
        for task, t in res["tasks"].items():
            vals = ", ".join(f"{k}={v:.4g}" for k, v in t.items() if k not in ("metric", "primary"))
            print(f"  {task} [{t['metric']}]: {100 * t['primary']:.2f}  ({vals})")
        print(f"  average {100 * res['average']:.2f}; predictions and scores in {out}")
    return 0


def _run_search_resolution(args: argparse.Namespace) -> int:
    from mindvl_ms.infer.generate import use_graph_mode
    from mindvl_ms.eval.resolution_search import search, summary

    use_graph_mode()
    res = search(args.ckpt, args.data, args.out, min_grid=args.min_grid, max_grid=args.max_grid,
                 batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, limit=args.limit, save=args.save,
                 plot=not args.no_plot)
    print(summary(res))
    print(f"table, scores and plot in {args.out}")
    if args.save:
        for c, b in res["best"].items():
            print(f"saved {json.dumps({k: b['average'][k] for k in ('min_pixels', 'max_pixels')})} "
                  f"to {os.path.join(c, 'inference_config.json')}")
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=8, help="samples per generation batch (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="greedy decoding length limit (default 128)")
    p.add_argument("--limit", type=int, help="use only the first N lines of each file (quick checks)")
