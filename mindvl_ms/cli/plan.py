"""`mindvl plan`: per-device memory and communication of a run config's parallel layout."""
from __future__ import annotations

import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="per-device memory and communication of a run's parallel layout",
        description="Per-device memory (weights, gradients, optimizer states, activations, ViT activations, "
                    "logits chunk) and per-step communication (TP, EP, PP, DP) of the run config's layout, for "
                    "every training stage and pipeline stage, and host memory per process (gradient "
                    "accumulators, Adam moments, one step's pinned input arrays). Validates the strategy first. "
                    "Exits 1 when a device exceeds context.max_device_memory, naming the component.")
    p.add_argument("--config", required=True, help="run YAML (e.g. configs/run/mindvl-8b-64npu.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.set_defaults(func=_run_plan)


def _run_plan(args) -> int:
    from mindvl_ms.config.base import ConfigError
    from mindvl_ms.config.packaged import resolve_config
    from mindvl_ms.config.train import load_run_config
    from mindvl_ms.data.vocab_subset import follow_vocab_subset
    from mindvl_ms.parallel.layout import Layout
    from mindvl_ms.parallel.plan import check, format_host_plan, format_plan, host_plan, parse_memory, plan_run
    from mindvl_ms.parallel.runtime import auto_parallel_settings, validate_strategy
    from mindvl_ms.parallel.validate import validate_parallel

    try:
        cfg = load_run_config(resolve_config(args.config)[0], args.set)
        follow_vocab_subset(cfg)
        lay = Layout.from_run_config(cfg)
        validate_strategy(cfg.model, cfg.parallel_config, lay.world)
        validate_parallel(cfg, lay.world, auto_parallel_settings(cfg, lay.world), args.config)
        limit = parse_memory(cfg.context.max_device_memory)
        plans = plan_run(cfg)
        hosts = host_plan(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(format_plan(cfg, plans, limit))
    print()
    print(format_host_plan(cfg, hosts))
    bad = check(cfg, plans, limit)
    for msg in bad:
        print(f"does not fit: {msg}", file=sys.stderr)
    return 1 if bad else 0
