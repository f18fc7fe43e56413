"""Semi-auto parallel strategies for the DeepSeek-V3 MoE layer (`mindvl_ms.models.moe.DeepseekV3MoE`).

    shard_moe(moe_cell, layout, seq_length=L)     # layout: mindvl_ms.parallel.layout.Layout; returns moe_cell
    use_mindformers(moe_cell, moe, seq_length=L)  # MindFormers' selection + dispatcher on one device
    set_moe_seq_length(model, L)                  # a later stage's seq_length for every dispatcher

The dispatcher's `seq_length` is the stage's (the tokens per row it dispatches, from which MindFormers
derives its AlltoAllV sizes): `parallelize` passes the run's first stage's, the trainer sets each stage's
with `set_moe_seq_length` before it builds the stage's step; `DEFAULT_SEQ_LENGTH` is for callers with no
stage (inference, tests).

Conventions are MindFormers' (parallel_core/training_graph/transformer/moe and device_matrix.py), which are
known to compile on Ascend:
- MoE device matrix `(dp*tp/ep, ep)` with aliases ("dp_ex_ep", "ep") over the dp*tp devices of one pipeline
  stage. Tokens are split over all of them (MindFormers' "dp_cp" alias = ("dp_ex_ep", "ep")); the routed
  expert weights [E, ...] are split on the expert axis by "ep", so each rank holds E/ep experts, and the ep
  ranks of an EP group are `ep` consecutive ranks (`Layout.ep_group`, MindFormers' `get_ep_group_name`).
- Router gate (`gate.gate_matmul`, [T, D] x [E, D]^T): tokens split over the stage's dp*tp devices, the
  weight replicated (MindFormers' Router.shard: layout(dp_cp, None, None), layout(None, None)).
- Routed experts: one `Morph` primitive with `self_define_shard`, like MindFormers' FFNGroupedGEMM
  `morphed_forward`: inputs (tokens [S, T/S, D], probs [S, T/S, k], expert ids [S, T/S, k]) split on the
  S = dp*tp stage devices, weights gate_proj/up_proj [E, D, I] and down_proj [E, I, D] split on "ep". Inside,
  per device, MindFormers' `MoEAlltoAllTokenDispatcher` permutes the local tokens by expert, exchanges
  counts by AlltoAll and token rows by AlltoAllV inside the EP group, the GroupedMatmul experts run over the
  E/ep local experts, and AlltoAllV sends the rows back for the weighted combine (see `EPExperts`).
- Shared experts: a dense SwiGLU MLP, column/row parallel: gate_proj/up_proj `((dp, 1), (tp, 1))` (weight
  [I, D] split on the output dim), down_proj `((dp, tp), (1, tp))`; with `seq_parallel` the down_proj output
  is reduce-scattered on the tokens (`out_strategy ((dp*tp, 1),)`), as MindFormers' RowParallelLinear does.

Semi-auto graphs cannot compile on CPU, so the declared strategies are what the tests read back
(`prim.in_strategy`, `prim.attrs['in_layout']`, see `split_counts`), together with the per-parameter shard
shapes they imply (`parameter_shards`).
"""
from typing import Dict, List, Tuple

from mindspore import nn
from mindspore.ops.operations import Morph
from mindspore.parallel import Layout as DeviceLayout

from mindvl_ms.models.moe import DeepseekV3Model, DeepseekV3MoE
from mindvl_ms.ops import SwiGLU
from mindvl_ms.ops.moe import GroupedMatmul
from mindvl_ms.parallel.layout import Layout
from mindvl_ms.parallel.mindformers_moe import MindFormersSelect, mindformers_dispatcher


DEFAULT_SEQ_LENGTH = 4096  # MindFormers' TransformerConfig default: the dispatcher of a caller with no stage


def moe_device_layout(layout: Layout) -> DeviceLayout:
    """MindSpore Layout over one stage's devices: device matrix (dp*tp/ep, ep), aliases (dp_ex_ep, ep)."""
    stage = layout.dp * layout.tp
    return DeviceLayout((stage // layout.ep, layout.ep), ("dp_ex_ep", "ep"))


def _infer_first(*args):
    return args[0]


class EPExperts(nn.Cell):
    """Routed experts under expert parallel: x [T, D], idx int32 [T, k], weights [T, k], stacked expert
    weights -> [T, D]. Ascend only at run time (AlltoAllV, GroupedMatmul); it is built on any device so that
    its strategies can be declared and read back.

    `dispatcher` is MindFormers' MoEAlltoAllTokenDispatcher (or any object with its token_permutation /
    token_unpermutation interface); `None` builds it from the cell's sizes
    (`parallel.mindformers_moe.mindformers_dispatcher`).
    """

    def __init__(self, experts, layout: Layout, top_k: int, dispatcher=None, seq_length: int = None):
        super().__init__()
        seq_length = DEFAULT_SEQ_LENGTH if seq_length is None else int(seq_length)
        e, d, inter = experts.gate_proj.shape
        if e % layout.ep:
            raise ValueError(f"expert_parallel {layout.ep} must divide the {e} routed experts")
        self.stage = layout.dp * layout.tp
        self.hidden = d
        self.dispatcher = dispatcher if dispatcher is not None else mindformers_dispatcher(
            e, top_k, d, layout, seq_length)
        self.seq_length = seq_length
        self.gmm = GroupedMatmul()
        self.swiglu = SwiGLU()
        self.morph = Morph(self.dispatch_and_compute, _infer_first, _infer_first).add_prim_attr(
            "self_define_shard", True)
        dev = moe_device_layout(layout)
        tokens = dev(("dp_ex_ep", "ep"), "None", "None")
        weight = dev("ep", "None", "None")
        self.morph.shard(in_strategy=(tokens, tokens, tokens, weight, weight, weight), out_strategy=(tokens,))

    def dispatch_and_compute(self, tokens, probs, routing_map, w_gate, w_up, w_down):
        """Per device (inside the Morph): tokens [1, n, D], probs/routing_map [1, n, k], local expert
        weights [E/ep, ...] -> [1, n, D]. MindFormers' FFNGroupedGEMM.forward_func with separate gate/up."""
        dispatched, group_list, ctx = self.dispatcher.token_permutation(tokens, probs, routing_map)
        rows = dispatched.reshape((-1, self.hidden))  # [M_local, D] grouped by local expert
        h = self.swiglu(self.gmm(rows, w_gate, group_list), self.gmm(rows, w_up, group_list))  # [M_local, I]
        y = self.gmm(h, w_down, group_list)  # [M_local, D]
        return self.dispatcher.token_unpermutation(y, ctx)

    def construct(self, x, idx, weights, w_gate, w_up, w_down):
        t, d = x.shape
        k = idx.shape[-1]
        s = self.stage
        out = self.morph(x.reshape(s, t // s, d), weights.astype(x.dtype).reshape(s, t // s, k),
                         idx.reshape(s, t // s, k), w_gate, w_up, w_down)
        return out.reshape(t, d)


def shard_mlp(mlp, layout: Layout) -> None:
    """Column-parallel gate/up, row-parallel down (weights are nn.Dense [out, in], transpose_b)."""
    dp, tp = layout.dp, layout.tp
    mlp.gate_proj.matmul.shard(((dp, 1), (tp, 1)))
    mlp.up_proj.matmul.shard(((dp, 1), (tp, 1)))
    if layout.seq_parallel:
        mlp.down_proj.matmul.shard(in_strategy=((dp, tp), (1, tp)), out_strategy=((dp * tp, 1),))
    else:
        mlp.down_proj.matmul.shard(((dp, tp), (1, tp)))


def shard_moe(moe_cell, layout: Layout, dispatcher=None, seq_length: int = None):
    """Declare the semi-auto strategies of one DeepseekV3MoE cell for `layout`; returns the cell.

    With ep == 1 the routed experts are still declared through EPExperts (the all-to-all then stays inside
    one device's group of one), so every layout takes the same code path.
    """
    stage = layout.dp * layout.tp
    moe_cell.gate.gate_matmul.shard(((stage, 1), (1, 1)))
    select = moe_cell.gate.mindformers_select
    if select is not None and select.layout != layout:  # MindFormers' selection: its tokens over the stage
        moe_cell.gate.mindformers_select = MindFormersSelect(select.moe_config, layout)
    moe_cell.experts.parallel_experts = EPExperts(moe_cell.experts, layout, moe_cell.top_k, dispatcher, seq_length)
    if moe_cell.has_shared:
        shard_mlp(moe_cell.shared_experts, layout)
    return moe_cell


def use_mindformers(moe_cell, moe_config, layout: Layout = None, seq_length: int = None):
    """Route and dispatch a DeepseekV3MoE with MindFormers' MoE code (what `apply_ep` does on Ascend):
    TopKRouter's expert selection and MoEAlltoAllTokenDispatcher + GroupedMatmul experts (EPExperts,
    all-to-all inside the EP group of `layout`, default a single device). Parameters stay the cell's;
    returns the cell."""
    moe_cell.gate.mindformers_select = MindFormersSelect(moe_config, layout)
    moe_cell.experts.parallel_experts = EPExperts(moe_cell.experts, layout or Layout(), moe_cell.top_k,
                                                  seq_length=seq_length)
    return moe_cell


def set_moe_seq_length(model: nn.Cell, seq_length: int) -> List[str]:
    """Set every expert-parallel dispatcher of `model` to `seq_length` tokens per row (a stage's); returns the
    names of the cells changed. MindFormers' dispatcher reads `seq_length` when its graph is traced, so the
    next compiled step uses it."""
    names = []
    for name, cell in model.cells_and_names():
        if isinstance(cell, EPExperts) and cell.seq_length != int(seq_length):
            cell.seq_length = cell.dispatcher.seq_length = int(seq_length)
            names.append(name)
    return names


def bind_mindformers_moe(model: nn.Cell, layout: Layout = None, seq_length: int = None) -> List[str]:
    """`use_mindformers` on every DeepSeek-V3 MoE layer of `model` (any depth); returns their names.

    MindFormers' router and dispatcher are this project's default MoE path on Ascend, also without a
    parallel layout (single device, data parallel, inference): the trainer and `infer.generate.load_model`
    call this there, and `apply_ep` binds them itself under semi-auto parallel."""
    cells = list(model.cells_and_names())
    lms = [cell for _, cell in cells if isinstance(cell, DeepseekV3Model)]
    if not lms:
        return []
    names = []
    for name, cell in cells:
        if isinstance(cell, DeepseekV3MoE):
            use_mindformers(cell, lms[0].config.moe, layout, seq_length)
            names.append(name)
    return names


def split_counts(prim) -> List[Tuple[int, ...]]:
    """Per input, how many pieces each dimension is cut into, from `in_strategy` or `attrs['in_layout']`."""
    if "in_layout" in prim.attrs:
        out = []
        for lay in prim.attrs["in_layout"]:
            dev = lay["device_matrix"]
            n = len(dev)
            dims = []
            for m in lay["tensor_map"]:
                axes = m if isinstance(m, tuple) else (m,)
                c = 1
                for a in axes:
                    if a != -1:
                        c *= dev[n - 1 - a]
                dims.append(c)
            out.append(tuple(dims))
        return out
    strategy = prim.attrs.get("in_strategy")
    if strategy is None:
        raise ValueError(f"primitive {prim.name} carries no strategy")
    return [tuple(s) for s in strategy]


def _param_inputs(moe_cell) -> Dict[str, tuple]:
    """parameter name (relative to the MoE cell) -> (primitive, input index) that consumes it."""
    out = {"gate.weight": (moe_cell.gate.gate_matmul, 1)}
    if moe_cell.experts.parallel_experts is not None:
        morph = moe_cell.experts.parallel_experts.morph
        for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
            out[f"experts.{name}"] = (morph, 3 + i)
    if moe_cell.has_shared:
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"shared_experts.{name}.weight"] = (getattr(moe_cell.shared_experts, name).matmul, 1)
    return out


def parameter_shards(moe_cell) -> Dict[str, dict]:
    """For each sharded parameter: full shape, per-device shard shape and the split per dimension."""
    params = {name: p for name, p in moe_cell.parameters_and_names()}
    out = {}
    for name, (prim, i) in _param_inputs(moe_cell).items():
        full = tuple(params[name].shape)
        split = split_counts(prim)[i]
        if len(split) != len(full):
            raise ValueError(f"{name}: strategy {split} does not match shape {full}")
        for n, c in zip(full, split):
            if n % c:
                raise ValueError(f"{name}: dimension {n} is not divisible by its split {c}")
        out[name] = {"full": full, "shard": tuple(n // c for n, c in zip(full, split)), "split": split}
    return out


__all__ = ["EPExperts", "moe_device_layout", "parameter_shards", "set_moe_seq_length", "shard_mlp", "shard_moe",
           "split_counts", "use_mindformers"]
