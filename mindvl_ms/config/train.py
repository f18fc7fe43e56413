"""Training run configs: the run (seed, model, data, stages) and the MindSpore/MindFormers sections.

Design:
- `RunConfig` is the top of a training YAML (`mindvl train --config FILE`): `seed`, `model` (a
  MindVLConfig; usually pulled in with `_include_: [../model/tiny.yaml]`), `data` (the DataConfig
  of `mindvl_ms.config.data`), `stages` (a list run in order, each starting from the previous
  stage's weights) and the `context`, `parallel`, `parallel_config`, `recompute_config` sections,
  whose key names mirror MindSpore's `set_context`/`set_auto_parallel_context` and MindFormers'
  YAML so a MindFormers user recognises them.
- A stage may declare `variants` (MindVL section 5.3: SFT at 2K/4K/8K tokens with their own pixel budgets):
  each variant is the stage with some keys overridden, all start from the weights the stage starts from,
  and their `merge` (checkpoint/merge.py) is the stage's result. `RunConfig.schedule()` lists the stages
  as they train, variants expanded.
- A stage carries its whole recipe (MindVL Table 1 / openPangu-VL Table 2 columns): trainable
  modules, per-module LR coefficients, sequence length, global/micro batch, warm-up ratio, max/min
  LR, epochs or token budget, loss. Batch arithmetic is checked when the data-parallel size is known
  (`StageConfig.accumulation(dp)`), everything else in `validate()`.

Load with `load_run_config(path, overrides)`; docs/CONFIG.md lists every field with its doc.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from mindvl_ms.config.base import ConfigError, F, deep_merge, load, read_yaml, set_dotted, sub, to_dict
from mindvl_ms.config.model import MindVLConfig
from mindvl_ms.config.packaged import resolve_config
from mindvl_ms.config.post import DPOConfig, GRPOConfig

from mindvl_ms.config.data import DataConfig


PROJECTOR_PREFIX = "visual.merger."
REPORT_TARGETS = ("tensorboard",)  # accepted values of `report_to`
MERGE_METHODS = ("linear", "task_arithmetic", "ties")  # checkpoint/merge.py's methods (a layer below: not importable)
NOT_IN_VARIANT = ("name", "variants", "merge")  # stage keys a variant cannot override
MODULE_PREFIXES = {  # names usable in `trainable` / `lr_coefficients`
    "projector": ["visual.merger."],
    "vision": ["visual."],
    "visual": ["visual."],
    "llm": ["model.", "lm_head."],
    "all": [""],
}


@dataclass
class LossConfig:
    """Training loss: plain token mean or the openPangu-VL balanced loss (report eq. 1)."""

    type: str = F("token_mean", "token_mean (mean CE over supervised tokens) or balanced (openPangu-VL eq. 1)")
    lambda1: float = F(1.0, "balanced: weight of the per-token term L_t")
    lambda2: float = F(1.0, "balanced: weight of the per-sample term L_s")
    tau1: float = F(0.1, "balanced: order weight 1/ln(e + tau1*i), i = index of the target in its sample")
    tau2: float = F(2.0, "balanced: magnitude weight 2*sigmoid(tau2*CE - 0.5)")
    logits_chunk_tokens: int = F(1024, "most positions whose [tokens, vocab] logits exist at once: the LM head "
                                       "runs only at supervised positions, this many at a time (train/loss_head.py); when "
                                       "micro_batch_size x seq_length fits, in one block with no chunk loop")

    def validate(self) -> None:
        if self.type not in ("token_mean", "balanced"):
            raise ConfigError(f"loss.type '{self.type}': expected token_mean or balanced")
        if self.lambda1 < 0 or self.lambda2 < 0 or self.lambda1 + self.lambda2 <= 0:
            raise ConfigError(f"loss lambda1={self.lambda1}, lambda2={self.lambda2}: need >= 0 and not both 0")
        if self.tau1 < 0 or self.tau2 < 0:
            raise ConfigError(f"loss tau1={self.tau1}, tau2={self.tau2}: must be >= 0")
        if self.logits_chunk_tokens < 1:
            raise ConfigError(f"loss.logits_chunk_tokens {self.logits_chunk_tokens}: must be >= 1")


@dataclass
class MergeConfig:
    """`merge:` of a stage with `variants`: how the variants' final checkpoints become the stage's result, the
    weights the next stage starts from (checkpoint/merge.py). MindVL (section 5.3) averages its 2K/4K/8K SFT
    variants uniformly: the default."""

    method: str = F("linear", "linear (weighted average), task_arithmetic or ties (task vectors taken against the "
                              "checkpoint the variants start from)")
    weights: Dict[str, float] = F({}, "weight per variant name, e.g. {sft_2k: 1, sft_4k: 1, sft_8k: 2}; {}: 1 each "
                                      "(linear, ties) or 1/N each (task_arithmetic); linear normalises them")
    density: float = F(0.2, "ties: fraction of each task vector kept (by magnitude, per tensor)")
    scale: float = F(1.0, "task_arithmetic / ties: factor on the merged task vector")
    out: str = F("", "directory of the merged checkpoint, relative to the run's output directory (empty: "
                     "<stage>/merged)")

    def check(self, stage: str, variants: List[str]) -> None:
        if self.method not in MERGE_METHODS:
            raise ConfigError(f"stage '{stage}': merge.method '{self.method}': expected one of "
                              f"{', '.join(MERGE_METHODS)}")
        if self.weights and sorted(self.weights) != sorted(variants):
            raise ConfigError(f"stage '{stage}': merge.weights names {sorted(self.weights)}; give one weight per "
                              f"variant {sorted(variants)} or none (equal weights)")
        if self.method != "task_arithmetic" and self.weights and (
                min(self.weights.values()) < 0 or sum(self.weights.values()) <= 0):
            raise ConfigError(f"stage '{stage}': merge.weights must be >= 0 with a positive sum")
        if not 0 < self.density <= 1:
            raise ConfigError(f"stage '{stage}': merge.density {self.density}: expected 0 < density <= 1")


@dataclass
class StageConfig:
    """One training stage (a column of MindVL Table 1 / openPangu-VL Table 2)."""

    name: str = F("stage", "stage name (checkpoints go to OUT/<name>/)")
    data: Dict[str, Any] = F({}, "overrides of the run-level `data` section for this stage (data mix)")
    trainable: Union[str, List[str]] = F("all", "projector | all | list of modules (projector, vision, llm) "
                                                "or parameter-name prefixes; everything else is frozen")
    lr_coefficients: Dict[str, float] = F({}, "LR multiplier per module/prefix, e.g. {vision: 0.1}")
    seq_length: int = F(4096, "tokens per packed row")
    global_batch_size: int = F(8, "rows per optimizer step over all data-parallel ranks")
    micro_batch_size: int = F(1, "rows per forward/backward on one rank (accumulation fills the rest)")
    warmup_ratio: float = F(0.1, "fraction of the stage's steps with linear LR warm-up")
    max_lr: float = F(1e-4, "peak LR (after warm-up)")
    min_lr: float = F(0.0, "final LR of the cosine decay")
    epochs: Optional[float] = F(1.0, "passes over the stage data (used when token_budget is null)")
    token_budget: Optional[int] = F(None, "stop after this many tokens (global_batch*seq_length per step)")
    max_steps: Optional[int] = F(None, "hard cap on optimizer steps (for smoke runs)")
    weight_decay: float = F(0.1, "AdamW decoupled weight decay (not on norms and biases)")
    adam_beta1: float = F(0.9, "AdamW beta1")
    adam_beta2: float = F(0.95, "AdamW beta2")
    adam_eps: float = F(1e-8, "AdamW epsilon")
    grad_clip: float = F(1.0, "clip gradients to this global L2 norm (0 disables)")
    loss: LossConfig = sub(LossConfig, "loss of this stage")
    save_every: int = F(0, "save a checkpoint every N optimizer steps (0: only at stage end)")
    keep_last: int = F(2, "checkpoints kept per stage, the newest ones, the stage-end one among them (it is never "
                          "pruned)")
    max_nonfinite: int = F(5, "stop when this many steps in a row have a non-finite loss/gradient")
    log_every: int = F(1, "write a metrics line every N steps")
    # ---- post-training (config/post.py, train/post/dpo.py, train/post/grpo.py) --------------------------------
    type: str = F("sft", "sft (next-token loss), dpo (preference pairs) or grpo (RL with verifiable rewards)")
    dpo: DPOConfig = sub(DPOConfig, "DPO / MPO settings (type: dpo)")
    grpo: GRPOConfig = sub(GRPOConfig, "GRPO settings (type: grpo)")
    # ---- variants merged into one result (MindVL section 5.3) -------------------------------------------------
    variants: Dict[str, Dict[str, Any]] = F({}, "train this stage as several variants instead, each from the "
                                                "weights the stage starts from: variant name -> overrides of this "
                                                "stage's keys, e.g. {sft_2k: {seq_length: 2048, data: {image: "
                                                "{max_pixels: 1003520}}}}; a variant's checkpoints go to "
                                                "OUT/<variant>/, their merge (`merge`) to OUT/<stage>/merged and is "
                                                "what the next stage starts from")
    merge: MergeConfig = sub(MergeConfig, "how the variants are merged (a stage with `variants`)")

    def variant_stages(self) -> List["StageConfig"]:
        """The stages the variants train: this stage's keys with each variant's overrides (deep-merged, so
        `data: {image: {max_pixels: N}}` changes one key of the stage's data overrides), named after the
        variant. A stage without variants gives []."""
        base = {k: v for k, v in to_dict(self).items() if k not in ("variants", "merge")}
        return [load(StageConfig, deep_merge(base, {**over, "name": name}),
                     source=f"stage '{self.name}' variant '{name}'") for name, over in self.variants.items()]

    def validate_variants(self) -> None:
        if not self.variants:
            return
        if len(self.variants) < 2:
            raise ConfigError(f"stage '{self.name}': variants {sorted(self.variants)}: give at least two to merge")
        for name, over in self.variants.items():
            fixed = sorted(set(over or {}) & set(NOT_IN_VARIANT))
            if fixed:
                raise ConfigError(f"stage '{self.name}': variant '{name}' sets {fixed}: a variant's name is its key, "
                                  f"and variants and merge belong to the stage")
        self.merge.check(self.name, list(self.variants))
    # ---- end of the variants block ------------------------------------------------------------------------

    def validate_post(self) -> None:
        if self.type not in ("sft", "dpo", "grpo"):
            raise ConfigError(f"stage '{self.name}': type '{self.type}': expected sft, dpo or grpo")
        if self.type == "dpo":
            self.dpo.check(self.name)
        if self.type == "grpo":
            self.grpo.check(self.name, self.global_batch_size)
    # ---- end of post-training block -------------------------------------------------------------------

    def validate(self) -> None:
        self.validate_post()
        self.validate_variants()
        for k in ("seq_length", "global_batch_size", "micro_batch_size", "max_nonfinite", "log_every"):
            if getattr(self, k) < 1:
                raise ConfigError(f"stage '{self.name}': {k} must be >= 1, got {getattr(self, k)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"stage '{self.name}': global_batch_size {self.global_batch_size} is not a "
                              f"multiple of micro_batch_size {self.micro_batch_size}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"stage '{self.name}': warmup_ratio {self.warmup_ratio} must be in [0, 1)")
        if self.max_lr <= 0 or self.min_lr < 0 or self.min_lr > self.max_lr:
            raise ConfigError(f"stage '{self.name}': need 0 <= min_lr <= max_lr and max_lr > 0 "
                              f"(got min_lr={self.min_lr}, max_lr={self.max_lr})")
        if self.epochs is None and self.token_budget is None and self.max_steps is None:
            raise ConfigError(f"stage '{self.name}': set epochs, token_budget or max_steps")
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"stage '{self.name}': epochs must be > 0, got {self.epochs}")
        if self.token_budget is not None and self.token_budget <= 0:
            raise ConfigError(f"stage '{self.name}': token_budget must be > 0, got {self.token_budget}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"stage '{self.name}': max_steps must be >= 1, got {self.max_steps}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1) or self.adam_eps <= 0:
            raise ConfigError(f"stage '{self.name}': AdamW betas must be in [0, 1) and eps > 0")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.save_every < 0 or self.keep_last < 1:
            raise ConfigError(f"stage '{self.name}': weight_decay, grad_clip, save_every must be >= 0, keep_last >= 1")
        mods = [self.trainable] if isinstance(self.trainable, str) else list(self.trainable)
        if not mods:
            raise ConfigError(f"stage '{self.name}': trainable is empty (nothing would train)")
        for c in self.lr_coefficients.values():
            if c < 0:
                raise ConfigError(f"stage '{self.name}': lr_coefficients must be >= 0, got {c}")

    def trainable_prefixes(self) -> List[str]:
        """Parameter-name prefixes that train in this stage ('' matches everything)."""
        mods = [self.trainable] if isinstance(self.trainable, str) else list(self.trainable)
        return [p for m in mods for p in MODULE_PREFIXES.get(m, [m])]

    def lr_prefixes(self) -> Dict[str, float]:
        """Prefix -> LR coefficient (module names expanded)."""
        return {p: c for m, c in self.lr_coefficients.items() for p in MODULE_PREFIXES.get(m, [m])}

    def accumulation(self, dp: int) -> int:
        """Micro-batches per rank per optimizer step; raises if the batch does not split over `dp` ranks."""
        per_rank, rem = divmod(self.global_batch_size, dp)
        if rem or per_rank % self.micro_batch_size:
            raise ConfigError(f"stage '{self.name}': global_batch_size {self.global_batch_size} must be a "
                              f"multiple of data_parallel ({dp}) x micro_batch_size ({self.micro_batch_size})")
        return per_rank // self.micro_batch_size

    def total_steps(self, rows_per_epoch: Optional[int]) -> int:
        """Optimizer steps of the stage from token budget, epochs (given the rows per epoch) or max_steps."""
        steps = []
        if self.token_budget is not None:
            steps.append(math.ceil(self.token_budget / (self.global_batch_size * self.seq_length)))
        elif self.epochs is not None and rows_per_epoch is not None:
            steps.append(max(1, math.floor(self.epochs * rows_per_epoch / self.global_batch_size)))
        if self.max_steps is not None:
            steps.append(self.max_steps)
        if not steps:
            raise ConfigError(f"stage '{self.name}': cannot size the stage (epochs need a dataset of known size)")
        return min(steps)


@dataclass
class ParallelSpeedUp:
    """`context.parallel_speed_up:` MindSpore's communication/computation overlap switches under MindSpore 2.9's
    names: the keys of the JSON file `set_context(ascend_config={'parallel_speed_up_json_path': FILE})` reads
    (`parallel/runtime.py` writes that file from these fields). They act on the communication that semi-auto /
    auto parallel inserts, so they apply to Ascend runs only."""

    grad_matmul_communication_overlap: bool = F(False, "overlap the weight-gradient MatMuls with the tensor-parallel "
                                                       "communication of the backward pass")
    recomputation_communication_overlap: bool = F(False, "overlap recomputed operators with communication "
                                                         "(with recompute_config.recompute)")
    grad_fa_allgather_overlap: bool = F(False, "sequence parallel: overlap the AllGather recomputed for the "
                                               "backward pass with FlashAttentionScoreGrad")
    computation_communication_fusion_level: int = F(0, "fuse computation and communication tasks so they run in "
                                                       "part in parallel: 0 off, 1 forward, 2 backward, 3 both")
    allreduce_and_biasadd_swap: bool = F(False, "swap the order of a row-parallel linear's AllReduce and its 1-D "
                                                "bias add")
    grad_computation_allreduce_overlap: bool = F(False, "overlap the input-gradient operators with the "
                                                        "data-parallel gradient AllReduce")
    computation_allgather_overlap: bool = F(False, "overlap forward operators with the parallel optimizer's "
                                                   "parameter AllGather (parallel.enable_parallel_optimizer)")

    def validate(self) -> None:
        if self.computation_communication_fusion_level not in (0, 1, 2, 3):
            raise ConfigError(f"context.parallel_speed_up.computation_communication_fusion_level "
                              f"{self.computation_communication_fusion_level}: expected 0, 1, 2 or 3")


@dataclass
class ContextConfig:
    """MindSpore context (names as in `mindspore.set_context`) and numeric precision."""

    mode: int = F(0, "0 = GRAPH_MODE (the train step is a compiled graph), 1 = PYNATIVE_MODE")
    device_target: str = F("CPU", "CPU or Ascend")
    precision: str = F("float32", "compute dtype: float32, float16 (dynamic loss scaling) or bfloat16 (Ascend)")
    loss_scale_value: float = F(65536.0, "initial dynamic loss scale (float16)")
    loss_scale_factor: float = F(2.0, "loss scale is divided by this on overflow, multiplied after a window")
    loss_scale_window: int = F(1000, "good steps before the loss scale grows")
    max_device_memory: str = F("", "Ascend: e.g. '58GB' (empty: MindSpore default)")
    jit_level: str = F("O0", "graph compile level: set_context(jit_config={'jit_level': ...}) on Ascend (O0/O1/O2)")
    parallel_speed_up: ParallelSpeedUp = sub(ParallelSpeedUp, "communication/computation overlap (Ascend, "
                                                               "semi-auto / auto parallel)")
    bind_core: bool = F(False, "msrun binds each worker process to its own CPU cores: scripts/msrun_train.sh "
                               "passes msrun --bind_core=True (read by the launcher, before the workers start)")

    def validate(self) -> None:
        if self.mode not in (0, 1):
            raise ConfigError(f"context.mode {self.mode}: expected 0 (graph) or 1 (pynative)")
        if self.device_target not in ("CPU", "Ascend"):
            raise ConfigError(f"context.device_target '{self.device_target}': expected CPU or Ascend")
        if self.precision not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"context.precision '{self.precision}': expected float32, float16 or bfloat16")
        if self.loss_scale_value <= 0 or self.loss_scale_factor <= 1 or self.loss_scale_window < 1:
            raise ConfigError("context: loss_scale_value > 0, loss_scale_factor > 1, loss_scale_window >= 1 required")
        if self.jit_level not in ("O0", "O1", "O2"):
            raise ConfigError(f"context.jit_level '{self.jit_level}': expected O0, O1 or O2")


@dataclass
class AutoParallelContext:
    """`parallel:` section: the arguments of `mindspore.set_auto_parallel_context` (MindFormers' names)."""

    parallel_mode: int = F(0, "0 data_parallel, 1 semi_auto_parallel, 2 auto_parallel, 3 hybrid_parallel")
    gradients_mean: bool = F(False, "average (true) or sum gradients across ranks; the loss is already "
                                    "normalised by global counts, so false gives the single-process result")
    full_batch: bool = F(False, "every rank reads the whole batch (semi-auto parallel)")
    enable_parallel_optimizer: bool = F(False, "shard optimizer states over data-parallel ranks (Ascend)")
    search_mode: str = F("sharding_propagation", "auto_parallel search mode")
    strategy_ckpt_save_file: str = F("", "where MindSpore writes the sharding strategy (empty: none)")

    def validate(self) -> None:
        if self.parallel_mode not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.parallel_mode {self.parallel_mode}: expected 0, 1, 2 or 3")


@dataclass
class ParallelConfig:
    """`parallel_config:` section (MindFormers TransformerOpParallelConfig names)."""

    data_parallel: int = F(1, "data-parallel size (must equal the number of ranks / (mp*pp))")
    model_parallel: int = F(1, "tensor-parallel size")
    pipeline_stage: int = F(1, "pipeline stages")
    expert_parallel: int = F(1, "expert-parallel size (MoE)")
    use_seq_parallel: bool = F(False, "sequence parallel inside tensor-parallel groups")
    vocab_emb_dp: bool = F(True, "data-parallel (not sharded) embedding and LM head; false splits the vocab "
                                 "over the tensor-parallel group (when it divides)")
    vision_parallel: str = F("dp", "ViT and projector under tensor parallel: dp (weights whole; the TP group "
                                   "splits each micro-batch's images by cost and all-gathers the features) or "
                                   "tp (column/row split like the LLM)")
    gradient_aggregation_group: int = F(4, "consecutive decoder layers whose gradients are reduced together "
                                           "(Parameter.comm_fusion = layer // group + 1; semi-auto parallel)")
    offset: List[int] = F([], "extra decoder layers per pipeline stage when layers % pipeline_stage != 0 "
                              "(MindFormers `offset`; stage i gets layers // pp + offset[i])")

    def validate(self) -> None:
        for k in ("data_parallel", "model_parallel", "pipeline_stage", "expert_parallel",
                  "gradient_aggregation_group"):
            if getattr(self, k) < 1:
                raise ConfigError(f"parallel_config.{k} must be >= 1, got {getattr(self, k)}")
        if self.vision_parallel not in ("dp", "tp"):
            raise ConfigError(f"parallel_config.vision_parallel '{self.vision_parallel}': expected dp or tp")

    @property
    def vision_ranks(self) -> int:
        """Ranks that split a micro-batch's images between them (`parallel.vit_balance`): the tensor-parallel
        group under `vision_parallel: dp` (each encodes its balanced share with the whole ViT), else 1."""
        return self.model_parallel if self.vision_parallel == "dp" else 1


@dataclass
class RecomputeConfig:
    """`recompute_config:` section (activation checkpointing), MindFormers names."""

    recompute: bool = F(False, "recompute every decoder layer / vision block in the backward pass")
    select_recompute: bool = F(False, "when recompute is off: recompute only the attention-core, rotary and "
                                      "gated-activation primitives of each layer/block")
    mp_comm_recompute: bool = F(True, "with recompute: also recompute the model-parallel communication of the "
                                      "recomputed layers (primitives marked recompute_comm_op)")
    recompute_slice_activation: bool = F(False, "with recompute: slice the activations a recomputed layer keeps "
                                                "over the model-parallel group (primitives marked slice_activation)")


@dataclass
class RunConfig:
    """A training run: model, data and a list of stages run in order."""

    seed: int = F(1234, "seed for parameter init, data order and any sampling")
    model: MindVLConfig = sub(MindVLConfig, "the model (often `_include_`d from configs/model/*.yaml)")
    init_from: str = F("", "checkpoint directory to start from (empty: random init from `model`)")
    data: DataConfig = sub(DataConfig, "data shared by all stages (a stage's `data` overrides keys)")
    stages: List[StageConfig] = F([], "stages, run in order; each starts from the previous one's weights (a stage "
                                      "with `variants`: from the merge of its variants)")
    context: ContextConfig = sub(ContextConfig, "MindSpore context and precision")
    parallel: AutoParallelContext = sub(AutoParallelContext, "MindSpore auto-parallel context")
    parallel_config: ParallelConfig = sub(ParallelConfig, "parallel sizes (data/tensor/pipeline/expert)")
    recompute_config: RecomputeConfig = sub(RecomputeConfig, "activation checkpointing")
    plot: bool = F(True, "write loss/LR PNG plots per stage")
    report_to: List[str] = F([], "where the step metrics and the run summary also go, besides OUT/metrics.jsonl "
                                 "and OUT/summary.json: [tensorboard] writes TensorBoard event files to "
                                 "OUT/tensorboard/ (tags: the metrics.jsonl names, summary/<name>; step: the "
                                 "optimizer step counted over all stages); [] none")

    def validate(self) -> None:
        if not self.stages:
            raise ConfigError("`stages` is empty: a run needs at least one stage")
        names = [s.name for s in self.stages] + [v for s in self.stages for v in s.variants]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"stage and variant names must be unique (each names a directory), repeated: "
                              f"{sorted(dup)}")
        if self.stages[0].variants and not self.init_from:
            raise ConfigError(f"stage '{self.stages[0].name}': variants start from the checkpoint of the stage "
                              f"before them; as the first stage it needs `init_from`")
        self.schedule()  # every variant loads
        unknown = [t for t in self.report_to if t not in REPORT_TARGETS]
        if unknown:
            raise ConfigError(f"report_to: unknown {unknown}; accepted values: {list(REPORT_TARGETS)} (or [] for none)")
        if self.context.precision == "bfloat16" and self.context.device_target == "CPU":
            raise ConfigError("context.precision bfloat16 needs Ascend (no bf16 matmul on CPU); use float16 or float32")

    def schedule(self) -> List[Tuple[StageConfig, Optional[StageConfig]]]:
        """The stages as they train, in order: (stage, None) for a plain stage, and for a stage with
        `variants` one (variant, stage) per variant. Stage indices in checkpoints and metrics count here."""
        out: List[Tuple[StageConfig, Optional[StageConfig]]] = []
        for st in self.stages:
            out += [(v, st) for v in st.variant_stages()] if st.variants else [(st, None)]
        return out

    def stage_data(self, stage: StageConfig) -> DataConfig:
        """The data config one stage reads: the run's `data`, the stage's `data` overrides, and the stage's
        `seq_length` and `micro_batch_size` (a stage's rows are its own length, so budgets such as
        max_image_tokens are checked against it, not against the run-level default)."""
        merged = deep_merge(deep_merge(to_dict(self.data), stage.data),
                            {"seq_length": stage.seq_length, "micro_batch_size": stage.micro_batch_size})
        return load(DataConfig, merged, source=f"stage '{stage.name}' data")


def load_run_config(path: Optional[str] = None, overrides: Optional[List[str]] = None,
                    data: Optional[Dict[str, Any]] = None) -> RunConfig:
    """Read a run YAML (with `_include_`), apply `--set key=value` overrides, validate."""
    raw = read_yaml(path) if path else dict(data or {})
    _resolve_model(raw, os.path.dirname(os.path.abspath(path)) if path else os.getcwd())
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"--set {ov!r}: expected key=value")
        k, v = ov.split("=", 1)
        _set_with_index(raw, k.strip(), v)
    return load(RunConfig, raw, source=path or "<dict>")


def msrun_bind_core(argv: List[str]) -> int:
    """Print `context.bind_core` (True or False) of the run config that the arguments of a `mindvl` command
    name when the command is `train` (`--config FILE` and its `--set KEY=VALUE` overrides; False for any other
    command). scripts/msrun_train.sh calls this before it starts msrun, whose `--bind_core` applies to the
    workers it spawns. Returns the exit status: 2, with the error on stderr, when the config does not load."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config")
    parser.add_argument("--set", action="append", default=[])
    args, _ = parser.parse_known_args(argv[1:])
    if argv[:1] != ["train"] or not args.config:
        print(False)
        return 0
    try:
        cfg = load_run_config(resolve_config(args.config)[0], args.set)
    except (ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(cfg.context.bind_core)
    return 0


def _resolve_model(raw: Dict[str, Any], base_dir: str) -> None:
    """`model: ../model/tiny.yaml` or `model: {_include_: ../model/tiny.yaml, <overrides>}` -> the mapping."""
    m = raw.get("model")
    if isinstance(m, str):
        raw["model"] = read_yaml(os.path.join(base_dir, m))
    elif isinstance(m, dict) and "_include_" in m:
        inc = m.pop("_include_")
        merged: Dict[str, Any] = {}
        for p in [inc] if isinstance(inc, str) else inc:
            merged = deep_merge(merged, read_yaml(os.path.join(base_dir, p)))
        raw["model"] = deep_merge(merged, m)


def _set_with_index(raw: Dict[str, Any], dotted: str, value: str) -> None:
    """`--set stages.0.max_lr=1e-4` addresses list items by index; other keys as `set_dotted`."""
    keys = dotted.split(".")
    for i, k in enumerate(keys[:-1]):
        if k.isdigit() and isinstance(raw, list):
            idx = int(k)
            if idx >= len(raw):
                raise ConfigError(f"--set {dotted}: index {idx} out of range (list has {len(raw)} items)")
            return _set_with_index(raw[idx], ".".join(keys[i + 1:]), value)
        if isinstance(raw, dict) and isinstance(raw.get(k), list) and keys[i + 1].isdigit():
            return _set_with_index(raw[k], ".".join(keys[i + 1:]), value)  # type: ignore[arg-type]
        raw = raw.setdefault(k, {})
        if not isinstance(raw, (dict, list)):
            raise ConfigError(f"--set {dotted}: '{k}' is not a mapping")
    set_dotted(raw, keys[-1], value)
