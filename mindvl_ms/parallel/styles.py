"""Parallel styles: what one module of a plan gets, and the matching of plans against module paths.

A plan (see `parallel/parallelize.py`) is a dict from a module path pattern to a style (`parallel/paths.py`:
`model.layers.*.mlp.down_proj` matches `model.layers.7.mlp.down_proj`). A style applies only to the cell
types it names (`types`) and leaves any other cell at that path alone (the `mlp` of a dense layer under
an expert-parallel style, for example).

Each style declares the strategies of `parallel/strategies.py` (MindFormers' conventions) on the cell's
primitive instances with `Primitive.shard`, and records what it did in a `ParallelReport`:
- `Linear(role)`: nn.Dense matmul (+ bias add) by linear role; a row-parallel linear reduce-scatters its
  output onto the tokens under sequence parallel (`row_sp`).
- `Norm(template)`, `Rotary(q, cos)`: RMSNorm and RoPE primitives (the fused Ascend RoPE as MindFormers:
  `self_define_shard` with Layouts in and out); both drop their CPU C++ kernels
  (`ops/cpu_kernels.py`) so that the composite primitives, which carry the strategies, are what runs: a
  parallel layout compiles for Ascend, where the fused kernels run instead. An `AddRMSNorm` (a decoder
  layer's residual add + post-attention norm) runs its add as its own primitive (`unfuse_add`): MindSpore's
  semi-auto parallel has a sharding rule for RmsNorm but none for the fused AddRmsNorm.
- `Glu(template)`: SwiGLU / GatedAct on the FFN activations. A SwiGLU whose FFN dim is split runs unfused
  (`fused = False`, same values): the fused Ascend kernel takes concat([gate, up]) on the split dim, which
  semi-auto parallel cannot shard (Concat's axis must be whole).
- `GatedMul(template)`: the act(gate) * up product of a ViT MLP with a non-SiLU gated activation.
- `Residual(template)`: the residual adds of a decoder layer / ViT block.
- `Embedding(template)`, `TiedHead()`: the token table's Gather and the tied LM head's MatMul.
- `VocabParallelCE()`: the train step's chunked loss head (`train/loss_head.py`, which this package cannot
  import: recognised by its `vocab_parallel` switch): `strategies.HEAD_CE` on its primitives, and the switch on,
  so its blocks run in the split form those strategies shard.
- `Attention()`: the attention core (`parallel/attention.py: shard_core_attention`) under the layout of the
  part it belongs to (the ViT keeps its heads whole unless `vision_parallel: tp`).
- `DropKernel()`: the ViT's CPU block path (`models/vision.py: QkvBiasRope`) keeps its composite ops.
- `ExpertParallel(mindformers, seq_length)`: a DeepSeek-V3 MoE layer (`parallel/moe.py: shard_moe`, its
  dispatcher built for the stage's seq_length), with MindFormers' expert selection bound first when
  `mindformers`, and the shared experts' SwiGLU as a dense FFN.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from mindspore import nn
from mindspore.parallel import Layout as MsLayout

from mindvl_ms.models.moe import DeepseekV3DecoderLayer, DeepseekV3MoE
from mindvl_ms.models.text import DecoderLayer, TiedHead as TiedHeadCell
from mindvl_ms.models.vision import QkvBiasRope, VisionBlock, VisionMLP
from mindvl_ms.ops import AddRMSNorm, ApplyRotary, CoreAttention, RMSNorm, SwiGLU
from mindvl_ms.ops.activation import GatedAct
from mindvl_ms.ops.layers import Embedding as EmbeddingCell
from mindvl_ms.parallel import strategies as S
from mindvl_ms.parallel.attention import shard_core_attention
from mindvl_ms.parallel.layout import Layout
from mindvl_ms.parallel.mindformers_moe import MindFormersSelect
from mindvl_ms.parallel.moe import shard_moe


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
    recompute: Dict[str, int] = field(default_factory=dict)


@dataclass
class ShardContext:
    """What a style needs besides its cell: the symbol sizes of the strategy templates, the layout of the
    part being sharded (the ViT has its own, see `parallelize.vision_layout`) and the report to fill."""

    axes: Dict[str, int]
    layout: Layout
    report: ParallelReport


def _shard(prim, in_strategy, out_strategy=None) -> None:
    prim.shard(in_strategy=in_strategy, out_strategy=out_strategy)


def _shard_prims(cell: nn.Cell, table: Dict[str, tuple]) -> None:
    for attr, strategy in table.items():
        _shard(getattr(cell, attr), strategy)


def _shard_glu(cell: nn.Cell, s: Tuple[int, ...]) -> None:
    table = S.glu_strategies(s)
    if isinstance(cell, GatedAct):
        table = {"mul": table["mul"]}
    elif s[-1] > 1:
        cell.fused = False  # concat on a split dim: see the module docstring
    _shard_prims(cell, table)


class Style:
    """One module's parallel treatment; `types` are the cell classes it applies to."""

    types: Tuple[type, ...] = ()

    def apply(self, name: str, cell: nn.Cell, ctx: ShardContext) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class Linear(Style):
    types = (nn.Dense,)

    def __init__(self, role: str):
        if role not in S.LINEAR:
            raise ValueError(f"linear role '{role}': expected one of {sorted(S.LINEAR)}")
        self.role = role

    def apply(self, name, cell, ctx):
        role = "row_sp" if self.role == "row" and ctx.layout.seq_parallel else self.role
        mm, out, bias = S.LINEAR[role]
        _shard(cell.matmul, S.resolve(mm, ctx.axes), S.resolve(out, ctx.axes) if out is not None else None)
        if cell.has_bias:
            _shard(cell.bias_add, S.resolve(bias, ctx.axes))
        ctx.report.linear[name] = role


class Norm(Style):
    types = (RMSNorm,)

    def __init__(self, template):
        self.template = template

    def apply(self, name, cell, ctx):
        s = S.resolve(self.template, ctx.axes)
        cell.drop_kernel()  # the CPU C++ norm: the composite primitives carry the strategy
        if isinstance(cell, AddRMSNorm):
            cell.unfuse_add()  # no sharding rule for AddRmsNorm: see the module docstring
            _shard_prims(cell, S.add_norm_strategies(s))
        else:
            _shard_prims(cell, S.norm_strategies(s))
        ctx.report.cells[name] = f"norm{s}"


class Rotary(Style):
    types = (ApplyRotary,)

    def __init__(self, q, cos):
        self.q, self.cos = q, cos

    def apply(self, name, cell, ctx):
        cell.drop_kernel()  # the CPU C++ RoPE: the composite primitives carry the strategy
        _shard_prims(cell, S.rotary_strategies(S.resolve(self.q, ctx.axes), S.resolve(self.cos, ctx.axes)))
        _shard_fused_rope(cell.rope, self.q, self.cos, ctx.axes)
        ctx.report.cells[name] = "rotary"


def _shard_fused_rope(rope, q, cos, axes) -> None:
    """The fused RotaryPositionEmbedding (x, cos, sin) -> x as MindFormers 1.9 shards it
    (parallel_core/training_graph/base_models/common/embeddings/rope_utils.py, ApplyRotaryPosEmb.shard): the
    primitive marked `self_define_shard`, Layouts over the (dp, tp) device matrix for its three inputs and its
    output, the output laid out as x."""
    lay = MsLayout((axes["dp"], axes["tp"]), S.ROPE_DEVICE_AXES)
    x, c = lay(*S.rope_layout_names(q, axes)), lay(*S.rope_layout_names(cos, axes))
    rope.add_prim_attr("self_define_shard", True)
    rope.shard(in_strategy=(x, c, c), out_strategy=(x,))


class Glu(Style):
    types = (SwiGLU, GatedAct)

    def __init__(self, template):
        self.template = template

    def apply(self, name, cell, ctx):
        _shard_glu(cell, S.resolve(self.template, ctx.axes))
        ctx.report.cells[name] = "glu"


class GatedMul(Style):
    types = (VisionMLP,)

    def __init__(self, template):
        self.template = template

    def apply(self, name, cell, ctx):
        _shard(cell.mul, (S.resolve(self.template, ctx.axes),) * 2)  # act(gate) * up of a non-SiLU gated MLP
        ctx.report.cells[name] = "glu"


class Residual(Style):
    types = (DecoderLayer, DeepseekV3DecoderLayer, VisionBlock)

    def __init__(self, template):
        self.template = template

    def apply(self, name, cell, ctx):
        s = S.resolve(self.template, ctx.axes)
        _shard(cell.add, (s, s))
        ctx.report.cells[name] = "residual"


class Embedding(Style):
    types = (EmbeddingCell,)

    def __init__(self, template):
        self.template = template

    def apply(self, name, cell, ctx):
        _shard(cell.gather, S.resolve(self.template, ctx.axes))
        ctx.report.cells[name] = "embedding"


class TiedHead(Style):
    types = (TiedHeadCell,)

    def apply(self, name, cell, ctx):
        _shard(cell.matmul, S.resolve(S.LINEAR["vocab"][0], ctx.axes))
        ctx.report.cells[name] = "tied_head"


class VocabParallelCE(Style):
    types = (nn.Cell,)

    def apply(self, name, cell, ctx):
        if not hasattr(cell, "vocab_parallel"):
            raise TypeError(f"{name}: {type(cell).__name__} is not a chunked loss head (no vocab_parallel switch)")
        _shard_prims(cell, {attr: S.resolve(t, ctx.axes) for attr, t in S.HEAD_CE.items()})
        cell.vocab_parallel = True
        ctx.report.cells[name] = "loss_head"


class Attention(Style):
    types = (CoreAttention,)

    def apply(self, name, cell, ctx):
        ctx.report.delegated[name] = "attention"
        shard_core_attention(cell, ctx.layout)


class DropKernel(Style):
    types = (QkvBiasRope,)

    def apply(self, name, cell, ctx):
        cell.drop_kernel()  # the CPU block path's C++ kernel: see the module docstring
        ctx.report.cells[name] = "cpu_kernel_dropped"


class ExpertParallel(Style):
    """Router, routed experts (EPExperts) and shared experts of a DeepseekV3MoE; see `parallel/moe.py`."""

    types = (DeepseekV3MoE,)

    def __init__(self, moe_config=None, mindformers: bool = False, seq_length: int = None):
        self.moe_config, self.mindformers, self.seq_length = moe_config, mindformers, seq_length

    def apply(self, name, cell, ctx):
        ctx.report.delegated[name] = "moe"
        if self.mindformers and cell.gate.mindformers_select is None:
            cell.gate.mindformers_select = MindFormersSelect(self.moe_config, ctx.layout)
        shard_moe(cell, ctx.layout, seq_length=self.seq_length)  # the dispatcher for the stage's rows
        glu = cell.shared_experts.swiglu if cell.has_shared else None
        if glu is not None and glu.silu.attrs.get("in_strategy") is None:  # shard_moe leaves it to the FFN rule
            _shard_glu(glu, S.resolve(S.FFN, ctx.axes))
            ctx.report.cells[f"{name}.shared_experts.swiglu"] = "glu"
