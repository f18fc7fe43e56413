"""The stage runner: `run_training(run_config, out_dir, resume=None) -> summary dict`.

Stages run in order on one model object, so stage k starts from stage k-1's final weights (also
saved as OUT/<stage>/checkpoint-<last>). Per stage: select trainable parameters by prefix, size
the stage (token budget / epochs / max_steps), build the compiled step (`train_step.TrainStep`),
then loop: next global batch -> this rank's rows -> micro-batches (`build_model_inputs`, padded to
the stage's seq_length) -> one optimizer step.

Faults and resume:
- a non-finite loss/gradient skips the update (parameters untouched), is counted and logged;
  `max_nonfinite` in a row raises `TrainingStopped` without writing a checkpoint, so the last good
  one stays the resume point;
- checkpoints every `save_every` steps and at stage end (`checkpoint.trainer_state`, atomic);
- `resume=` restores weights, optimizer moments, loss scale, step, data position and RNG, cuts the
  metrics log back to the checkpoint, and continues with bit-identical losses.

Python use (the `mindvl demo` command calls this):
    from mindvl_ms.train import run_training, load_run_config
    summary = run_training(load_run_config("configs/demo/tiny.yaml"), "runs/x",
                           data_factory=my_factory)   # my_factory(run_cfg, stage, stage_index, dist) -> RowSource
"""
from __future__ import annotations

import logging
import os
import random
import time
from typing import Any, Callable, Dict, Optional

import numpy as np

from ..checkpoint import trainer_state as ts
from ..config.base import to_dict
from .callbacks import MetricsLog, ProgressBar, measure_matmul_peak, param_counts, plot_stage, summarize
from .data import micro_batches, rank_slice
from .distributed import DistInfo, HostAllReduce, gather_json, setup
from .lr import WarmupCosine
from .optim import select_trainable
from .train_step import TrainStep

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (too many non-finite steps in a row); the message says what to do."""


def default_collate(run_cfg):
    from ..models.inputs import build_model_inputs

    def collate(rows, stage):
        return build_model_inputs(rows, run_cfg.model, pad_to=stage.seq_length)
    return collate


def default_data_factory(run_cfg, stage, stage_index: int, dist: DistInfo):
    """The data pipeline's per-rank loader for a stage: the run's `data` section merged with the stage's
    `data` overrides, with seq_length / micro batch / data-parallel rank and size taken from the stage."""
    import dataclasses

    from ..config.base import deep_merge, load
    from ..config.train import DataConfig
    from ..data.dataset import DataLoader, PackedShardSource
    from .data import LoaderSource

    raw = deep_merge(to_dict(run_cfg.data), stage.data)
    cfg = load(DataConfig, raw, source=f"stage '{stage.name}' data")
    cfg = dataclasses.replace(cfg, seq_length=stage.seq_length, micro_batch_size=stage.micro_batch_size,
                              dp_size=dist.dp, dp_rank=dist.rank, global_batch_size=stage.global_batch_size)
    loader = DataLoader.from_config(cfg, model_config=run_cfg.model)
    rows = None
    if isinstance(loader.source, PackedShardSource):
        rows = len(loader.source.offsets) * dist.dp
    elif stage.token_budget is None and stage.max_steps is None:  # online packing: count packs once
        rows = sum(1 for _ in loader.source.epoch_packs(0)) * dist.dp
    return LoaderSource(loader, rows)


def build_model(run_cfg):
    import mindspore as ms

    from ..models.mindvl import MindVLForConditionalGeneration

    ms.set_seed(run_cfg.seed)
    if run_cfg.init_from:
        return MindVLForConditionalGeneration.from_pretrained(run_cfg.init_from)
    return MindVLForConditionalGeneration(run_cfg.model)


def prepare_model(model, run_cfg):
    """Activation checkpointing and mixed precision; returns the network the train step calls.

    float16/bfloat16 use MindSpore AMP O2 (matmuls in low precision, norms and the loss in fp32,
    fp32 master weights, which stay the model's parameters and names)."""
    import mindspore as ms

    if run_cfg.recompute_config.recompute:
        n = 0
        for name, cell in model.cells_and_names():
            parent = name.rsplit(".", 2)
            if len(parent) >= 2 and parent[-2] in ("layers", "blocks") and parent[-1].isdigit():
                cell.recompute()
                n += 1
        log.info("recompute on %d layers/blocks", n)
    if run_cfg.context.precision in ("float16", "bfloat16"):
        dt = ms.float16 if run_cfg.context.precision == "float16" else ms.bfloat16
        return ms.amp.auto_mixed_precision(model, "O2", dtype=dt)
    return model


def compiler_reduces_gradients(run_cfg, dist: DistInfo) -> bool:
    """True when MindSpore's compiler inserts the gradient reduction itself (semi/auto parallel, modes 1/2,
    on more than one rank), so the train step must not all-reduce again (`DistInfo.compiler_reduces`
    when the distribution set-up provides it)."""
    flag = getattr(dist, "compiler_reduces", None)
    if flag is not None:
        return bool(flag)
    return run_cfg.parallel.parallel_mode in (1, 2) and dist.world > 1


def pipeline_config(run_cfg):
    """(pipeline stages, micro_batch_num) when pipeline parallel runs (Ascend only), else None."""
    sizes = run_cfg.parallel_config
    if sizes.pipeline_stage > 1 and run_cfg.context.device_target == "Ascend":
        return sizes.pipeline_stage, sizes.micro_batch_num
    return None


def _restore(engine: TrainStep, optim: Dict[str, np.ndarray]) -> None:
    from mindspore import Tensor

    params = engine.state_parameters()
    missing = sorted(set(params) - set(optim))
    if missing:
        raise ValueError(f"checkpoint optimizer state lacks {missing[:5]} (different trainable set?)")
    for k, p in params.items():
        p.set_data(Tensor(np.asarray(optim[k]).reshape(p.shape)))  # 0-d state is stored as [1]


def run_training(run_cfg, out_dir: str, resume: Optional[str] = None, model=None,
                 data_factory: Optional[Callable] = None, collate: Optional[Callable] = None,
                 progress: bool = True) -> Dict[str, Any]:
    """Run every stage of `run_cfg`; returns the run summary (also written to OUT/summary.json).

    model: a Cell taking INPUT_NAMES arrays (default: MindVL from run_cfg.model / init_from);
    data_factory(run_cfg, stage, stage_index, dist) -> a row source (see train/data.py);
    collate(rows, stage) -> arrays dict (default: models.inputs.build_model_inputs).
    """
    from ..checkpoint.hf import load_into

    t_start = time.perf_counter()
    dist = setup(run_cfg)
    os.makedirs(out_dir, exist_ok=True)
    np.random.seed(run_cfg.seed % 2**32)
    random.seed(run_cfg.seed)
    model = model if model is not None else build_model(run_cfg)
    net = prepare_model(model, run_cfg)
    collate = collate or default_collate(run_cfg)
    data_factory = data_factory or default_data_factory
    names = list(getattr(model, "INPUT_NAMES"))
    metrics = MetricsLog(os.path.join(out_dir, "metrics.jsonl"), enabled=dist.is_main)
    allreduce = HostAllReduce(dist.world)
    start_stage, start_step, state, optim = 0, 0, None, None
    if resume:
        ck = ts.find_latest(resume)
        state, tensors, optim = ts.load_checkpoint(ck)
        load_into(model, tensors)
        start_stage, start_step = state["stage_index"], state["step"]
        metrics.truncate_after(start_stage, start_step - 1 if not state["stage_done"] else start_step)
        ts.set_rng_state(state["rng"])
        if state["stage_done"]:
            start_stage, start_step, state = start_stage + 1, 0, None
        log.info("resumed from %s (stage %d, step %d)", ck, start_stage, start_step)
    elif dist.is_main and os.path.isfile(os.path.join(out_dir, "metrics.jsonl")):
        os.remove(os.path.join(out_dir, "metrics.jsonl"))  # a fresh run in a reused directory
    ts.clean_partial(out_dir)
    peak = measure_matmul_peak()
    counts = param_counts(model)
    stage_reports, compile_time = [], 0.0
    for si in range(start_stage, len(run_cfg.stages)):
        stage = run_cfg.stages[si]
        stage_dir = os.path.join(out_dir, stage.name)
        ts.clean_partial(stage_dir)
        source = data_factory(run_cfg, stage, si, dist)
        total = stage.total_steps(getattr(source, "rows_per_epoch", None))
        accum = stage.accumulation(dist.dp)
        sched = WarmupCosine(stage.max_lr, stage.min_lr, total, stage.warmup_ratio)
        params = select_trainable(model, stage.trainable_prefixes())
        ctx = run_cfg.context
        engine = TrainStep(net, params, names, stage.loss, stage, dist.dp, allreduce, ctx.precision,
                           ctx.loss_scale_value, ctx.loss_scale_factor, ctx.loss_scale_window,
                           gradients_mean=run_cfg.parallel.gradients_mean,
                           compiler_reduces=compiler_reduces_gradients(run_cfg, dist),
                           pipeline=pipeline_config(run_cfg))
        step, nonfinite_run, skipped = 0, 0, 0
        if state is not None and si == state["stage_index"]:
            _restore(engine, optim)
            data_state = state["data"]
            if isinstance(data_state, dict) and f"rank{dist.rank}" in data_state:
                data_state = data_state[f"rank{dist.rank}"]
            source.load_state_dict(data_state)
            step, skipped = start_step, state.get("skipped", 0)
            nonfinite_run = state.get("nonfinite_run", 0)
        log.info("stage %s: %d steps, %d micro-batches x %d rows per rank, %d trainable tensors",
                 stage.name, total, accum, stage.micro_batch_size, len(params))
        bar = ProgressBar(total, step, f"{stage.name}", enabled=progress and dist.is_main)

        def data_states(src):
            """Every rank's loader state (gathered to rank 0) for per-rank loaders; one state otherwise."""
            own = src.state_dict()
            if not hasattr(src, "next_micro_batches") or dist.world == 1:
                return own
            return gather_json(own, dist.world)

        def save(step_now: int, done: bool) -> str:
            st = {"stage_index": si, "stage": stage.name, "step": step_now, "total_steps": total,
                  "stage_done": done, "data": data_states(source), "skipped": skipped,
                  "nonfinite_run": nonfinite_run, "seed": run_cfg.seed}
            path = os.path.join(stage_dir, f"checkpoint-{step_now:06d}")
            if dist.is_main:
                ts.save_checkpoint(path, model, engine.state_parameters(), st, out_dir)
                ts.prune(stage_dir, stage.keep_last, protect=path)
            return path

        try:
            while step < total:
                t0 = time.perf_counter()
                if hasattr(source, "next_micro_batches"):  # a per-rank loader that collates itself
                    mbs = source.next_micro_batches(accum)
                else:
                    local = rank_slice(source.next_global_batch(stage.global_batch_size), dist.rank, dist.dp)
                    mbs = [collate(rows, stage) for rows in micro_batches(local, stage.micro_batch_size)]
                lr = sched(step)
                n_compiled = engine.compiles
                res = engine.run(mbs, lr)
                dt = time.perf_counter() - t0
                if engine.compiles != n_compiled:
                    compile_time += dt
                if res.applied:
                    nonfinite_run = 0
                else:
                    nonfinite_run += 1
                    skipped += 1
                    log.warning("stage %s step %d: non-finite loss/gradient (loss %s, grad norm %s): update skipped "
                                "(%d in a row)", stage.name, step, res.loss, res.grad_norm, nonfinite_run)
                rec = {"stage_index": si, "stage": stage.name, "step": step, "loss": res.loss, "lr": lr,
                       "grad_norm": res.grad_norm, "loss_scale": res.loss_scale, "applied": res.applied,
                       "tokens": res.tokens, "patches": res.patches, "supervised": res.supervised,
                       "step_time": dt, "tokens_per_s": res.tokens * dist.world / max(dt, 1e-9),
                       "skipped_total": skipped}
                if res.expert_load is not None:  # MoE: balance of routed tokens (max/mean per layer)
                    ld = res.expert_load
                    rec["expert_max_over_mean"] = float((ld.max(-1) / np.maximum(ld.mean(-1), 1e-9)).max())
                if step % stage.log_every == 0 or step == total - 1:
                    metrics.write(rec)
                bar.update(rec)
                step += 1
                if nonfinite_run >= stage.max_nonfinite:
                    raise TrainingStopped(
                        f"stage '{stage.name}': {nonfinite_run} steps in a row had a non-finite loss or gradient "
                        f"(limit max_nonfinite={stage.max_nonfinite}); stopped at step {step}. The last good "
                        f"checkpoint is in {out_dir} (latest.json); lower max_lr, check the data, or use float32, "
                        f"then --resume {out_dir}")
                if step < total and stage.save_every and step % stage.save_every == 0:
                    save(step, False)
        finally:
            bar.close()
        final = save(total, True)
        recs = metrics.read(stage.name)
        png = plot_stage(recs, os.path.join(stage_dir, "loss_lr.png"), f"{stage.name}") if (
            run_cfg.plot and dist.is_main) else None
        stage_reports.append({"stage": stage.name, "steps": total, "checkpoint": final, "plot": png,
                              "final_loss": recs[-1]["loss"] if recs else None, "skipped_steps": skipped,
                              "compiled_graphs": engine.compiles})
        state = None
    summary = summarize(metrics.read(), counts, peak, dist.world, time.perf_counter() - t_start, compile_time)
    summary.update({"stages": stage_reports, "out_dir": out_dir, "ranks": dist.world,
                    "matmul_peak_gflops": peak / 1e9})
    if dist.is_main:
        from ..checkpoint.io import write_json

        write_json(os.path.join(out_dir, "summary.json"), summary)
    return summary
