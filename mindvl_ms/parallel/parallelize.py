"""`parallelize(model, run_config_or_layout)`: semi-auto shard strategies on the pure model's primitives.

The model files hold primitive instances and no parallel logic; this module walks the cells, recognises
them by type and name, and calls `Primitive.shard` with the strategies of `parallel/strategies.py`
(MindFormers' conventions). It also places cells on pipeline stages (`parallel/pipeline.py`) and groups
gradient communication by `gradient_aggregation_group` (consecutive decoder layers share a
`Parameter.comm_fusion` id, MindFormers' `set_comm_fusion(layer_id // group + 1)`).

Delegated: the attention core (`parallel/attention.py: shard_core_attention`) and the routed MoE
(`parallel/moe.py: shard_moe`).

Kernel choice: a SwiGLU whose FFN dim is split by tensor parallelism runs unfused (`fused = False`, same
values): the fused Ascend kernel takes concat([gate, up]) on the split dim, which semi-auto parallel cannot
shard (Concat's axis must be whole).

The ViT's CPU block path (`models/vision.py: QkvBiasRope`), every RMSNorm (`ops/norm.py`) and every RoPE
(`ops/rotary.py`) drop their C++ kernels (`ops/cpu_kernels.py`) and keep the composite ops, whose primitives
carry the strategies: a parallel layout compiles for Ascend, which runs its fused kernels.

Strategies only take effect under `semi_auto_parallel` / `auto_parallel` on Ascend; on CPU they are
declared and read back by the audit tests (`parallel/audit.py`), since such graphs cannot compile on CPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from mindspore import nn

from mindvl_ms.ops import ApplyRotary, CoreAttention, RMSNorm, SwiGLU
from mindvl_ms.ops.activation import GatedAct
from mindvl_ms.parallel import strategies as S
from mindvl_ms.parallel.attention import shard_core_attention
from mindvl_ms.parallel.moe import shard_moe
from mindvl_ms.parallel.layout import Layout
from mindvl_ms.parallel.pipeline import assign_pipeline_stages


@dataclass
class ParallelReport:
    """What `parallelize` did (names of the cells it sharded by kind)."""

    layout: Layout
    vision_parallel: str
    vocab_split: int
    linear: Dict[str, str] = field(default_factory=dict)   # cell name -> role
    unmatched_linear: List[str] = field(default_factory=list)
    cells: Dict[str, str] = field(default_factory=dict)    # cell name -> kind (norm, rotary, glu, ...)
    delegated: Dict[str, str] = field(default_factory=dict)  # cell name -> "attention" | "moe"
    stages: Dict[str, int] = field(default_factory=dict)
    comm_fusion: Dict[str, int] = field(default_factory=dict)


def _shard(prim, in_strategy, out_strategy=None) -> None:
    prim.shard(in_strategy=in_strategy, out_strategy=out_strategy)


def _shard_prims(cell: nn.Cell, table: Dict[str, tuple]) -> None:
    for attr, strategy in table.items():
        _shard(getattr(cell, attr), strategy)


def _shard_linear(cell: nn.Dense, role: str, axes) -> None:
    mm, out, bias = S.LINEAR[role]
    _shard(cell.matmul, S.resolve(mm, axes), S.resolve(out, axes) if out is not None else None)
    if cell.has_bias:
        _shard(cell.bias_add, S.resolve(bias, axes))


def _moe_types():
    from mindvl_ms.models.moe import DeepseekV3MoE
    return (DeepseekV3MoE,)


def _decoder_types():
    from mindvl_ms.models.moe import DeepseekV3DecoderLayer
    from mindvl_ms.models.text import DecoderLayer
    from mindvl_ms.models.vision import VisionBlock
    return (DecoderLayer, DeepseekV3DecoderLayer), VisionBlock


def _from_config(config):
    """(layout, vision_parallel, offset, gradient_aggregation_group) from a RunConfig or a Layout (group 0: unset)."""
    if isinstance(config, Layout):
        return config, "dp", (), 0
    s = config.parallel_config
    return (Layout.from_run_config(config), getattr(s, "vision_parallel", "dp"), list(s.offset),
            int(s.gradient_aggregation_group))


def _vocab_size(model) -> int:
    for name, cell in model.cells_and_names():
        if name.endswith("embed_tokens") and hasattr(cell, "weight"):
            return int(cell.weight.shape[0])
    raise ValueError(f"{type(model).__name__}: no `embed_tokens` table found")


def parallelize(model: nn.Cell, config, *, vision_parallel: Optional[str] = None,
                offset: Optional[List[int]] = None,
                gradient_aggregation_group: Optional[int] = None) -> ParallelReport:
    """Shard every known primitive of `model` for `config` (a RunConfig or a Layout); returns a report.

    Keyword arguments override what a RunConfig says (and give the values when `config` is a Layout).
    """
    layout, vp, off, group = _from_config(config)
    vp = vision_parallel or vp
    off = list(offset) if offset is not None else off
    group = gradient_aggregation_group if gradient_aggregation_group is not None else group
    vocab = _vocab_size(model)
    axes = S.axes_for(layout, vocab, vp)
    report = ParallelReport(layout=layout, vision_parallel=vp, vocab_split=axes["vt"])
    vision_layout = layout if vp == "tp" else dataclasses.replace(layout, tp=1, ep=1, seq_parallel=False)
    moe_types = _moe_types()
    decoder_types, vision_block = _decoder_types()
    from mindvl_ms.models.vision import QkvBiasRope, VisionMLP as vision_mlp
    skip: List[str] = []  # MoE subtrees, sharded by shard_moe

    for name, cell in model.cells_and_names():
        if any(name.startswith(p + ".") for p in skip):
            continue
        vision = name.startswith("visual.") or name == "visual"
        if moe_types and isinstance(cell, moe_types):
            skip.append(name)
            report.delegated[name] = "moe"
            shard_moe(cell, layout)
            _shard_shared_expert_glu(cell, axes, report, name)
            continue
        if isinstance(cell, nn.Dense):
            role = S.linear_role(name, S.VISION_LINEAR_RULES if vision else S.LLM_LINEAR_RULES)
            if role is None:
                report.unmatched_linear.append(name)
                continue
            if role == "row" and layout.seq_parallel:
                role = "row_sp"
            _shard_linear(cell, role, axes)
            report.linear[name] = role
        elif isinstance(cell, RMSNorm):
            s = S.resolve(S.norm_role(name, vision), axes)
            cell.drop_kernel()  # the CPU C++ norm: the composite primitives carry the strategy
            _shard_prims(cell, S.norm_strategies(s))
            report.cells[name] = f"norm{s}"
        elif isinstance(cell, ApplyRotary):
            cell.drop_kernel()  # the CPU C++ RoPE: the composite primitives carry the strategy
            if vision:
                q, cos = S.VISION_ROPE_Q, S.VISION_ROPE_COS
            elif name.endswith("rotary_k"):
                q, cos = S.ROPE_SHARED_K, S.ROPE_COS
            else:
                q, cos = S.ROPE_Q, S.ROPE_COS
            _shard_prims(cell, S.rotary_strategies(S.resolve(q, axes), S.resolve(cos, axes)))
            report.cells[name] = "rotary"
        elif isinstance(cell, (SwiGLU, GatedAct)):
            s = S.resolve(S.VISION_FFN if vision else S.FFN, axes)
            table = S.glu_strategies(s)
            if isinstance(cell, GatedAct):
                table = {"mul": table["mul"]}
            elif s[-1] > 1:
                cell.fused = False  # concat on a split dim: see the module docstring
            _shard_prims(cell, table)
            report.cells[name] = "glu"
        elif isinstance(cell, vision_mlp) and hasattr(cell, "mul"):
            _shard(cell.mul, (S.resolve(S.VISION_FFN, axes),) * 2)  # act(gate) * up of a non-SiLU gated MLP
            report.cells[name] = "glu"
        elif isinstance(cell, (decoder_types + (vision_block,))):
            s = S.resolve(S.VISION_ROWS if isinstance(cell, vision_block) else S.HIDDEN, axes)
            _shard(cell.add, (s, s))
            report.cells[name] = "residual"
        elif isinstance(cell, QkvBiasRope):
            cell.drop_kernel()  # the CPU block path's C++ kernel: see the module docstring
            report.cells[name] = "cpu_kernel_dropped"
        elif isinstance(cell, CoreAttention):
            report.delegated[name] = "attention"
            shard_core_attention(cell, vision_layout if vision else layout)
        elif hasattr(cell, "gather") and name.endswith("embed_tokens"):
            _shard(cell.gather, S.resolve(S.EMBED_GATHER, axes))
            report.cells[name] = "embedding"
        elif name.endswith("tied_head") and hasattr(cell, "matmul"):
            _shard(cell.matmul, S.resolve(S.LINEAR["vocab"][0], axes))
            report.cells[name] = "tied_head"

    if layout.pp > 1:
        report.stages = assign_pipeline_stages(model, layout.pp, off)
    if group > 0:
        report.comm_fusion = set_gradient_fusion(model, group)
    return report


def _shard_shared_expert_glu(moe_cell, axes, report: ParallelReport, prefix: str) -> None:
    """The shared experts' SwiGLU (a dense FFN on [B, L, I]) when shard_moe left it without a strategy."""
    shared = getattr(moe_cell, "shared_experts", None)
    glu = getattr(shared, "swiglu", None) if shared is not None else None
    if glu is None or glu.silu.attrs.get("in_strategy") is not None:
        return
    s = S.resolve(S.FFN, axes)
    if s[-1] > 1:
        glu.fused = False
    _shard_prims(glu, S.glu_strategies(s))
    report.cells[f"{prefix}.shared_experts.swiglu"] = "glu"


def set_gradient_fusion(model: nn.Cell, group: int) -> Dict[str, int]:
    """Decoder layer i's parameters get comm_fusion i // group + 1 (their gradients are reduced together)."""
    from mindvl_ms.parallel.pipeline import _language_model

    lm = _language_model(model)
    fusion = {}
    for i, layer in enumerate(lm.layers):
        fusion[f"layers.{i}"] = i // group + 1
        layer.set_comm_fusion(i // group + 1)
    return fusion
