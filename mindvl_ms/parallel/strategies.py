"""Shard-strategy tables (data, no model code): the strategies the styles of `parallel/styles.py` declare.

Conventions are MindFormers' (mindformers/models/llama/llama_transformer.py and
parallel_core/training_graph/tensor_parallel/layers.py), which are known to compile on Ascend:

  linear role       MatMul in_strategy (x [N, in], w [out, in])    out_strategy        BiasAdd
  column            ((dp, 1), (tp, 1))                              -                   ((dp, tp), (tp,))
  row               ((dp, tp), (1, tp))                             -  (AllReduce)      ((dp, 1), (1,))
  row + seq par.    ((dp, tp), (1, tp))                             ((dp*tp, 1),)       ((dp*tp, 1), (1,))
                    (the output is reduce-scattered over the TP group onto the token axis)
  replicated        ((dp, 1), (1, 1))   weight not split (MLA down projections, patch embedding, MTP eh_proj)
  vocab             ((dp, 1), (vt, 1))  vt = tp when the vocab is split, else 1 (lm_head / tied head)

  embedding Gather  ((vt, 1), (dp, 1))  (table [V, D], ids [B, L])
  loss head         ((dp, 1), (vt, 1)) on its logits MatMul, (dp, vt) on its [c, V] blocks (`HEAD_CE`)
  norms, residuals  hidden [B, L, D]: (dp, sp, 1), sp = tp under use_seq_parallel (else 1)
                    per-head q/k norm [B, L, H, hd]: (dp, 1, tp, 1); MLA latents [B, L, r]: (dp, 1, 1)
  rotary            q/k [B, H, L, d]: (dp, tp, 1, 1) with cos/sin [B, 1, L, d]: (dp, 1, 1, 1); the fused
                    RotaryPositionEmbedding as MindFormers: Layouts in and out, `self_define_shard`
  SwiGLU            [B, L, I]: (dp, 1, tp)

Symbols in the tables: "dp", "tp", "sp" (tp under sequence parallel, else 1), "dptp" (dp * tp), "vt"
(vocab split), "vtp" (the vision tower's tensor split: tp when `vision_parallel: tp`, else 1). Integers
stand for themselves. `resolve(template, axes)` turns a template into the integer strategy.

The vision tower has one packed sequence of N patches ([N, E] tensors): its rows are split by dp, its
weights by `vtp`; `vision_parallel: dp` keeps every ViT/projector weight whole (MindSpeed-MM and
openPangu-VL keep the ViT data parallel) and `tp` applies the LLM's column/row split.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

Template = Tuple  # nested tuples of symbols / ints

# -- linear layers (nn.Dense: matmul with transpose_b, optional bias_add) ----------------------------
# role -> (matmul in_strategy, matmul out_strategy or None, bias_add in_strategy)
LINEAR: Dict[str, Tuple[Template, Optional[Template], Template]] = {
    "column": ((("dp", 1), ("tp", 1)), None, (("dp", "tp"), ("tp",))),
    "row": ((("dp", "tp"), (1, "tp")), None, (("dp", 1), (1,))),
    "row_sp": ((("dp", "tp"), (1, "tp")), (("dptp", 1),), (("dptp", 1), (1,))),
    "replicated": ((("dp", 1), (1, 1)), None, (("dp", 1), (1,))),
    "vocab": ((("dp", 1), ("vt", 1)), None, (("dp", "vt"), ("vt",))),
    # vision tower: the same roles with the vision split `vtp` in place of tp
    "v_column": ((("dp", 1), ("vtp", 1)), None, (("dp", "vtp"), ("vtp",))),
    "v_row": ((("dp", "vtp"), (1, "vtp")), None, (("dp", 1), (1,))),
}

# -- activations' input strategies by role --------------------------------------------------------
HIDDEN = ("dp", "sp", 1)            # [B, L, D] norms and residual adds
HEAD_NORM = ("dp", 1, "tp", 1)      # q_norm / k_norm on [B, L, H, hd]
LATENT_NORM = ("dp", 1, 1)          # MLA q_a_layernorm / kv_a_layernorm on [B, L, rank]
VISION_ROWS = ("dp", 1)             # ViT / projector norms and residual adds on [N, E]
FFN = ("dp", 1, "tp")               # SwiGLU on [B, L, I]
VISION_FFN = ("dp", "vtp")          # ViT SwiGLU on [N, I]
ROPE_Q = ("dp", "tp", 1, 1)         # q/k [B, H, L, d]
ROPE_SHARED_K = ("dp", 1, 1, 1)     # MLA's single rope key [B, 1, L, d]
ROPE_COS = ("dp", 1, 1, 1)          # cos/sin [B, 1, L, d]
VISION_ROPE_Q = (1, "vtp", "dp", 1)  # ViT q/k [1, H, N, hd]
VISION_ROPE_COS = (1, 1, "dp", 1)   # ViT cos/sin [1, 1, N, hd]
EMBED_GATHER = (("vt", 1), ("dp", 1))

# -- the train step's chunked loss head (train/loss_head.py ChunkedHeadCE), MindFormers' vocab-parallel head and
# VocabParallelCrossEntropy (parallel_core/training_graph/loss_func.py): hidden rows [c, D] split dp, the head
# weight [V, D] split vt on V as `LINEAR["vocab"]`, every [c, V] block (dp, vt); the max and sums over V
# become all-reduces over the vocab shards, dh = G @ W all-reduces over them, dW = G^T @ h over dp.
HEAD_CE = {
    "mm_nt": (("dp", 1), ("vt", 1)),         # logits [c, V] = h [c, D] x W [V, D]^T
    "mm": (("dp", "vt"), ("vt", 1)),         # dh [c, D] = G [c, V] x W [V, D]
    "mm_tn": (("dp", "vt"), ("dp", 1)),      # dW [V, D] = G [c, V]^T x h [c, D]
    "max": (("dp", "vt"),),                  # [c, V] -> [c, 1]
    "sub": (("dp", "vt"), ("dp", 1)),        # z = logits - max
    "exp": (("dp", "vt"),),
    "sum": (("dp", "vt"),),                  # [c, V] -> [c, 1]
    "log": (("dp", 1),),
    "onehot": (("dp", "vt"), (), ()),        # targets [c] -> [c, V]
    "mul": (("dp", "vt"), ("dp", "vt")),
    "div": (("dp", "vt"), ("dp", 1)),        # softmax = exp z / sum
    "sub_onehot": (("dp", "vt"), ("dp", "vt")),
}


def vocab_split(layout, vocab_size: int) -> int:
    """tp when the embedding / LM head are vocab-parallel: not `vocab_emb_dp` and the vocab divides by tp."""
    if layout.tp > 1 and not layout.vocab_emb_dp and vocab_size % layout.tp == 0:
        return layout.tp
    return 1


def axes_for(layout, vocab_size: int, vision_parallel: str = "dp") -> Dict[str, int]:
    """Symbol -> size for a Layout (see the module docstring)."""
    if vision_parallel not in ("dp", "tp"):
        raise ValueError(f"vision_parallel '{vision_parallel}': expected dp or tp")
    tp, dp = layout.tp, layout.dp
    return {"dp": dp, "tp": tp, "sp": tp if layout.seq_parallel else 1, "dptp": dp * tp,
            "vt": vocab_split(layout, vocab_size), "vtp": tp if vision_parallel == "tp" else 1}


def resolve(template, axes: Dict[str, int]):
    """Nested tuple of symbols/ints -> nested tuple of ints."""
    if isinstance(template, tuple):
        return tuple(resolve(t, axes) for t in template)
    if isinstance(template, int):
        return template
    return axes[template]


def norm_strategies(s: Tuple[int, ...]) -> Dict[str, tuple]:
    """RMSNorm primitive -> in_strategy, for input strategy `s` (see ops/norm.py)."""
    return {"rms_norm": (s, (1,)), "square": (s, s), "mean": (s,), "add_eps": (s, ()), "rsqrt": (s,),
            "mul": (s, s), "mul_weight": ((1,), s)}


def add_norm_strategies(s: Tuple[int, ...]) -> Dict[str, tuple]:
    """AddRMSNorm primitive -> in_strategy: the residual add, then the RMSNorm's (see ops/norm.py)."""
    return {**norm_strategies(s), "add": (s, s)}


def rotary_strategies(q: Tuple[int, ...], cos: Tuple[int, ...]) -> Dict[str, tuple]:
    """ApplyRotary's composite primitives -> in_strategy (see ops/rotary.py); the fused kernel takes
    `rope_layout_names` instead."""
    return {"split": (q,), "neg": (q,), "concat": (q, q), "mul_cos": (q, cos), "mul_sin": (q, cos), "add": (q, q)}


ROPE_DEVICE_AXES = ("dp", "tp")  # MindFormers' device matrix names (device_matrix.py (dp, cp, tp); no cp here)


def rope_layout_names(template: Template, axes: Dict[str, int]) -> Tuple[str, ...]:
    """A rotary template -> the Layout alias of each dim, MindFormers' form for the fused RotaryPositionEmbedding
    (rope_utils.ApplyRotaryPosEmb.shard: layout("cp", "dp", "tp", "None") and the like): "dp" for a dp split,
    "tp" for a tp / vtp split, "None" for a whole dim (a symbol of size 1 included)."""
    names = []
    for sym in template:
        size = 1 if isinstance(sym, int) else axes[sym]
        names.append("None" if size == 1 else ("dp" if sym == "dp" else "tp"))
    return tuple(names)


def glu_strategies(s: Tuple[int, ...]) -> Dict[str, tuple]:
    """SwiGLU / GatedAct primitive -> in_strategy (see ops/activation.py)."""
    return {"silu": (s,), "mul": (s, s), "concat": (s, s), "swiglu": (s,)}
