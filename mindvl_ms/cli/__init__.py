"""The `mindvl` command (also `python -m mindvl_ms`): `main` parses and dispatches.

Each area's subcommands live in one module here, listed in COMMAND_MODULES: it exposes
`register(subparsers)`, which adds its parsers, and one handler `_run_<command>(args)` per command, which
calls the library with the parsed arguments and prints the outcome; the work itself lives in the library.
The modules import only the standard library at their top and the library inside their handlers (much of
it loads MindSpore), so `mindvl --help` is fast.

Errors: user errors (a missing file, a bad value) print one line and exit 2; an output that cannot be
written (no permission, read-only or full disk) prints one line naming the path and the remedy and
exits 1 (`output_error`). Checkpoints and shards are written under temporary names and renamed, so such
a failure leaves the previous outputs as they were.

The handlers that build a model and compile graphs (train, eval, search-resolution, generate, chat, export,
rollout) call `ops.process.freeze_imported_objects()` after their library imports, before the work.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from typing import List, Optional

_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_NO_WRITE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR)

COMMAND_MODULES = [
    "mindvl_ms.cli.convert",
    "mindvl_ms.cli.merge",
    "mindvl_ms.cli.eval",
    "mindvl_ms.cli.train",
    "mindvl_ms.cli.rollout",
    "mindvl_ms.cli.data",
    "mindvl_ms.cli.infer",
    "mindvl_ms.cli.demo",
    "mindvl_ms.cli.plan",
    "mindvl_ms.cli.init_config",
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
    except OSError as e:
        msg = output_error(e, args)
        if msg is None:
            raise
        print(f"mindvl {args.command}: error: {msg}", file=sys.stderr)
        return 1


def output_error(e: OSError, args=None) -> Optional[str]:
    """One line for an output that cannot be written (None for other OS errors). A write that fails
    for lack of space carries no file name, so the command's output argument names the place."""
    if e.errno not in _NO_SPACE + _NO_WRITE:
        return None
    path = e.filename or next((getattr(args, k) for k in ("out", "out_dir", "output", "dst", "save_dir")
                               if isinstance(getattr(args, k, None), str)), None) or "the output directory"
    if e.errno in _NO_SPACE:
        return (f"cannot write {path}: no space left on the device ({e.strerror}); free space there or choose "
                f"another output directory. Files written before this one are intact (checkpoints are renamed "
                f"into place only when complete).")
    return (f"cannot access {path}: {e.strerror}; make it writable (outputs) or readable (inputs), or choose "
            f"another output directory, and run again.")


if __name__ == "__main__":
    sys.exit(main())
