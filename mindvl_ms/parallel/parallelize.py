"""`parallelize(model, layout)`: semi-auto shard strategies on a pure model, step by step, from plans.

The model files hold primitive instances and no parallel logic. As torchtitan's `parallelize_llama`, this
module applies each parallelism as its own step, each driven by a plan: a dict from a module path pattern
(`model.layers.*.mlp.down_proj`, `parallel/paths.py`) to a style (`parallel/styles.py`), whose strategies
are the tables of `parallel/strategies.py` (MindFormers' conventions):
- `apply_ep`: every DeepSeek-V3 MoE layer (`EP_MODULES`): router, routed experts split by expert_parallel
  (MindFormers' all-to-all dispatcher; on Ascend its expert selection too), shared experts;
- `apply_vision`: the ViT and projector (`VISION_PLAN`) under the vision layout: data parallel rows, its
  weights split only with `vision_parallel: tp` (`vision_layout`); with `vision_parallel: dp` the rows are
  every rank's own share of its TP group's images, merged through `vit_balance.GroupMerge`;
- `apply_tp`: the language model and head (`LLM_TP_PLAN`: the embedding, each decoder layer's
  `DECODER_LAYER_PLAN`, the multi-token-prediction depths, the final norm, the LM head);
- `apply_pipeline`: stages of the embedding, layers and head (`parallel/pipeline.py: STAGE_PLAN`);
- `apply_gradient_fusion`: consecutive decoder layers share a `Parameter.comm_fusion` id, MindFormers'
  `set_comm_fusion(layer_id // gradient_aggregation_group + 1)`, so their gradients are reduced together;
- `apply_recompute` (`parallel/recompute.py: RECOMPUTE_PLAN`), when a recompute config is given.

The train step's chunked loss head (`train/loss_head.py`) is built after the model, by the train layer: it
calls `shard_loss_head(head, model)`, which gives the head the data and vocab split that `apply_tp` declared
on the model's LM head (`strategies.HEAD_CE`), so the head weight is split on V wherever the head runs.

Strategies only take effect under `semi_auto_parallel` / `auto_parallel` on Ascend; on CPU they are
declared and read back by the audit tests (`parallel/audit.py`), since such graphs cannot compile on CPU.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from mindspore import nn

from mindvl_ms.models.moe import DeepseekV3Model
from mindvl_ms.ops import is_ascend
from mindvl_ms.parallel import strategies as S
from mindvl_ms.parallel.audit import strategy_of
from mindvl_ms.parallel.layout import Layout
from mindvl_ms.parallel.paths import match_plan, under
from mindvl_ms.parallel.pipeline import assign_pipeline_stages, language_model
from mindvl_ms.parallel.recompute import apply_recompute
from mindvl_ms.parallel.styles import (Attention, DropKernel, Embedding, ExpertParallel, GatedMul, Glu, Linear, Norm,
                                       ParallelReport, Residual, Rotary, ShardContext, TiedHead, VocabParallelCE)
from mindvl_ms.parallel.validate import refuse_unsharded
from mindvl_ms.parallel.vit_balance import GroupMerge

COLUMN, ROW, REPLICATED = Linear("column"), Linear("row"), Linear("replicated")

DECODER_LAYER_PLAN = {  # paths inside one decoder layer: Qwen2/Qwen3 (GQA) and DeepSeek-V3 (MLA)
    "": Residual(S.HIDDEN),
    "input_layernorm": Norm(S.HIDDEN),
    "post_attention_layernorm": Norm(S.HIDDEN),
    "self_attn.q_proj": COLUMN,
    "self_attn.k_proj": COLUMN,
    "self_attn.v_proj": COLUMN,
    "self_attn.q_b_proj": COLUMN,                   # MLA up-projections (per head)
    "self_attn.kv_b_proj": COLUMN,
    "self_attn.q_a_proj": REPLICATED,               # MLA down-projections (latent)
    "self_attn.kv_a_proj_with_mqa": REPLICATED,
    "self_attn.o_proj": ROW,
    "self_attn.q_norm": Norm(S.HEAD_NORM),
    "self_attn.k_norm": Norm(S.HEAD_NORM),
    "self_attn.q_a_layernorm": Norm(S.LATENT_NORM),
    "self_attn.kv_a_layernorm": Norm(S.LATENT_NORM),
    "self_attn.rotary": Rotary(S.ROPE_Q, S.ROPE_COS),
    "self_attn.rotary_k": Rotary(S.ROPE_SHARED_K, S.ROPE_COS),  # MLA's one rope key: no head split
    "self_attn.core": Attention(),
    "mlp.gate_proj": COLUMN,                        # dense FFN (an MoE `mlp` is apply_ep's)
    "mlp.up_proj": COLUMN,
    "mlp.down_proj": ROW,
    "mlp.glu": Glu(S.FFN),                          # Qwen MLP
    "mlp.swiglu": Glu(S.FFN),                       # DeepSeek-V3 dense MLP
}
MTP_PLAN = {  # one multi-token-prediction depth: a decoder layer with its input projection and norms
    **DECODER_LAYER_PLAN,
    "eh_proj": REPLICATED,
    "enorm": Norm(S.HIDDEN),
    "hnorm": Norm(S.HIDDEN),
    "shared_head.norm": Norm(S.HIDDEN),
}
LLM_TP_PLAN = {
    "model.embed_tokens": Embedding(S.EMBED_GATHER),
    **under("model.layers.*", DECODER_LAYER_PLAN),
    **under("model.mtp.*", MTP_PLAN),
    "model.norm": Norm(S.HIDDEN),
    "lm_head": Linear("vocab"),
    "tied_head": TiedHead(),
}

V_COLUMN, V_ROW = Linear("v_column"), Linear("v_row")
VISION_BLOCK_PLAN = {  # paths inside one ViT block
    "": Residual(S.VISION_ROWS),
    "norm1": Norm(S.VISION_ROWS),
    "norm2": Norm(S.VISION_ROWS),
    "attn.qkv": V_COLUMN,
    "attn.proj": V_ROW,
    "attn.rotary": Rotary(S.VISION_ROPE_Q, S.VISION_ROPE_COS),
    "attn.core": Attention(),
    "attn.qkv_rope": DropKernel(),
    "mlp": GatedMul(S.VISION_FFN),
    "mlp.gate_proj": V_COLUMN,
    "mlp.up_proj": V_COLUMN,
    "mlp.fc1": V_COLUMN,
    "mlp.down_proj": V_ROW,
    "mlp.fc2": V_ROW,
    "mlp.glu": Glu(S.VISION_FFN),
}
VISION_PLAN = {
    "visual.patch_embed.proj": REPLICATED,
    **under("visual.blocks.*", VISION_BLOCK_PLAN),
    "visual.merger.ln_q": Norm(S.VISION_ROWS),
    "visual.merger.ln_hier.*": Norm(S.VISION_ROWS),  # the hierarchical connector's earlier levels
    "visual.merger.mlp.0": V_COLUMN,
    "visual.merger.mlp.2": V_ROW,
}
EP_MODULES = ("model.layers.*.mlp", "model.mtp.*.mlp")  # the MoE layers among them get ExpertParallel


def apply_plan(model: nn.Cell, plan: Dict[str, object], ctx: ShardContext, prefix: str = "",
               skip: Sequence[str] = ()) -> List[str]:
    """Apply each cell's style from `plan`; returns the names of the nn.Dense cells it has no style for."""
    unmatched = []
    for name, cell, style in match_plan(model, plan, prefix, tuple(skip)):
        if style is not None and isinstance(cell, style.types):
            style.apply(name, cell, ctx)
        elif isinstance(cell, nn.Dense):
            unmatched.append(name)
    return unmatched


def apply_ep(model: nn.Cell, layout: Layout, axes: Dict[str, int], report: ParallelReport,
             mindformers: Optional[bool] = None, seq_length: Optional[int] = None) -> List[str]:
    """Expert parallel on every MoE layer; returns their names. `mindformers` (default: on Ascend) binds
    MindFormers' expert selection first (`parallel.mindformers_moe.MindFormersSelect`); the dispatchers are
    built for `seq_length` tokens per row (the stage's; `parallel.moe.DEFAULT_SEQ_LENGTH` when None)."""
    lm = language_model(model)
    mindformers = is_ascend() if mindformers is None else mindformers
    moe_config = lm.config.moe if isinstance(lm, DeepseekV3Model) else None
    plan = dict.fromkeys(EP_MODULES, ExpertParallel(moe_config, mindformers, seq_length))
    apply_plan(model, plan, ShardContext(axes, layout, report), skip=("visual",))
    return [name for name, kind in report.delegated.items() if kind == "moe"]


def vision_layout(layout: Layout, vision_parallel: str) -> Layout:
    """The layout the ViT is sharded under: the run's with `vision_parallel: tp`; else data parallel only
    (heads whole) over every rank of a stage, dp * tp: the TP group's ranks each encode their own share of
    the group's images (`parallel.vit_balance`)."""
    if vision_parallel == "tp":
        return layout
    return dataclasses.replace(layout, dp=layout.dp * layout.tp, tp=1, ep=1, seq_parallel=False)


def vision_axes(axes: Dict[str, int], vision_parallel: str) -> Dict[str, int]:
    """The strategy symbols of the ViT's plan: the run's with `vision_parallel: tp`, else rows over dp * tp."""
    if vision_parallel == "tp":
        return axes
    return dict(axes, dp=axes["dptp"], tp=1, sp=1, vtp=1)


def apply_vision(model: nn.Cell, layout: Layout, axes: Dict[str, int], report: ParallelReport,
                 vision_parallel: str) -> None:
    """`VISION_PLAN` on `model.visual` (if any) under `vision_layout`; with `vision_parallel: dp` and a TP
    group, the model's visual merge becomes the group's (`vit_balance.GroupMerge`)."""
    if getattr(model, "visual", None) is None:
        return
    ctx = ShardContext(vision_axes(axes, vision_parallel), vision_layout(layout, vision_parallel), report)
    report.unmatched_linear += apply_plan(model.visual, VISION_PLAN, ctx, prefix="visual")
    if vision_parallel == "dp" and layout.tp > 1:
        model.merge = GroupMerge(layout.dp, layout.tp)
        report.cells["merge"] = "balanced vision merge"


def apply_tp(model: nn.Cell, layout: Layout, axes: Dict[str, int], report: ParallelReport,
             skip: Sequence[str] = ()) -> None:
    """`LLM_TP_PLAN` on the language model and head; `skip` are subtrees sharded by another step."""
    ctx = ShardContext(axes, layout, report)
    report.unmatched_linear += apply_plan(model, LLM_TP_PLAN, ctx, skip=("visual",) + tuple(skip))


def apply_pipeline(model: nn.Cell, layout: Layout, offset: Sequence[int], report: ParallelReport) -> None:
    """Pipeline stages of `STAGE_PLAN` when the layout has more than one (`parallel/pipeline.py`)."""
    if layout.pp > 1:
        report.stages = assign_pipeline_stages(model, layout.pp, offset)


def apply_gradient_fusion(model: nn.Cell, group: int, report: ParallelReport) -> None:
    """Decoder layer i's parameters get comm_fusion i // group + 1 (their gradients are reduced together)."""
    for i, layer in enumerate(language_model(model).layers):
        report.comm_fusion[f"layers.{i}"] = i // group + 1
        layer.set_comm_fusion(i // group + 1)


def _knobs(config, vision_parallel, offset, group):
    """(layout, vision_parallel, offset, gradient_aggregation_group) from a Layout or a RunConfig, the
    keyword values first (group 0: unset)."""
    if isinstance(config, Layout):
        layout, vp, off, grp = config, "dp", [], 0
    else:
        s = config.parallel_config
        layout, vp, off, grp = (Layout.from_run_config(config), s.vision_parallel, list(s.offset),
                                int(s.gradient_aggregation_group))
    off = list(offset) if offset is not None else off
    return layout, vision_parallel or vp, off, grp if group is None else group


def parallelize(model: nn.Cell, layout, *, vision_parallel: Optional[str] = None,
                offset: Optional[List[int]] = None, gradient_aggregation_group: Optional[int] = None,
                recompute=None, mindformers: Optional[bool] = None, seq_length: Optional[int] = None) -> ParallelReport:
    """Shard `model` for `layout` (a Layout, or a RunConfig whose `parallel_config` gives the layout and the
    knobs below); returns what was done.

    Keyword arguments override what a RunConfig says (and give the values for a Layout). `recompute` (a
    RecomputeConfig) also applies activation recomputation; `mindformers` is `apply_ep`'s; `seq_length` (a
    RunConfig: its first stage's) sizes the MoE dispatchers (`parallel.moe.set_moe_seq_length` for a later
    stage's)."""
    if seq_length is None and not isinstance(layout, Layout) and layout.stages:
        seq_length = layout.stages[0].seq_length
    layout, vp, off, group = _knobs(layout, vision_parallel, offset, gradient_aggregation_group)
    axes = S.axes_for(layout, int(language_model(model).embed_tokens.weight.shape[0]), vp)
    report = ParallelReport(layout=layout, vision_parallel=vp, vocab_split=axes["vt"])
    moe = apply_ep(model, layout, axes, report, mindformers, seq_length)
    apply_vision(model, layout, axes, report, vp)
    apply_tp(model, layout, axes, report, skip=moe)
    apply_pipeline(model, layout, off, report)
    if group > 0:
        apply_gradient_fusion(model, group, report)
    if recompute is not None:
        report.recompute = apply_recompute(model, recompute)
    return report


def head_split(model: nn.Cell) -> Optional[Tuple[int, int]]:
    """(dp, vocab split) of the strategy declared on the model's LM head MatMul (`lm_head`, or `tied_head`
    when tied; under an AMP wrapper, its backbone's), None when it carries none (not parallelized)."""
    net = getattr(model, "_backbone", model)
    head = getattr(net, "lm_head", None)
    head = head if head is not None else getattr(net, "tied_head", None)
    s = strategy_of(head.matmul) if head is not None else None
    return None if s is None else (int(s[0][0]), int(s[1][0]))


def shard_loss_head(head: nn.Cell, model: nn.Cell) -> bool:
    """Declare `strategies.HEAD_CE` on the chunked loss head `head` with the model's `head_split` (the head
    weight split on V as the LM head's); False, and `head` left as it is, when the model is not parallelized."""
    split = head_split(model)
    if split is None:
        return False
    dp, vt = split
    report = ParallelReport(layout=None, vision_parallel="dp", vocab_split=vt)
    VocabParallelCE().apply("loss_head", head, ShardContext({"dp": dp, "vt": vt}, None, report))
    refuse_unsharded(head=head)
    return True
