"""MindFormers' MoE pieces (router, AlltoAll token dispatcher) configured from this project's MoE sizes.

`transformer_config(...)` builds the `mindformers.parallel_core.transformer_config.TransformerConfig` that
MindFormers' TopKRouter and MoEAlltoAllTokenDispatcher read, from the DeepSeek-V3 routing fields of
`TextConfig.moe` and a `mindvl_ms.parallel.layout.Layout`. Field mapping:

    n_routed_experts      -> num_moe_experts          num_experts_per_tok -> moe_router_topk
    n_group / topk_group  -> moe_router_num_groups / moe_router_group_topk
    scoring_func          -> moe_router_score_function   routed_scaling_factor -> moe_router_topk_scaling_factor
    norm_topk_prob        -> norm_topk_prob           e_score_correction_bias -> moe_router_enable_expert_bias
    dp / tp / ep          -> data_parallel_size / tensor_model_parallel_size / expert_model_parallel_size

Routing difference (MindFormers 1.9.0 `TopKRouter._group_limited_topk`): a group's score is the sum of its
top (num_experts_per_tok // topk_group) biased scores, DeepSeek-V3's is the sum of its top 2. The two agree
exactly when num_experts_per_tok // topk_group == 2 (DeepSeek-V3's 8 // 4, the tiny config's 2 // 1);
`routing_rules_agree` says whether they do, and tests/parallel/test_mindformers_moe.py shows a config where they
differ.

`mindformers_dispatcher(...)` builds MindFormers' MoEAlltoAllTokenDispatcher for the routed experts under
expert parallel (`parallel.moe.EPExperts`); `MindFormersSelect` runs TopKRouter's expert selection.

MindFormers itself is imported on first use (`_mindformers`), not with this module: importing it is slow
(docs/PERFORMANCE.md, "## parallel") and writes a log directory, and only the Ascend MoE path and its CPU
test use it, while every parallel layout imports this module. Its log goes under $LOCAL_DEFAULT_PATH
(MindFormers' default ./output); this module points it at ~/.cache/mindvl_ms/mindformers unless the
variable is set.
"""
import importlib
import os
import warnings
from types import SimpleNamespace

import mindspore as ms
from mindspore import nn

from mindvl_ms.parallel.layout import Layout

os.environ.setdefault("LOCAL_DEFAULT_PATH", os.path.join(os.path.expanduser("~"), ".cache", "mindvl_ms", "mindformers"))

_MODULES = {  # name -> (MindFormers module, attribute)
    "TransformerConfig": ("mindformers.parallel_core.transformer_config", "TransformerConfig"),
    "layout_moe": ("mindformers.parallel_core.training_graph.device_matrix", "layout_moe"),
    "TopKRouter": ("mindformers.parallel_core.training_graph.transformer.moe.router", "TopKRouter"),
    "MoEAlltoAllTokenDispatcher": ("mindformers.parallel_core.training_graph.transformer.moe.token_dispatcher",
                                   "MoEAlltoAllTokenDispatcher"),
}


def _mindformers() -> SimpleNamespace:
    """The MindFormers classes this module uses, imported on first use (see the module docstring)."""
    return SimpleNamespace(**{name: getattr(importlib.import_module(module), attr)
                              for name, (module, attr) in _MODULES.items()})


def routing_rules_agree(moe) -> bool:
    """True when MindFormers' group score (top k/topk_group) equals DeepSeek-V3's (top 2) for this config."""
    if moe.n_group <= 1:
        return True
    return moe.num_experts_per_tok // moe.topk_group == min(2, moe.n_routed_experts // moe.n_group)


def transformer_config(num_experts: int, top_k: int, hidden: int, layout=None, seq_length: int = 4096,
                       moe=None, dtype: str = "float32"):
    """A MindFormers TransformerConfig carrying the MoE and parallel sizes (one layer, no attention use)."""
    dp, tp, ep = (layout.dp, layout.tp, layout.ep) if layout is not None else (1, 1, 1)
    kw = dict(num_layers=1, hidden_size=hidden, num_attention_heads=tp, seq_length=seq_length,
              num_moe_experts=num_experts, moe_router_topk=top_k, moe_ffn_hidden_size=hidden,
              add_bias_linear=False, data_parallel_size=dp, tensor_model_parallel_size=tp,
              expert_model_parallel_size=ep, sequence_parallel=bool(layout is not None and layout.seq_parallel),
              moe_router_dtype="float32", compute_dtype=dtype, params_dtype=dtype)
    if moe is not None:
        kw.update(moe_router_num_groups=moe.n_group if moe.n_group > 1 else None,
                  moe_router_group_topk=moe.topk_group if moe.n_group > 1 else None,
                  moe_router_score_function=moe.scoring_func,
                  moe_router_enable_expert_bias=True,
                  moe_router_topk_scaling_factor=float(moe.routed_scaling_factor),
                  norm_topk_prob=bool(moe.norm_topk_prob),
                  moe_ffn_hidden_size=moe.moe_intermediate_size)
    return _mindformers().TransformerConfig(**kw)


def mindformers_dispatcher(num_experts: int, top_k: int, hidden: int, layout: Layout, seq_length: int):
    """MindFormers' MoEAlltoAllTokenDispatcher for these sizes (its EP group is created from the rank when
    the parallel mode is not stand-alone). `seq_length` is the tokens per row of the micro-batches it
    dispatches (the stage's seq_length): the dispatcher derives its AlltoAllV split sizes and the batch size
    of its token rows from it (token_dispatcher.py: `seq_length // (tp * cp) * topk`), so it has no default."""
    cfg = transformer_config(num_experts=num_experts, top_k=top_k, hidden=hidden, layout=layout,
                             seq_length=seq_length)
    return _mindformers().MoEAlltoAllTokenDispatcher(cfg)


class MindFormersSelect(nn.Cell):
    """MindFormers' TopKRouter expert selection on this project's biased scores: choice [T, E] -> ids int32 [T, k].

    Only the selection code runs (`_group_limited_topk`, or `_topk` without groups, on an [S, T/S, E] view, S = dp*tp):
    TopkExt and MindFormers' group rule. The router's own Parameters are dropped (logits, bias, routing
    weights and balancing stay this project's TopkRouter's), so checkpoints keep their HF names. Runs where
    TopkExt runs (Ascend), or on CPU with the kernels substituted as tests/parallel/test_mindformers_moe.py does.
    """

    def __init__(self, moe, layout: Layout = None):
        super().__init__()
        mf = _mindformers()
        if not routing_rules_agree(moe):
            top = moe.num_experts_per_tok // moe.topk_group
            warnings.warn(f"MindFormers' TopKRouter ranks groups by their top {top} scores, DeepSeek-V3 by their "
                          f"top 2 (num_experts_per_tok {moe.num_experts_per_tok}, topk_group {moe.topk_group}): "
                          f"routing on Ascend differs from the CPU path and from HF DeepSeek-V3 for this config",
                          stacklevel=2)
        cfg = transformer_config(moe.n_routed_experts, moe.num_experts_per_tok, hidden=8, layout=layout, moe=moe)
        # MindFormers' MoE device matrix (a process-wide singleton read by TopKRouter.shard in semi-auto mode),
        # re-initialised for this layout
        mf.layout_moe._layout, mf.layout_moe._config = None, None  # pylint: disable=protected-access
        mf.layout_moe.init_layout(cfg)
        self.moe_config = moe
        self.layout = layout or Layout()  # the layout it was built for (`shard_moe` rebuilds it for another)
        self.stage = self.layout.dp * self.layout.tp  # tokens split over the stage's devices
        cfg.moe_router_enable_expert_bias = False  # the bias is added by TopkRouter; MindFormers only selects
        cfg.moe_router_load_balancing_type = "seq_aux_loss"
        router = mf.TopKRouter(cfg)
        for name in list(router._params):  # pylint: disable=protected-access
            del router._params[name]  # pylint: disable=protected-access
        self.router = router
        self.grouped = bool(router.enable_group_limited)

    def construct(self, choice):
        t, e = choice.shape
        c = choice.reshape(self.stage, t // self.stage, e)  # [S, T/S, E], MindFormers' (dp, N, E)
        if self.grouped:
            _, idx = self.router._group_limited_topk(c, c)  # pylint: disable=protected-access
        else:
            _, idx = self.router._topk(c, c)  # pylint: disable=protected-access
        return idx.reshape(t, -1).astype(ms.int32)
