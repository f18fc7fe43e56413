"""Shard strategies of the attention core (`mindvl_ms.ops.CoreAttention`) for a parallel layout.

MindFormers' convention (parallel_core/training_graph/transformer/flash_attention.py, TND layout without
context parallel), which compiles on Ascend:
  FlashAttentionScore inputs, in call order, only those that are not None:
    query [T, N, D]            (dp, tp, 1)
    key, value [T, Nkv, D]     (dp, tp, 1); (dp, 1, 1) when there is one kv head (MQA: nothing to split)
    attn_mask [2048, 2048]     (1, 1)      only for causal cores (sparse_mode 3, the compressed mask)
    actual_seq_qlen [K]        (dp,)
    actual_seq_kvlen [K]       (dp,)
  The ViT core (sparse_mode 0) has no mask, so its strategy has five entries.
The dense path's primitives (used on CPU and for KV-cache decoding) split batch by dp and heads by tp:
  BatchMatMul q.k^T ((dp, tp, 1, 1), (dp, tp, 1, 1)), *scale ((dp, tp, 1, 1), ()),
  +bias ((dp, tp, 1, 1), (dp, 1, 1, 1)), Softmax ((dp, tp, 1, 1),), BatchMatMul p.v as q.k^T.
Heads must divide by tp (a clear error otherwise); kv heads too unless there is one.
`split_batch=False` keeps the leading axes whole (dp -> 1): for the ViT, whose dense-path batch axis is
windows or images (a count that need not divide by dp) and whose packed patch sequence is not split by rows.
"""
from mindvl_ms.ops.attention import CoreAttention
from mindvl_ms.parallel.layout import Layout


def core_attention_strategies(core: CoreAttention, layout: Layout, split_batch: bool = True) -> dict:
    """Primitive attribute name -> strategy tuple for `core` under `layout` (see the module docstring)."""
    dp, tp = (layout.dp if split_batch else 1), layout.tp
    if core.num_heads % tp:
        raise ValueError(f"attention heads {core.num_heads} do not divide by model_parallel {tp}")
    kv_tp = 1 if core.num_kv_heads == 1 else tp
    if core.num_kv_heads % kv_tp:
        raise ValueError(f"key/value heads {core.num_kv_heads} do not divide by model_parallel {tp}")
    fa = [(dp, tp, 1), (dp, kv_tp, 1), (dp, kv_tp, 1)]
    if core.causal:
        fa.append((1, 1))  # compressed 2048x2048 causal mask, replicated
    fa += [(dp,), (dp,)]
    heads = (dp, tp, 1, 1)
    return {
        "fa": tuple(fa),
        "qk_matmul": (heads, heads),
        "scale_mul": (heads, ()),
        "bias_add": (heads, (dp, 1, 1, 1)),
        "softmax": (heads,),
        "pv_matmul": (heads, heads),
    }


def shard_core_attention(core: CoreAttention, layout: Layout, split_batch: bool = True) -> CoreAttention:
    """Declare the strategies of `core_attention_strategies` on the core's primitives; returns `core`."""
    for name, strategy in core_attention_strategies(core, layout, split_batch).items():
        getattr(core, name).shard(strategy)
    return core
