"""The stage runner: `run_training(run_config, out_dir, resume=None) -> summary dict`.

Stages run in order on one model object, so stage k starts from stage k-1's final weights (also
saved as OUT/<stage>/checkpoint-<last>). `StageChain` holds what every stage shares (the model and its
prepared network, the process group, the metrics log, the resume point) and drives one `Trainer` per
stage. A `Trainer` owns the stage's trainable parameters, its compiled step with the optimizer
(`train_step.TrainStep`; under semi/auto parallel `mf_step.MFStep`, one graph per optimizer step; or a
DPO / GRPO step driver's), its data source and its checkpoints; `train_step()`
is one optimizer step (next global batch -> this rank's rows -> micro-batches (`build_model_inputs`,
padded to the stage's seq_length) -> forward, backward, update -> step record) and `train()` runs the
stage to its end. An SFT stage whose graphs would equal the previous SFT stage's (same trainable
parameters, loss and constants, `train_step.graph_key`; sequence length and shapes may differ) trains on
that stage's `TrainStep`, restarted with a new step's state (`TrainStep.restart`), so it compiles nothing
(e.g. variants of one stage); not under semi/auto parallel (`MFStep`) nor across a DPO / GRPO stage. The
last SFT step stays on the network (`train_step.keep_train_step`, with the recompute setting it was built
under), so a later `run_training` on the same model object (a resume in the same process, another run) starts
on it when it fits; a DPO / GRPO stage drops it before its own step is allocated.

Variants (MindVL section 5.3): the stages train in `RunConfig.schedule()` order, where a stage with
`variants` is one stage per variant. Before each variant the model gets the weights (and RNG state) that
the group starts from, the checkpoint that ended the stage before it (or `init_from`), so every variant
starts from the same parameters whatever ran before it; its checkpoints record that start
(`branch_from`). After the last variant, `checkpoint.merge.merge` writes their merge (OUT/<stage>/merged,
or `merge.out`) and the model continues from it. A resume after a variant's end starts the next variant
from the recorded start, or redoes the merge (it is deterministic) when the last variant had ended.

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

import json
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from mindspore import Tensor

from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.checkpoint.integrity import verify_checkpoint
from mindvl_ms.checkpoint.io import STATE, read_tensors, write_json
from mindvl_ms.checkpoint.merge import merge
from mindvl_ms.checkpoint.pretrained import load_into, load_pretrained, model_tensors
from mindvl_ms.data.skiplog import SkipGuard, fingerprint_diff, stage_fingerprint
from mindvl_ms.data.vocab_subset import follow_vocab_subset
from mindvl_ms.parallel.moe import set_moe_seq_length
from mindvl_ms.parallel.runtime import HostAllReduce, gather_json, setup
from mindvl_ms.train.batches import CollateAhead, micro_batches, rank_slice
from mindvl_ms.train.build import (build_model, checkpoint_model_config, default_collate, default_data_factory,
                                   prepare_model, processor_writer)
from mindvl_ms.train.callbacks import (MetricsLog, ProgressBar, device_peak, param_counts, plot_stage, soc_version,
                                       summarize)
from mindvl_ms.train.lr import WarmupCosine
from mindvl_ms.train.mf_step import MFStep
from mindvl_ms.train.optim import select_trainable
from mindvl_ms.train.post.sampler import ResponseSampler
from mindvl_ms.train.post.sources import post_data_factory
from mindvl_ms.train.post.stage import check_post_stages, make_step_driver, plot_post
from mindvl_ms.train.post.step import drop_post_step
from mindvl_ms.train.train_step import StepResult, TrainStep, keep_train_step, kept_train_step

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (too many non-finite steps in a row); the message says what to do."""


def restore_optimizer(engine: TrainStep, optim: Dict[str, np.ndarray]) -> None:
    """Load a checkpoint's optimizer / loss-scale state into the step's Parameters."""
    params = engine.state_parameters()
    missing = sorted(set(params) - set(optim))
    if missing:
        raise ValueError(f"checkpoint optimizer state lacks {missing[:5]} (different trainable set?)")
    for k, p in params.items():
        p.set_data(Tensor(np.asarray(optim[k]).reshape(p.shape)))  # 0-d state is stored as [1]


def stage_end(stage_dir: str) -> str:
    """The checkpoint that ended the stage of `stage_dir` (the newest complete one whose trainer state says so)."""
    names = sorted((d for d in os.listdir(stage_dir) if d.startswith("checkpoint-")), reverse=True) \
        if os.path.isdir(stage_dir) else []
    for path in (os.path.join(stage_dir, d) for d in names):
        if ts.is_complete(path):
            with open(os.path.join(path, STATE), encoding="utf-8") as f:
                if json.load(f).get("stage_done"):
                    return path
    raise FileNotFoundError(f"{stage_dir}: no checkpoint that ended the stage (checkpoint-*/{STATE} with "
                            f"stage_done)")


@dataclass
class ResumePoint:
    """A checkpoint inside a stage: its trainer state (step, data position, counters) and optimizer tensors."""
    state: Dict[str, Any]
    optim: Dict[str, np.ndarray]


class Trainer:
    """One stage: its trainable parameters, compiled step and optimizer, data source and checkpoints.

    `train_step()` takes one optimizer step, `train()` runs the stage to its end and returns its report.
    `resume` continues the stage from a checkpoint taken inside it."""

    def __init__(self, chain: "StageChain", stage_index: int, resume: Optional[ResumePoint] = None):
        self.chain, self.si = chain, stage_index
        self.run_cfg, self.dist = chain.run_cfg, chain.dist
        self.stage = stage = chain.stages[stage_index]
        self.stage_dir = os.path.join(chain.out_dir, stage.name)
        ts.clean_partial(self.stage_dir)
        self.source = self._make_source()
        self.total = stage.total_steps(getattr(self.source, "rows_per_epoch", None))
        self.accum = stage.accumulation(self.dist.dp)
        self.sched = WarmupCosine(stage.max_lr, stage.min_lr, self.total, stage.warmup_ratio)
        self.params = select_trainable(chain.model, stage.trainable_prefixes())
        self.driver, self.engine = self._build_step(resuming=resume is not None)
        self.step, self.nonfinite_run, self.skipped, self.compile_time = 0, 0, 0, 0.0
        if resume is not None:
            self._restore(resume)
        self.guard = self._skip_guard()
        self.fingerprint = stage_fingerprint(self.run_cfg, stage)
        log.info("stage %s: %d steps, %d micro-batches x %d rows per rank, %d trainable tensors",
                 stage.name, self.total, self.accum, stage.micro_batch_size, len(self.params))
        self.write_processor = processor_writer(self.run_cfg, stage, chain.model)
        self.ahead = CollateAhead(lambda rows: [chain.collate(r, stage)
                                                for r in micro_batches(rows, stage.micro_batch_size)])

    # -- set-up ----------------------------------------------------------------------------------
    def _make_source(self):
        """The stage's row source; preference / prompt files for DPO / GRPO under the default factory."""
        factory = self.chain.data_factory
        if self.stage.type != "sft" and factory is default_data_factory:
            return post_data_factory(self.run_cfg, self.stage, self.si, self.dist, self.chain.sampler)
        return factory(self.run_cfg, self.stage, self.si, self.dist)

    def _build_step(self, resuming: bool):
        """(driver, engine): the SFT step, or a DPO / GRPO step driver with its own step (train/post/stage.py)."""
        c, stage = self.chain, self.stage
        moe_changed = set_moe_seq_length(c.model, stage.seq_length)  # expert-parallel dispatchers: the stage's rows
        if stage.type != "sft":
            keep_train_step(c.net, c.step_settings, None)  # the SFT step's state goes before the post step's
            driver = make_step_driver(dict(run_cfg=self.run_cfg, stage=stage, dist=self.dist, model=c.model,
                                           net=c.net, params=self.params, names=c.names, source=self.source,
                                           allreduce=c.allreduce, collate=c.collate, stage_dir=self.stage_dir,
                                           resuming=resuming, sampler=c.sampler))
            return driver, driver.engine
        ctx = self.run_cfg.context
        if self.dist.semi_auto:  # one compiled graph per optimizer step, MindFormers' wrappers (train/mf_step.py)
            return None, MFStep(c.net, self.params, c.names, stage.loss, stage, self.dist.dp, c.allreduce,
                                ctx.precision, ctx.loss_scale_value, ctx.loss_scale_factor, ctx.loss_scale_window,
                                pipeline_stages=self.run_cfg.parallel_config.pipeline_stage)
        args = (c.net, self.params, c.names, stage.loss, stage, self.dist.dp, c.allreduce, ctx.precision,
                ctx.loss_scale_value, ctx.loss_scale_factor, ctx.loss_scale_window)
        kw = dict(gradients_mean=self.run_cfg.parallel.gradients_mean, compiler_reduces=self.dist.compiler_reduces)
        drop_post_step(c.net)
        previous = kept_train_step(c.net, c.step_settings)  # the last SFT stage's, of this run or an earlier one
        if previous is not None and not moe_changed and previous.restart(*args, **kw):
            log.info("stage %s: the previous stage's compiled step fits it, reused", stage.name)
            return None, previous
        del previous
        keep_train_step(c.net, c.step_settings, None)  # the network holds no step but the current stage's
        engine = TrainStep(*args, **kw)
        keep_train_step(c.net, c.step_settings, engine)
        return None, engine

    def _restore(self, resume: ResumePoint) -> None:
        """Optimizer state, this rank's data position and the step counters of the checkpoint."""
        restore_optimizer(self.engine, resume.optim)
        state = resume.state
        data_state = state["data"]
        if isinstance(data_state, dict) and f"rank{self.dist.rank}" in data_state:
            data_state = data_state[f"rank{self.dist.rank}"]
        self.source.load_state_dict(data_state)
        self.step, self.skipped = state["step"], state.get("skipped", 0)
        self.nonfinite_run = state.get("nonfinite_run", 0)

    def _skip_guard(self) -> SkipGuard:
        loader = getattr(self.source, "loader", None)
        data_cfg = getattr(loader, "config", self.run_cfg.data)
        gather = (lambda o: gather_json(o, self.dist.world)) if self.dist.world > 1 else None
        return SkipGuard(self.stage.name, data_cfg.max_skip_fraction, self.chain.allreduce,
                         getattr(self.source, "rows_per_epoch", None), self.stage.global_batch_size, gather)

    # -- checkpoints -----------------------------------------------------------------------------
    def _data_states(self):
        """Every rank's loader state (gathered to rank 0) for per-rank loaders; one state otherwise."""
        own = self.source.state_dict()
        if not hasattr(self.source, "next_micro_batches") or self.dist.world == 1:
            return own
        return gather_json(own, self.dist.world)

    def save(self, step_now: int, done: bool) -> str:
        """Checkpoint at `step_now` (rank 0 writes; every rank takes part in gathering the data state)."""
        st = {"stage_index": self.si, "stage": self.stage.name, "step": step_now, "total_steps": self.total,
              "stage_done": done, "data": self._data_states(), "skipped": self.skipped,
              "nonfinite_run": self.nonfinite_run, "seed": self.run_cfg.seed, "data_fingerprint": self.fingerprint,
              "data_changes": self.chain.data_changes}
        if self.chain.schedule[self.si][1] is not None:  # a variant: its start is the next variant's start
            st["branch_from"] = os.path.relpath(self.chain.base, self.chain.out_dir)
        path = os.path.join(self.stage_dir, f"checkpoint-{step_now:06d}")
        if self.dist.is_main:
            ts.save_checkpoint(path, self.chain.model, self.engine.state_parameters(), st, self.chain.out_dir,
                               extra=self.write_processor)
            ts.prune(self.stage_dir, self.stage.keep_last, protect=path)
        return path

    # -- steps -----------------------------------------------------------------------------------
    def _draw(self) -> Optional[List[Dict[str, np.ndarray]]]:
        """This rank's micro-batches of the next global batch; None for DPO / GRPO (they draw their own)."""
        source = self.source
        if self.driver is not None:
            return None
        if hasattr(source, "next_micro_batches"):  # a per-rank loader that collates itself
            try:
                return source.next_micro_batches(self.accum)
            except RuntimeError as e:  # no batch in a whole epoch: say why, no traceback
                raise TrainingStopped(self.guard.no_data_message(getattr(source, "loader", source), e)) from None
        return self.ahead.take(rank_slice(source.next_global_batch(self.stage.global_batch_size), self.dist.dp_rank,
                                          self.dist.dp))

    def _collate_next(self) -> None:
        """The next step's rows collated while this step runs (`CollateAhead`); not when the source cannot
        show them without drawing, at the stage's end, nor before a checkpoint (it records the global RNGs)."""
        nxt, every = self.step + 1, self.stage.save_every
        if hasattr(self.source, "peek_global_batch") and nxt < self.total and not (every and nxt % every == 0):
            self.ahead.ahead(rank_slice(self.source.peek_global_batch(self.stage.global_batch_size),
                                        self.dist.dp_rank, self.dist.dp))

    def _supervised(self, mbs: List[Dict[str, np.ndarray]]) -> bool:
        """False when the global batch has no supervised token (never stepped: weight decay alone would
        move the weights); stops the stage when its loader skips too much."""
        g_sup, stop = self.guard.check(mbs, getattr(self.source, "loader", self.source))
        if stop:
            raise TrainingStopped(stop)
        if g_sup == 0:
            log.warning("stage %s step %d: the global batch has no supervised token (its samples "
                        "were skipped): not stepped", self.stage.name, self.step)
        return g_sup != 0

    def _record(self, res: StepResult, extra: Dict[str, Any], lr: float, dt: float) -> Dict[str, Any]:
        """The step's metrics record (OUT/metrics.jsonl, progress bar)."""
        rec = {"stage_index": self.si, "stage": self.stage.name, "step": self.step, "loss": res.loss, "lr": lr,
               "grad_norm": res.grad_norm, "loss_scale": res.loss_scale, "applied": res.applied,
               "tokens": res.tokens, "patches": res.patches, "supervised": res.supervised,
               "step_time": dt, "tokens_per_s": res.tokens * self.dist.dp / max(dt, 1e-9),
               "skipped_total": self.skipped, **extra}
        if res.expert_load is not None:  # MoE: balance of routed tokens (max/mean per layer)
            ld = res.expert_load
            rec["expert_max_over_mean"] = float((ld.max(-1) / np.maximum(ld.mean(-1), 1e-9)).max())
        return rec

    def train_step(self) -> Optional[Dict[str, Any]]:
        """One optimizer step at `self.step` (not advanced here); returns its record, or None when the
        global batch was not stepped (no supervised token)."""
        t0 = time.perf_counter()
        mbs = self._draw()
        if mbs is not None and not self._supervised(mbs):
            return None
        if mbs is not None:
            self._collate_next()
        lr = self.sched(self.step)
        n_compiled = self.engine.compiles
        res, extra = self.driver.step(self.step, lr) if self.driver is not None else (self.engine.run(mbs, lr), {})
        dt = time.perf_counter() - t0
        if self.engine.compiles != n_compiled:
            self.compile_time += dt
        if res.applied:
            self.nonfinite_run = 0
        else:
            self.nonfinite_run += 1
            self.skipped += 1
            log.warning("stage %s step %d: non-finite loss/gradient (loss %s, grad norm %s): update skipped "
                        "(%d in a row)", self.stage.name, self.step, res.loss, res.grad_norm, self.nonfinite_run)
        rec = self._record(res, extra, lr, dt)
        if self.step % self.stage.log_every == 0 or self.step == self.total - 1:
            self.chain.metrics.write(rec)
        return rec

    def _check_nonfinite_run(self) -> None:
        stage = self.stage
        if self.nonfinite_run >= stage.max_nonfinite:
            raise TrainingStopped(
                f"stage '{stage.name}': {self.nonfinite_run} steps in a row had a non-finite loss or gradient "
                f"(limit max_nonfinite={stage.max_nonfinite}); stopped at step {self.step}. The last good "
                f"checkpoint is in {self.chain.out_dir} (latest.json); lower max_lr, check the data, or use "
                f"float32, then --resume {self.chain.out_dir}")

    def train(self) -> Dict[str, Any]:
        """Run the stage's remaining steps, checkpoint its end; returns the stage report."""
        bar = ProgressBar(self.total, self.step, self.stage.name, enabled=self.chain.progress and self.dist.is_main)
        try:
            while self.step < self.total:
                rec = self.train_step()
                if rec is None:
                    continue
                bar.update(rec)
                self.step += 1
                self._check_nonfinite_run()
                if self.step < self.total and self.stage.save_every and self.step % self.stage.save_every == 0:
                    self.save(self.step, False)
        finally:
            self.ahead.close()
            bar.close()
            self.chain.metrics.close()  # report_to writers: flushed and closed at stage end, also on an error
        return self._report(self.save(self.total, True))

    def _report(self, final: str) -> Dict[str, Any]:
        """Plots and the stage report (steps, final checkpoint and loss, skipped steps and samples)."""
        stage, plot = self.stage, self.run_cfg.plot and self.dist.is_main
        recs = self.chain.metrics.read(stage.name)
        png = plot_stage(recs, os.path.join(self.stage_dir, "loss_lr.png"), stage.name) if plot else None
        n_skip, by_reason = self.guard.skipped(getattr(self.source, "loader", self.source))
        if self.driver is not None and plot:  # reward / margin panels
            plot_post(recs, os.path.join(self.stage_dir, "post_metrics.png"), stage.type, stage.name)
        log.info("stage %s done: %d steps, %d samples skipped%s", stage.name, self.total, n_skip,
                 f" ({', '.join(f'{k}: {v}' for k, v in by_reason.items())})" if n_skip else "")
        return {"stage": stage.name, "steps": self.total, "checkpoint": final, "plot": png,
                "final_loss": recs[-1]["loss"] if recs else None, "skipped_steps": self.skipped,
                "skipped_samples": n_skip, "skipped_by_reason": by_reason, "compiled_graphs": self.engine.compiles}


class StageChain:
    """What every stage shares (model, prepared network, process group, metrics log, data-change log);
    `run()` drives one `Trainer` per stage, from the resume point if any, and writes the summary."""

    def __init__(self, run_cfg, out_dir: str, model=None, data_factory: Optional[Callable] = None,
                 collate: Optional[Callable] = None, progress: bool = True, sampler: Optional[ResponseSampler] = None):
        self.run_cfg, self.out_dir, self.progress, self.sampler = run_cfg, out_dir, progress, sampler
        self.schedule = run_cfg.schedule()  # (stage as it trains, the stage it is a variant of or None)
        self.stages = [st for st, _ in self.schedule]
        self.base = run_cfg.init_from or None  # the checkpoint the next group of variants starts from
        check_post_stages(self.stages, sampler)
        self.dist = setup(run_cfg)
        os.makedirs(out_dir, exist_ok=True)
        np.random.seed(run_cfg.seed % 2**32)
        random.seed(run_cfg.seed)
        self.model = model if model is not None else build_model(run_cfg)
        self.net = prepare_model(self.model, run_cfg, self.dist)
        self.step_settings = (repr(run_cfg.recompute_config),)  # shapes the step's graphs beside graph_key
        self.collate = collate or default_collate(run_cfg)
        self.data_factory = data_factory or default_data_factory
        self.names = list(getattr(self.model, "INPUT_NAMES"))
        self.metrics = MetricsLog(os.path.join(out_dir, "metrics.jsonl"), enabled=self.dist.is_main,
                                  report_to=run_cfg.report_to)
        self.allreduce = HostAllReduce(self.dist.world, self.dist.dp)
        self.data_changes: List[Dict[str, Any]] = []

    def _check_data(self, state: Dict[str, Any], ck: str, resume: str, allow_data_change: bool) -> None:
        """Stop (before anything is changed) when the stage's data differ from the checkpoint's, unless
        allowed; an allowed change is logged and recorded in later checkpoints."""
        diff = fingerprint_diff(state["data_fingerprint"],
                                stage_fingerprint(self.run_cfg, self.stages[state["stage_index"]]))
        if diff and not allow_data_change:
            raise TrainingStopped(f"--resume {resume}: the data of stage '{state['stage']}' is not the data "
                                  f"of {ck} ({diff}); resuming would continue its saved position on other "
                                  f"data. Restore the original data, or pass --resume-allow-data-change")
        if diff:
            log.warning("resuming stage %s on changed data (%s)", state["stage"], diff)
            self.data_changes.append({"stage": state["stage"], "step": state["step"], "change": diff})

    def resume(self, resume: str, allow_data_change: bool) -> Tuple[int, Optional[ResumePoint]]:
        """Load the latest checkpoint under `resume`: weights, RNG, metrics log cut back to it.
        Returns (first stage to run, the point inside it or None when the checkpoint ended a stage)."""
        ck = ts.find_latest(resume)
        state, tensors, optim = ts.load_checkpoint(ck)
        self.data_changes = list(state.get("data_changes", []))
        if "data_fingerprint" in state and not state["stage_done"]:  # checked before anything is changed
            self._check_data(state, ck, resume, allow_data_change)
        load_into(self.model, tensors)
        start_stage, start_step = state["stage_index"], state["step"]
        self.metrics.truncate_after(start_stage, start_step - 1 if not state["stage_done"] else start_step)
        ts.set_rng_state(state["rng"])
        point = ResumePoint(state, optim)
        self.base = os.path.join(self.out_dir, state["branch_from"]) if "branch_from" in state else ck
        if state["stage_done"]:
            start_stage, start_step, point = start_stage + 1, 0, None
        log.info("resumed from %s (stage %d, step %d)", ck, start_stage, start_step)
        return start_stage, point

    # -- variants --------------------------------------------------------------------------------
    def _ends_group(self, si: int) -> bool:
        """True when schedule entry `si` is the last variant of its stage."""
        if si < 0 or self.schedule[si][1] is None:
            return False
        return si + 1 == len(self.schedule) or self.schedule[si + 1][1] is not self.schedule[si][1]

    def branch(self, si: int) -> None:
        """Give the model the weights the variant at schedule entry `si` starts from (`self.base`): a
        training checkpoint with its RNG state, or `init_from` with the RNG seeded as a fresh run seeds it."""
        if self.base is None:
            raise TrainingStopped(f"variant '{self.stages[si].name}' has no checkpoint to start from: put a stage "
                                  f"before it or set init_from")
        if os.path.isfile(os.path.join(self.base, STATE)):
            verify_checkpoint(self.base)  # the weights (the optimizer state is not read)
            with open(os.path.join(self.base, STATE), encoding="utf-8") as f:
                ts.set_rng_state(json.load(f)["rng"])
            tensors = read_tensors(self.base)
        else:
            np.random.seed(self.run_cfg.seed % 2**32)
            random.seed(self.run_cfg.seed)
            tensors = model_tensors(load_pretrained(type(self.model), self.base))  # native or HF layout
        load_into(self.model, tensors)
        log.info("variant %s starts from %s", self.stages[si].name, self.base)

    def merge_variants(self, last: int) -> Dict[str, Any]:
        """Merge the final checkpoints of the variants whose group ends at schedule entry `last` through
        `checkpoint.merge.merge` (rank 0 writes it, every rank waits) and continue from the merge; returns
        what was merged."""
        group = self.schedule[last][1]
        names = list(group.variants)
        inputs = [stage_end(os.path.join(self.out_dir, n)) for n in names]
        out = os.path.join(self.out_dir, group.merge.out or os.path.join(group.name, "merged"))
        weights = [group.merge.weights[n] for n in names] if group.merge.weights else None
        base = self.base if group.merge.method != "linear" else None  # task vectors against the variants' start
        if self.dist.is_main:
            merge(inputs, out, method=group.merge.method, weights=weights, base=base, density=group.merge.density,
                  scale=group.merge.scale, overwrite=True, progress=self.progress)
        if self.dist.world > 1:
            gather_json(None, self.dist.world)  # the other ranks wait for rank 0's merge
        load_into(self.model, read_tensors(out))
        self.base = out  # a later stage's variants start from the merge
        log.info("stage %s: variants %s merged (%s) into %s", group.name, names, group.merge.method, out)
        return {"stage": group.name, "checkpoint": out, "method": group.merge.method, "inputs": inputs,
                "weights": weights}

    def run(self, t_start: float, resume: Optional[str] = None, allow_data_change: bool = False) -> Dict[str, Any]:
        """Every stage from the resume point (or the first); returns the summary (also OUT/summary.json)."""
        start_stage, point = 0, None
        metrics_path = os.path.join(self.out_dir, "metrics.jsonl")
        if resume:
            start_stage, point = self.resume(resume, allow_data_change)
        elif self.dist.is_main and os.path.isfile(metrics_path):
            os.remove(metrics_path)  # a fresh run in a reused directory
        ts.clean_partial(self.out_dir)
        peak, peak_source = device_peak(self.run_cfg.context.device_target, soc_version(),
                                        self.run_cfg.context.precision)
        log.info("MFU peak: %.2f TFLOP/s per device (%s)", peak / 1e12, peak_source)
        counts = param_counts(self.model)
        reports, merges, compile_time = [], [], 0.0
        if resume and point is None and self._ends_group(start_stage - 1):  # resumed after the last variant
            merges.append(self.merge_variants(start_stage - 1))
        for si in range(start_stage, len(self.stages)):
            group = self.schedule[si][1]
            if group is not None and not (si == start_stage and point is not None):
                self.branch(si)
            trainer = Trainer(self, si, point if si == start_stage else None)
            reports.append(trainer.train())
            compile_time += trainer.compile_time
            if group is not None:
                reports[-1]["variant_of"] = group.name
            if self._ends_group(si):
                merges.append(self.merge_variants(si))
            elif group is None:
                self.base = reports[-1]["checkpoint"]
            del trainer  # a step the next stage does not restart is freed before the next one is built
        summary = summarize(self.metrics.read(), counts, peak, self.dist.world, time.perf_counter() - t_start,
                            compile_time, peak_source)
        summary.update({"stages": reports, "merges": merges, "out_dir": self.out_dir, "ranks": self.dist.world,
                        "peak_gflops_per_device": peak / 1e9})
        self.metrics.write_summary(summary)
        if self.dist.is_main:
            write_json(os.path.join(self.out_dir, "summary.json"), summary)
        return summary


def run_training(run_cfg, out_dir: str, resume: Optional[str] = None, model=None,
                 data_factory: Optional[Callable] = None, collate: Optional[Callable] = None,
                 progress: bool = True, allow_data_change: bool = False,
                 sampler: Optional[ResponseSampler] = None) -> Dict[str, Any]:
    """Run every stage of `run_cfg`; returns the run summary (also written to OUT/summary.json).

    model: a Cell taking INPUT_NAMES arrays (default: MindVL from run_cfg.model / init_from);
    data_factory(run_cfg, stage, stage_index, dist) -> a row source (see train/batches.py);
    collate(rows, stage) -> arrays dict (default: data.collate.build_model_inputs);
    sampler: what GRPO stages sample responses with (train/post/sampler.py; e.g.
    `mindvl_ms.infer.rollout.EngineSampler()`), unused by other stages.
    """
    t_start = time.perf_counter()
    follow_vocab_subset(run_cfg)  # a data.tokenizer with vocab_subset.json sets the model's vocabulary
    if model is None and run_cfg.init_from:  # the checkpoint is the model: batches follow its config
        run_cfg = checkpoint_model_config(run_cfg)
    chain = StageChain(run_cfg, out_dir, model, data_factory, collate, progress, sampler)
    return chain.run(t_start, resume, allow_data_change)
