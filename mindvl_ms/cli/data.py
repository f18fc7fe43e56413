"""`mindvl data validate`, `mindvl data pack` and `mindvl data convert`.

Flags override the YAML given with --config (its `data:` section, or top-level DataConfig keys).
Both commands are host-side work only.
"""
from __future__ import annotations

import argparse
import json
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="validate, pack and convert training data",
                              description="Data tools: `validate` checks a JSONL file; `pack` packs it offline "
                                          "into per-rank shards with a manifest; `convert` turns LLaVA, ShareGPT "
                                          "or parquet data into this project's JSONL.")
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda _args: p.print_help() or 0)  # `mindvl data` alone: its help

    v = sub.add_parser("validate", help="schema, image and grounding checks with line numbers",
                       description="Check every line: JSON schema, <image> count vs images, missing/corrupt/blank "
                                   "images, minimum resolution, aspect ratio, image_sizes metadata, grounding tags "
                                   "(balanced, integer coordinates 0..999). Exits 1 when errors remain.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    v.add_argument("file", help="JSONL file (image paths relative to it)")
    v.add_argument("--config", help="YAML with a data: section (image limits: data.image.min_side, max_aspect_ratio)")
    v.add_argument("--drop-bad", metavar="OUT.jsonl", help="write the lines without errors here and list the dropped ones")
    v.add_argument("--report", metavar="FILE.json", help="write the full report (every error) as JSON")
    v.add_argument("--headers-only", action="store_true", help="read image headers only (skips corrupt/blank checks)")
    v.add_argument("--workers", type=int, default=0, help="processes (0: all cores)")
    v.add_argument("--max-list", type=int, default=50, help="errors listed on stdout")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.set_defaults(func=_run_data_validate)

    k = sub.add_parser("pack", help="offline packing from metadata into per-rank shards + manifest.json",
                       description="Count tokens from metadata (image headers, checked against image_sizes; "
                                   "never decoding), pack with best-fit-decreasing under --seq-length and --max-image-tokens, "
                                   "balance packs over --dp-size ranks, write OUT_DIR/rank_XXXXX.jsonl and "
                                   "OUT_DIR/manifest.json. Flags override --config.")
    k.add_argument("input", help="JSONL file to pack")
    k.add_argument("out_dir", help="output directory")
    k.add_argument("--config", help="YAML with a data: section (DataConfig)")
    k.add_argument("--tokenizer", help="tokenizer dir or file (default: the bundled Qwen3 tokenizer)")
    k.add_argument("--seq-length", type=int, help="tokens per pack (default 4096)")
    k.add_argument("--max-image-tokens", type=int,
                   help="visual tokens per pack (default 0 = seq_length: packs fill on tokens; a smaller value is "
                        "the ViT-balance option, bounding vision work per pack at a cost in fill)")
    k.add_argument("--dp-size", type=int, help="data-parallel ranks, one shard each (default 1)")
    k.add_argument("--workers", type=int, help="processes for the metadata pass (default: data.pack_workers, 0 = all cores)")
    k.add_argument("--trust-image-sizes", action="store_true",
                   help="take image_sizes as given without reading image headers (faster on slow storage; a wrong "
                        "size is then only caught when the loader decodes the image)")
    k.add_argument("--quiet", action="store_true", help="no progress bars")
    k.set_defaults(func=_run_data_pack)

    c = sub.add_parser("convert", help="LLaVA / ShareGPT JSON(L) or Hugging Face parquet -> this project's JSONL",
                       description="Convert every record to a line of this project's JSONL with image_sizes from the "
                                   "image headers; images stored as bytes (parquet) are written to images/ beside "
                                   "OUT. Every record that cannot be converted is listed with its line, element or "
                                   "row and the reason; converted + skipped = records. The same input gives the "
                                   "same output. Formats: docs/DATA.md.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    c.add_argument("input", help="LLaVA / ShareGPT JSON array or JSONL, or a parquet file")
    c.add_argument("output", metavar="OUT.jsonl", help="converted file (image paths relative to it)")
    c.add_argument("--from", dest="source_format", default="auto",
                   choices=("auto", "llava", "sharegpt", "parquet", "jsonl"),
                   help="input format (auto: told from the file name and its first record)")
    c.add_argument("--image-root", metavar="DIR", help="folder relative image paths resolve against (none: the "
                                                      "input's folder)")
    c.add_argument("--config", help="YAML with a data: section (quality filters: data.image.min_side, "
                                    "max_aspect_ratio)")
    c.add_argument("--report", metavar="FILE.json", help="write the full report (every skipped record) as JSON")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_run_data_convert)


def _run_data_validate(args) -> int:
    from mindvl_ms.data.validate import format_report, validate_file

    cfg = _load_data_config(args.config)
    report = validate_file(args.file, cfg.image, decode=not args.headers_only, workers=args.workers,
                           drop_bad=args.drop_bad, progress=not args.quiet, video=cfg.video_for(args.file),
                           seed=cfg.seed)
    print(format_report(report, args.max_list))
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    # with --drop-bad the clean file has no errors left: success; otherwise errors fail the run
    return 1 if report["num_bad"] and not args.drop_bad else 0


def _run_data_pack(args) -> int:
    from mindvl_ms.data.offline import pack_file

    cfg = _load_data_config(args.config)
    for flag, field in (("tokenizer", "tokenizer"), ("seq_length", "seq_length"),
                        ("max_image_tokens", "max_image_tokens"), ("dp_size", "dp_size")):
        v = getattr(args, flag)
        if v is not None:
            setattr(cfg, field, v)
    cfg.dp_rank = 0
    try:
        cfg.validate()
    except ValueError as e:  # a flag (or the YAML) value: name where it came from
        raise ValueError(f"{args.config or 'flags'}: data: {e}") from None
    man = pack_file(args.input, args.out_dir, cfg, workers=args.workers, progress=not args.quiet,
                    check_sizes=not args.trust_image_sizes)
    print(f"{man['num_samples']} samples in {man['num_packs']} packs of {man['seq_length']} tokens over "
          f"{man['dp_size']} ranks: efficiency {man['efficiency']:.4f}, max/min rank tokens "
          f"{man['rank_token_ratio']:.4f}, ViT step max/min {man['vit_step_max_min_ratio_mean']:.3f}")
    if man["dropped"]:
        counts = ", ".join(f"{k}: {v}" for k, v in man["dropped_counts"].items())
        print(f"dropped {len(man['dropped'])} lines ({counts}); see {args.out_dir}/manifest.json", file=sys.stderr)
    print(f"wrote {args.out_dir}/manifest.json and {len(man['shards'])} shard(s)")
    return 0


def _run_data_convert(args) -> int:
    from mindvl_ms.data.formats import convert_file, format_convert_report

    cfg = _load_data_config(args.config)
    report = convert_file(args.input, args.output, args.source_format, image_root=args.image_root, image=cfg.image,
                          progress=not args.quiet)
    print(format_convert_report(report))
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


def _load_data_config(path: str = None):
    """DataConfig from a YAML file (`data:` section or top level); defaults when no file is given."""
    from mindvl_ms.config.base import load, read_yaml
    from mindvl_ms.config.data import DataConfig

    if not path:
        return DataConfig()
    d = read_yaml(path)
    if "data" in d and isinstance(d["data"], dict):
        d = d["data"]
    return load(DataConfig, d, source=path)
