"""The `mindvl` command line: `main` parses and dispatches; each area's subcommands live in one module
here with a `register(subparsers)` (see `main.COMMAND_MODULES`)."""
from mindvl_ms.cli.main import build_parser, main, output_error

__all__ = ["build_parser", "main", "output_error"]
