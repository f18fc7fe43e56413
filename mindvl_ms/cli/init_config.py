"""`mindvl init-config`: list the packaged YAML configs, or copy one with the files it includes."""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "init-config", help="copy a packaged config (and the files it includes) to edit",
        description="Copy one of the YAML configs shipped with mindvl-ms, together with every file it includes "
                    "(`_include_`, the demo's model YAML), into DST keeping their relative paths; the copy loads "
                    "exactly like the original. Without NAME, list the packaged configs.",
        epilog="examples:\n  mindvl init-config                       # list\n"
               "  mindvl init-config stage/tiny-cpu.yaml   # -> configs/stage/tiny-cpu.yaml, configs/model/tiny.yaml\n"
               "  mindvl train --config configs/stage/tiny-cpu.yaml ...",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help="packaged config, e.g. demo/quick.yaml or configs/stage/tiny-cpu.yaml")
    p.add_argument("dst", nargs="?", help="directory to copy into (default: ./configs)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=_run_init_config)


def _run_init_config(args) -> int:
    from mindvl_ms.config.packaged import PREFIX, configs_dir, copy_config, list_configs

    if not args.name:
        print(f"packaged configs ({configs_dir()}):")
        for n in list_configs():
            print(f"  {n}")
        return 0
    try:
        written = copy_config(args.name, args.dst or PREFIX, overwrite=args.force)
    except FileExistsError as e:
        raise ValueError(str(e)) from None
    for w in written:
        print(f"wrote {w}")
    return 0

