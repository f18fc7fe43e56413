"""Refusals of a semi/auto-parallel run that would compile but train on the wrong data or an unsharded graph.

`validate_parallel(run_cfg, world, settings, source)` runs before any graph is built (`parallel.runtime.setup`
on Ascend, `mindvl plan` everywhere); `settings` are the `set_auto_parallel_context` keywords the run would
use (`parallel.runtime.auto_parallel_settings`, passed in so this module needs nothing from runtime). Each
refusal is one line naming the config file, the field and what was expected:

- `parallel.full_batch: true` with data parallel > 1: full_batch tells the graph that every rank holds the
  global batch, but the loader hands each rank only its data-parallel shard (global_batch / data_parallel
  rows, `train.batches.rank_slice` by dp rank); there is no global loader;
- semi/auto parallel without a `dataset_strategy` that covers every model input (`data.collate.INPUT_NAMES`)
  with the rows split data_parallel ways on dimension 0 and no other split, the ViT's inputs data_parallel x
  `ParallelConfig.vision_ranks` ways (each rank's share of its group's images; pipeline runs too: the step
  joins a rank's micro-batches along the rows): MindSpore would otherwise split dimension 0 of every input
  over all devices, while the tensor- and pipeline-parallel peers of a rank read the same rows (MindFormers
  refuses the same: "If set full_batch=False, dataset_strategy must be set");
- a stage whose global_batch_size is not data_parallel x micro_batch_size x a whole number n of micro-batches
  per rank, or, with pipeline stages, whose n is below pipeline_stage (the pipeline would idle). n is the
  pipeline's micro_batch_num: the one-graph step (`train.mf_step`) derives it per stage, so no config field
  can disagree with it.

`refuse_unsharded(cell, ...)` is the audit's refusal (`parallel/audit.py`): after `parallelize`, any
primitive of the language model or the loss head without a strategy (MoE router and routed-expert internals
excepted: MindFormers' Morph dispatch places them) stops the run with the types and one cell that has one.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

from mindspore import nn

from mindvl_ms.config.base import ConfigError
from mindvl_ms.data.collate import INPUT_NAMES, VISION_NAMES
from mindvl_ms.parallel.audit import NO_STRATEGY, iter_primitives, strategy_of

SEMI_AUTO = (1, 2)
MOE_INTERNALS = r"\.mlp\.(experts|gate)(\.|$)"  # router and routed experts: parallel/moe.py's Morph region


def _full_batch(run_cfg, source: str) -> List[str]:
    dp = run_cfg.parallel_config.data_parallel
    if run_cfg.parallel.full_batch and dp > 1:
        return [f"{source}: parallel.full_batch is true, but each rank loads only its 1/{dp} data-parallel shard "
                f"of the global batch (there is no global loader); expected full_batch: false"]
    return []


def _row_split_ok(entry, n: int) -> bool:
    """One input's strategy splits its rows (dim 0) n ways and nothing else."""
    s = tuple(int(x) for x in entry)
    return len(s) >= 1 and s[0] == n and all(x == 1 for x in s[1:])


def _dataset_strategy(run_cfg, settings: dict, source: str) -> List[str]:
    sizes = run_cfg.parallel_config
    strategy = settings.get("dataset_strategy")
    if not strategy:
        return [f"{source}: parallel.parallel_mode {run_cfg.parallel.parallel_mode} (semi/auto parallel) without a "
                f"dataset_strategy; expected one entry per model input {list(INPUT_NAMES)} splitting its rows "
                f"data_parallel ({sizes.data_parallel}) ways"]
    if isinstance(strategy, str) or len(strategy) < len(INPUT_NAMES):
        n = "a string" if isinstance(strategy, str) else f"{len(strategy)} entries"
        return [f"{source}: dataset_strategy has {n}; expected one per model input ({len(INPUT_NAMES)}: "
                f"{list(INPUT_NAMES)}), each splitting its rows data_parallel ({sizes.data_parallel}) ways"]
    dp, vision = sizes.data_parallel, sizes.data_parallel * sizes.vision_ranks
    want = {name: vision if name in VISION_NAMES else dp for name in INPUT_NAMES}
    bad = [f"{name} {tuple(entry)} (expected ({want[name]}, 1, ...))" for name, entry in zip(INPUT_NAMES, strategy)
           if not _row_split_ok(entry, want[name])]
    if bad:
        return [f"{source}: dataset_strategy does not split the rows of {', '.join(bad)}: the rows go "
                f"data_parallel ({dp}) ways, the ViT inputs data_parallel x vision_ranks ({vision}) ways "
                f"(each rank's share of its group's images, parallel/vit_balance.py)"]
    return []


def _micro_batches(run_cfg, source: str) -> List[str]:
    sizes = run_cfg.parallel_config
    dp, pp = sizes.data_parallel, sizes.pipeline_stage
    out = []
    for stage in run_cfg.stages:
        n, rem = divmod(stage.global_batch_size, dp * stage.micro_batch_size)
        if rem or n == 0:
            out.append(f"{source}: stage '{stage.name}' global_batch_size {stage.global_batch_size} is not "
                       f"data_parallel ({dp}) x micro_batch_size ({stage.micro_batch_size}) x a whole number of "
                       f"micro-batches")
        elif n < pp:
            out.append(f"{source}: stage '{stage.name}' gives each rank {n} micro-batches (global_batch_size "
                       f"{stage.global_batch_size} / (data_parallel {dp} x micro_batch_size "
                       f"{stage.micro_batch_size})), fewer than pipeline_stage {pp}: the pipeline would idle; "
                       f"expected at least {pp}")
    return out


def validate_parallel(run_cfg, world: int, settings: Optional[dict] = None, source: str = "run config") -> None:
    """Raise one ConfigError (one line per problem, see the module docstring) when a semi/auto-parallel or
    pipeline run's inputs, batch arithmetic or loader do not match; plain data parallel has nothing to check."""
    problems = []
    if run_cfg.parallel.parallel_mode in SEMI_AUTO and world > 1:
        problems = _full_batch(run_cfg, source) + _dataset_strategy(run_cfg, settings or {}, source)
    if problems or run_cfg.parallel_config.pipeline_stage > 1 or run_cfg.parallel.parallel_mode in SEMI_AUTO:
        problems += _micro_batches(run_cfg, source)
    if problems:
        raise ConfigError("; ".join(problems))


def unsharded(cell: nn.Cell, prefixes: Sequence[str] = ("",), exclude: str = MOE_INTERNALS) -> Dict[str, str]:
    """{primitive type: first 'cell.attr' without a strategy} over the primitives of the cells of `cell` whose
    name starts with one of `prefixes`, leaving out `exclude` and the primitives that take none."""
    out: Dict[str, str] = {}
    for name, attr, prim in iter_primitives(cell):
        if (name.startswith(tuple(prefixes)) and prim.name not in NO_STRATEGY and not re.search(exclude, name)
                and strategy_of(prim) is None):
            out.setdefault(prim.name, f"{name}.{attr}" if name else attr)
    return out


def refuse_unsharded(model: Optional[nn.Cell] = None, head: Optional[nn.Cell] = None) -> None:
    """ConfigError when the language model of `model` (`model.*` and its `lm_head` / `tied_head`) or the loss
    head `head` has a primitive without a strategy after `parallelize` / `shard_loss_head`."""
    found = unsharded(model, ("model.", "lm_head", "tied_head")) if model is not None else {}
    if head is not None:
        found.update({k: f"loss head {v}" for k, v in unsharded(head).items() if k not in found})
    if found:
        where = ", ".join(f"{t} (e.g. {n})" for t, n in sorted(found.items()))
        raise ConfigError(f"parallel audit: primitives without a shard strategy in the language model or loss "
                          f"head: {where}; expected every one sharded by parallelize (parallel/parallelize.py)")
