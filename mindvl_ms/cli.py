"""The `mindvl` command (also `python -m mindvl_ms`).

Each area registers its own subcommands: a module listed in COMMAND_MODULES exposes
`register(subparsers)`. Modules import MindSpore lazily inside their handlers so that `--help` is fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

COMMAND_MODULES = [
    "mindvl_ms.checkpoint.commands_convert",
    "mindvl_ms.checkpoint.commands",
    "mindvl_ms.eval.commands",
    "mindvl_ms.train.commands",
    "mindvl_ms.train.rollout",
    "mindvl_ms.data.commands",
    "mindvl_ms.infer.commands",
    "mindvl_ms.demo.commands",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mindvl",
        description="mindvl-ms: train, convert, merge, evaluate and export MindVL-style multimodal models "
                    "with MindSpore. Run `mindvl demo` for the tiny three-stage example.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    # MindSpore's C++ log defaults to warnings, which at graph compile are many lines of expander notes;
    # the CLI shows errors only unless the user sets GLOG_v (2 = warnings, 1 = info) themselves.
    os.environ.setdefault("GLOG_v", "3")
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, ValueError) as e:  # user errors: one clear line, no traceback
        print(f"mindvl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
