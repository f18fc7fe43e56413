"""What a run builds before it trains: the model (new, or `init_from`'s), the network the train step calls
(shard strategies under semi/auto parallel, recompute, mixed precision) and each stage's per-rank data
source with its collate (fixed per-stage sizes under semi/auto parallel, each rank's share of its group's
images under `vision_parallel: dp`). `train.trainer` drives the stages with them.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import mindspore as ms

from mindvl_ms.checkpoint.hf import config_from_dir
from mindvl_ms.checkpoint.pretrained import load_pretrained
from mindvl_ms.config.base import to_dict
from mindvl_ms.data.collate import build_model_inputs, row_budget, share_budget
from mindvl_ms.data.dataset import DataLoader, PackedShardSource
from mindvl_ms.data.processor import ProcessorWriter
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.ops.dispatch import is_ascend
from mindvl_ms.parallel import apply_recompute, parallelize
from mindvl_ms.parallel.moe import bind_mindformers_moe
from mindvl_ms.parallel.runtime import DistInfo
from mindvl_ms.parallel.validate import refuse_unsharded
from mindvl_ms.parallel.vit_balance import balanced_batch
from mindvl_ms.train.batches import LoaderSource

log = logging.getLogger(__name__)


def default_collate(run_cfg):
    def collate(rows, stage):
        return build_model_inputs(rows, run_cfg.model, pad_to=stage.seq_length)
    return collate


def static_collate(model_cfg, data_cfg, vision_ranks: int = 1, tp_rank: int = 0):
    """Rows -> a rank's arrays under semi/auto parallel: every size the stage's fixed budget; with
    `vision_ranks` > 1 the ViT inputs are this rank's share of its group's images (`parallel.vit_balance`)."""
    budget = row_budget(model_cfg, data_cfg)
    if vision_ranks == 1:
        return lambda rows: build_model_inputs(rows, model_cfg, budget=budget)
    share = share_budget(model_cfg, data_cfg, vision_ranks)
    return lambda rows: balanced_batch(build_model_inputs(rows, model_cfg, budget=budget), model_cfg,
                                       vision_ranks, share, tp_rank)[0]


def default_data_factory(run_cfg, stage, stage_index: int, dist: DistInfo):
    """The data pipeline's per-rank loader for a stage: the run's `data` section merged with the stage's
    `data` overrides, with seq_length / micro batch / data-parallel rank and size taken from the stage."""
    cfg = dataclasses.replace(run_cfg.stage_data(stage), dp_size=dist.dp, dp_rank=dist.dp_rank)
    collate = None
    if dist.semi_auto:  # static shapes: every rank's arrays sized by the stage's fixed budget
        collate = static_collate(run_cfg.model, cfg, run_cfg.parallel_config.vision_ranks, dist.tp_rank)
    loader = DataLoader.from_config(cfg, model_config=run_cfg.model, collate=collate)
    rows = None
    if isinstance(loader.source, PackedShardSource):
        rows = len(loader.source.offsets) * dist.dp
    elif stage.token_budget is None and stage.max_steps is None:  # online packing: count packs once
        rows = sum(1 for _ in loader.source.epoch_packs(0)) * dist.dp
    return LoaderSource(loader, rows)


def processor_writer(run_cfg, stage, model):
    """Writes the stage's processor (tokenizer, pixel limits, system prompt) into each checkpoint
    (data/processor_files.py); None for a model without a config (nothing to serve it with)."""
    if getattr(model, "config", None) is None:
        return None
    return ProcessorWriter(run_cfg.stage_data(stage))


def build_model(run_cfg):
    """The plain MindVL model: init_from's weights (checkpoint/pretrained.py), else new from run_cfg.model."""
    ms.set_seed(run_cfg.seed)
    if run_cfg.init_from:
        return load_pretrained(MindVLModel, run_cfg.init_from)
    return MindVLModel(run_cfg.model)


def checkpoint_model_config(run_cfg):
    """A copy of run_cfg whose `model` is init_from's config.json: the model is built from the checkpoint,
    and batches (token ids, vocabulary, M-RoPE layout) must be built for that model, not for a YAML
    `model:` section that differs from it (which is logged)."""
    ck = config_from_dir(run_cfg.init_from)
    if ck != run_cfg.model:
        diff = {k: v for k, v in to_dict(ck).items() if to_dict(run_cfg.model).get(k) != v}
        log.info("model config from %s (it differs from the run config's `model:` in %s)", run_cfg.init_from,
                 sorted(diff))
    return dataclasses.replace(run_cfg, model=ck)


def prepare_model(model, run_cfg, dist: Optional[DistInfo] = None):
    """Shard strategies (semi-auto parallel), activation checkpointing and mixed precision; returns the
    network the train step calls.

    float16/bfloat16 use MindSpore AMP O2 (matmuls in low precision, norms and the loss in fp32,
    fp32 master weights, which stay the model's parameters and names)."""
    if dist is not None and dist.semi_auto:
        rep = parallelize(model, run_cfg)
        refuse_unsharded(model)  # the audit: every primitive of the language model and its head sharded
        log.info("parallelize: %d linear layers sharded, %d other cells, stages %s", len(rep.linear),
                 len(rep.cells), sorted(set(rep.stages.values())))
    elif is_ascend():
        bind_mindformers_moe(model)  # MindFormers' router and dispatcher: the MoE default on Ascend
    counts = apply_recompute(model, run_cfg.recompute_config)
    if any(counts.values()):
        log.info("recompute: %d layers/blocks fully, %d primitives selectively", counts["full_cells"],
                 counts["select_primitives"])
    if run_cfg.context.precision in ("float16", "bfloat16"):
        dt = ms.float16 if run_cfg.context.precision == "float16" else ms.bfloat16
        return ms.amp.auto_mixed_precision(model, "O2", dtype=dt)
    return model
