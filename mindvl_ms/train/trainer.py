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
  metrics log back to the checkpoint, and continues with bit-identical losses. The checkpoint records
  a fingerprint of the stage's data sources (`data.skiplog.data_fingerprint`); a resume on other data
  stops before anything is touched unless `allow_data_change` (then the change is logged and kept);
- a global batch with no supervised token is never stepped, and a stage whose loader skips more than
  `data.max_skip_fraction` of an epoch stops with the reasons (`data.skiplog.SkipGuard`); the stage
  report carries the skipped-sample count.

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

from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.config.base import to_dict
from mindvl_ms.data.vocab_subset import follow_vocab_subset
from mindvl_ms.train.callbacks import MetricsLog, ProgressBar, device_peak, param_counts, plot_stage, soc_version, summarize
from mindvl_ms.train.batches import micro_batches, rank_slice
from mindvl_ms.parallel.runtime import DistInfo, HostAllReduce, gather_json, setup
from mindvl_ms.train.lr import WarmupCosine
from mindvl_ms.train.optim import select_trainable
from mindvl_ms.train.train_step import TrainStep

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (too many non-finite steps in a row); the message says what to do."""


def default_collate(run_cfg):
    from mindvl_ms.data.collate import build_model_inputs

    def collate(rows, stage):
        return build_model_inputs(rows, run_cfg.model, pad_to=stage.seq_length)
    return collate


def default_data_factory(run_cfg, stage, stage_index: int, dist: DistInfo):
    """The data pipeline's per-rank loader for a stage: the run's `data` section merged with the stage's
    `data` overrides, with seq_length / micro batch / data-parallel rank and size taken from the stage."""
    import dataclasses

    from mindvl_ms.config.base import deep_merge, load
    from mindvl_ms.config.train import DataConfig
    from mindvl_ms.data.dataset import DataLoader, PackedShardSource
    from mindvl_ms.train.batches import LoaderSource

    raw = deep_merge(to_dict(run_cfg.data), stage.data)
    cfg = load(DataConfig, raw, source=f"stage '{stage.name}' data")
    cfg = dataclasses.replace(cfg, seq_length=stage.seq_length, micro_batch_size=stage.micro_batch_size,
                              dp_size=dist.dp, dp_rank=dist.dp_rank)
    loader = DataLoader.from_config(cfg, model_config=run_cfg.model)
    rows = None
    if isinstance(loader.source, PackedShardSource):
        rows = len(loader.source.offsets) * dist.dp
    elif stage.token_budget is None and stage.max_steps is None:  # online packing: count packs once
        rows = sum(1 for _ in loader.source.epoch_packs(0)) * dist.dp
    return LoaderSource(loader, rows)


def _processor_writer(run_cfg, stage, model):
    """Writes the stage's processor (tokenizer, pixel limits, system prompt) into each checkpoint
    (data/processor_files.py); None for a model without a config (nothing to serve it with)."""
    from mindvl_ms.data.processor import ProcessorWriter
    from mindvl_ms.config.base import deep_merge, load
    from mindvl_ms.config.data import DataConfig

    if getattr(model, "config", None) is None:
        return None
    return ProcessorWriter(load(DataConfig, deep_merge(to_dict(run_cfg.data), stage.data),
                                source=f"stage '{stage.name}' data"))


def build_model(run_cfg):
    import mindspore as ms

    from mindvl_ms.models.mindvl import MindVLForConditionalGeneration

    ms.set_seed(run_cfg.seed)
    if run_cfg.init_from:
        return MindVLForConditionalGeneration.from_pretrained(run_cfg.init_from)
    return MindVLForConditionalGeneration(run_cfg.model)


def checkpoint_model_config(run_cfg):
    """A copy of run_cfg whose `model` is init_from's config.json: the model is built from the checkpoint,
    and batches (token ids, vocabulary, M-RoPE layout) must be built for that model, not for a YAML
    `model:` section that differs from it (which is logged)."""
    import dataclasses

    from mindvl_ms.checkpoint.hf import config_from_dir

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
    import mindspore as ms

    from mindvl_ms.parallel import apply_recompute, parallelize

    if dist is not None and dist.semi_auto:
        rep = parallelize(model, run_cfg)
        log.info("parallelize: %d linear layers sharded, %d other cells, stages %s", len(rep.linear),
                 len(rep.cells), sorted(set(rep.stages.values())))
    counts = apply_recompute(model, run_cfg.recompute_config)
    if any(counts.values()):
        log.info("recompute: %d layers/blocks fully, %d primitives selectively", counts["full_cells"],
                 counts["select_primitives"])
    if run_cfg.context.precision in ("float16", "bfloat16"):
        dt = ms.float16 if run_cfg.context.precision == "float16" else ms.bfloat16
        return ms.amp.auto_mixed_precision(model, "O2", dtype=dt)
    return model


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
                 progress: bool = True, allow_data_change: bool = False) -> Dict[str, Any]:
    """Run every stage of `run_cfg`; returns the run summary (also written to OUT/summary.json).

    model: a Cell taking INPUT_NAMES arrays (default: MindVL from run_cfg.model / init_from);
    data_factory(run_cfg, stage, stage_index, dist) -> a row source (see train/batches.py);
    collate(rows, stage) -> arrays dict (default: data.collate.build_model_inputs).
    """
    from mindvl_ms.checkpoint.hf import load_into
    from mindvl_ms.data.skiplog import SkipGuard, fingerprint_diff, stage_fingerprint

    t_start = time.perf_counter()
    follow_vocab_subset(run_cfg)  # a data.tokenizer with vocab_subset.json sets the model's vocabulary
    if model is None and run_cfg.init_from:  # the checkpoint is the model: batches follow its config
        run_cfg = checkpoint_model_config(run_cfg)
    dist = setup(run_cfg)
    os.makedirs(out_dir, exist_ok=True)
    np.random.seed(run_cfg.seed % 2**32)
    random.seed(run_cfg.seed)
    model = model if model is not None else build_model(run_cfg)
    net = prepare_model(model, run_cfg, dist)
    collate = collate or default_collate(run_cfg)
    data_factory = data_factory or default_data_factory
    names = list(getattr(model, "INPUT_NAMES"))
    metrics = MetricsLog(os.path.join(out_dir, "metrics.jsonl"), enabled=dist.is_main)
    allreduce = HostAllReduce(dist.world, dist.dp)
    start_stage, start_step, state, optim, data_changes = 0, 0, None, None, []
    if resume:
        ck = ts.find_latest(resume)
        state, tensors, optim = ts.load_checkpoint(ck)
        data_changes = list(state.get("data_changes", []))
        if "data_fingerprint" in state and not state["stage_done"]:  # checked before anything is changed
            diff = fingerprint_diff(state["data_fingerprint"],
                                    stage_fingerprint(run_cfg, run_cfg.stages[state["stage_index"]]))
            if diff and not allow_data_change:
                raise TrainingStopped(f"--resume {resume}: the data of stage '{state['stage']}' is not the data "
                                      f"of {ck} ({diff}); resuming would continue its saved position on other "
                                      f"data. Restore the original data, or pass --resume-allow-data-change")
            if diff:
                log.warning("resuming stage %s on changed data (%s)", state["stage"], diff)
                data_changes.append({"stage": state["stage"], "step": state["step"], "change": diff})
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
    peak, peak_source = device_peak(run_cfg.context.device_target, soc_version(), run_cfg.context.precision)
    log.info("MFU peak: %.2f TFLOP/s per device (%s)", peak / 1e12, peak_source)
    counts = param_counts(model)
    stage_reports, compile_time = [], 0.0
    for si in range(start_stage, len(run_cfg.stages)):
        stage = run_cfg.stages[si]
        stage_dir = os.path.join(out_dir, stage.name)
        ts.clean_partial(stage_dir)
        factory = data_factory
        if stage.type != "sft" and data_factory is default_data_factory:  # preference / prompt files
            from mindvl_ms.train.post.stage import post_data_factory as factory
        source = factory(run_cfg, stage, si, dist)
        total = stage.total_steps(getattr(source, "rows_per_epoch", None))
        accum = stage.accumulation(dist.dp)
        sched = WarmupCosine(stage.max_lr, stage.min_lr, total, stage.warmup_ratio)
        params = select_trainable(model, stage.trainable_prefixes())
        ctx = run_cfg.context
        runner = None
        if stage.type != "sft":  # DPO / GRPO: a runner with its own step (post_stage.py)
            from mindvl_ms.train.post.stage import make_runner

            runner = make_runner(dict(run_cfg=run_cfg, stage=stage, dist=dist, model=model, net=net, params=params,
                                      names=names, source=source, allreduce=allreduce, collate=collate,
                                      stage_dir=stage_dir, resuming=state is not None and si == state["stage_index"]))
            engine = runner.engine
        else:
            engine = TrainStep(net, params, names, stage.loss, stage, dist.dp, allreduce, ctx.precision,
                               ctx.loss_scale_value, ctx.loss_scale_factor, ctx.loss_scale_window,
                               gradients_mean=run_cfg.parallel.gradients_mean,
                               compiler_reduces=dist.compiler_reduces,
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
        data_cfg = getattr(getattr(source, "loader", None), "config", run_cfg.data)
        guard = SkipGuard(stage.name, data_cfg.max_skip_fraction, allreduce, getattr(source, "rows_per_epoch", None),
                          stage.global_batch_size, (lambda o: gather_json(o, dist.world)) if dist.world > 1 else None)
        fingerprint = stage_fingerprint(run_cfg, stage)
        log.info("stage %s: %d steps, %d micro-batches x %d rows per rank, %d trainable tensors",
                 stage.name, total, accum, stage.micro_batch_size, len(params))
        bar = ProgressBar(total, step, f"{stage.name}", enabled=progress and dist.is_main)
        write_processor = _processor_writer(run_cfg, stage, model)

        def data_states(src):
            """Every rank's loader state (gathered to rank 0) for per-rank loaders; one state otherwise."""
            own = src.state_dict()
            if not hasattr(src, "next_micro_batches") or dist.world == 1:
                return own
            return gather_json(own, dist.world)

        def save(step_now: int, done: bool) -> str:
            st = {"stage_index": si, "stage": stage.name, "step": step_now, "total_steps": total,
                  "stage_done": done, "data": data_states(source), "skipped": skipped,
                  "nonfinite_run": nonfinite_run, "seed": run_cfg.seed, "data_fingerprint": fingerprint,
                  "data_changes": data_changes}
            path = os.path.join(stage_dir, f"checkpoint-{step_now:06d}")
            if dist.is_main:
                ts.save_checkpoint(path, model, engine.state_parameters(), st, out_dir, extra=write_processor)
                ts.prune(stage_dir, stage.keep_last, protect=path)
            return path

        try:
            while step < total:
                t0 = time.perf_counter()
                if runner is not None:  # DPO / GRPO draw and collate their own data
                    mbs = None
                elif hasattr(source, "next_micro_batches"):  # a per-rank loader that collates itself
                    try:
                        mbs = source.next_micro_batches(accum)
                    except RuntimeError as e:  # no batch in a whole epoch: say why, no traceback
                        raise TrainingStopped(guard.no_data_message(getattr(source, "loader", source), e)) from None
                else:
                    local = rank_slice(source.next_global_batch(stage.global_batch_size), dist.dp_rank, dist.dp)
                    mbs = [collate(rows, stage) for rows in micro_batches(local, stage.micro_batch_size)]
                if mbs is not None:
                    g_sup, stop = guard.check(mbs, getattr(source, "loader", source))
                    if stop:
                        raise TrainingStopped(stop)
                    if g_sup == 0:  # never step on nothing (weight decay alone would move the weights)
                        log.warning("stage %s step %d: the global batch has no supervised token (its samples "
                                    "were skipped): not stepped", stage.name, step)
                        continue
                lr = sched(step)
                n_compiled = engine.compiles
                res, extra = runner.step(step, lr) if runner is not None else (engine.run(mbs, lr), {})
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
                       "step_time": dt, "tokens_per_s": res.tokens * dist.dp / max(dt, 1e-9),
                       "skipped_total": skipped, **extra}
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
        n_skip, by_reason = guard.skipped(getattr(source, "loader", source))
        if runner is not None and run_cfg.plot and dist.is_main:  # reward / margin panels
            from mindvl_ms.train.post.stage import plot_post

            plot_post(recs, os.path.join(stage_dir, "post_metrics.png"), stage.type, stage.name)
        stage_reports.append({"stage": stage.name, "steps": total, "checkpoint": final, "plot": png,
                              "final_loss": recs[-1]["loss"] if recs else None, "skipped_steps": skipped,
                              "skipped_samples": n_skip, "skipped_by_reason": by_reason,
                              "compiled_graphs": engine.compiles})
        log.info("stage %s done: %d steps, %d samples skipped%s", stage.name, total, n_skip,
                 f" ({', '.join(f'{k}: {v}' for k, v in by_reason.items())})" if n_skip else "")
        state = None
    summary = summarize(metrics.read(), counts, peak, dist.world, time.perf_counter() - t_start, compile_time,
                        peak_source)
    summary.update({"stages": stage_reports, "out_dir": out_dir, "ranks": dist.world,
                    "peak_gflops_per_device": peak / 1e9})
    if dist.is_main:
        from mindvl_ms.checkpoint.io import write_json

        write_json(os.path.join(out_dir, "summary.json"), summary)
    return summary
