"""Dense language model with M-RoPE: Qwen3 (QK-norm, no bias) and Qwen2 (qkv bias) from one config.

Reads top to bottom: MLP, attention, decoder layer, model, causal-LM head (the embedding table and the
multimodal rotary embedding are `ops.layers.Embedding` / `ops.layers.MRotaryEmbedding`).
Module names follow transformers' Qwen2/Qwen3 (`embed_tokens`, `layers.{i}.self_attn.q_proj`, `q_norm`,
`mlp.gate_proj`, `input_layernorm`, `norm`) so checkpoints convert by name.

M-RoPE: position_ids int32[3, B, L] hold (t, h, w) positions; rotary pair d uses axis a(d) given by
`mrope_section` and `mrope_layout` (see `ops.layers.mrope_pair_axis`: chunked t|h|w as in Qwen2.5-VL, interleaved
thw thw ... as in Qwen3-VL, or spread as openPangu-VL's 3D-IM-RoPE with its 1:6 t:(h+w) split; the same
assignment is repeated for the second half of head_dim). For text tokens the three positions are equal, so either
layout is plain 1D RoPE.
Attention is causal within a segment (segment_ids int32[B, L], 0 = padding), which makes packed rows
behave like separate samples.

The model returns (hidden [B, L, D], aux_loss [], expert_load [1, 1]) so that it has the same outputs as
the MoE language model (models/moe.py); for this dense model aux_loss is 0.
"""
import mindspore as ms
from mindspore import nn, ops

from mindvl_ms.config import TextConfig
from mindvl_ms.ops import AddRMSNorm, ApplyRotary, CoreAttention, RMSNorm, SwiGLU
from mindvl_ms.ops.attention import SegmentBias, SwapHeads
from mindvl_ms.ops.activation import GatedAct
from mindvl_ms.ops.layers import Embedding, MRotaryEmbedding, dense


class TextMLP(nn.Cell):
    """down(act(gate(x)) * up(x)): SwiGLU for `hidden_act` silu, the gated `act` otherwise (HF Qwen2/3 MLP)."""

    def __init__(self, hidden: int, inter: int, std: float, hidden_act: str = "silu"):
        super().__init__()
        self.gate_proj = dense(hidden, inter, std)
        self.up_proj = dense(hidden, inter, std)
        self.down_proj = dense(inter, hidden, std)
        self.glu = SwiGLU() if hidden_act == "silu" else GatedAct(hidden_act)

    def construct(self, x):
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class TextAttention(nn.Cell):
    """GQA attention; Qwen3 applies RMSNorm per head to q and k before RoPE."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.h, self.kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim_
        std, bias = cfg.initializer_range, cfg.attention_bias
        self.q_proj = dense(cfg.hidden_size, self.h * self.hd, std, bias)
        self.k_proj = dense(cfg.hidden_size, self.kv * self.hd, std, bias)
        self.v_proj = dense(cfg.hidden_size, self.kv * self.hd, std, bias)
        self.o_proj = dense(self.h * self.hd, cfg.hidden_size, std)
        self.use_qk_norm = cfg.use_qk_norm
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.rotary = ApplyRotary()
        self.core = CoreAttention(self.h, self.kv, self.hd)
        self.swap_heads = SwapHeads()  # [B, L, N, hd] <-> [B, N, L, hd] (a C++ copy on CPU)

    def construct(self, x, cos, sin, bias, actual_seq_len=None):  # x [B, L, D]
        q, k, v = self.project_qkv(x, cos, sin)
        return self.attend(q, k, v, bias, actual_seq_len)

    def project_qkv(self, x, cos, sin):
        """x [B, L, D] -> q [B, H, L, hd], k/v [B, KV, L, hd] (QK-norm and RoPE applied)."""
        b, l, _ = x.shape
        q = self.q_proj(x).reshape(b, l, self.h, self.hd)
        k = self.k_proj(x).reshape(b, l, self.kv, self.hd)
        v = self.swap_heads(self.v_proj(x).reshape(b, l, self.kv, self.hd))  # [B, KV, L, hd]
        if self.use_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = self.rotary(self.swap_heads(q), cos, sin)  # [B, H, L, hd]
        k = self.rotary(self.swap_heads(k), cos, sin)
        return q, k, v

    def attend(self, q, k, v, bias, actual_seq_len=None):
        """Attention over (possibly cached) keys/values and the output projection -> [B, L, D]."""
        b, l = q.shape[0], q.shape[2]
        out = self.core(q, k.astype(q.dtype), v.astype(q.dtype), bias, actual_seq_len, actual_seq_len)
        return self.o_proj(self.swap_heads(out).reshape(b, l, self.h * self.hd))


class DecoderLayer(nn.Cell):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TextAttention(cfg)
        self.post_attention_layernorm = AddRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # + the attention residual
        self.mlp = TextMLP(cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range, cfg.hidden_act)
        self.add = ops.Add()  # the MLP residual add (a primitive so it can carry a shard strategy)

    def construct(self, x, cos, sin, bias, actual_seq_len=None):
        h, x = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, bias, actual_seq_len), x)
        return self.add(x, self.mlp(h))


class TextModel(nn.Cell):
    """Embeddings are looked up by the caller (so image features can be merged in first)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.initializer_range)
        self.layers = nn.CellList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(cfg.head_dim_, cfg.rope_theta, cfg.mrope_section, cfg.mrope_layout)
        self.segment_bias = SegmentBias(causal=True)

    def embed(self, input_ids):  # [B, L] -> [B, L, D]
        return self.embed_tokens(input_ids)

    def construct(self, inputs_embeds, position_ids, segment_ids, actual_seq_len=None):
        """`actual_seq_len` int32[B*K] (inputs.llm_actual_seq_len) drives the Ascend TND kernel only."""
        cos, sin = self.rotary_emb(position_ids)  # [B, 1, L, hd]
        bias = self.segment_bias(segment_ids, segment_ids)  # [B, 1, L, L]
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, bias, actual_seq_len)
        return self.norm(x), ops.zeros((), ms.float32), ops.zeros((1, 1), ms.float32)


_MATMUL_NT = ops.MatMul(transpose_b=True)  # tied head of callers without a TiedHead (inference)


class TiedHead(nn.Cell):
    """The tied LM head: [N, D] x table [V, D]^T with its own MatMul primitive (so it can be sharded)."""

    def __init__(self):
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, flat, table):
        return self.matmul(flat, table.astype(flat.dtype))  # [N, V]


def lm_logits(h, embedding_weight, lm_head, tied_head=None):
    """Hidden [B, L, D] -> float32 logits [B, L, V] through `lm_head`, or the embedding table when tied.

    The tied head (`tied_head`, a TiedHead) is one 2-D MatMul on [B*L, D] x [V, D]^T: a batched matmul
    against the shared table would differentiate through a broadcast of the [V, D] table to every batch row
    and a sum back, a large share of a CPU micro-step with a 151,936-row vocabulary (docs/PERFORMANCE.md,
    "## models")."""
    d = h.shape[-1]
    flat = h.reshape(-1, d)                                           # [B*L, D]
    if lm_head is None:
        if tied_head is None:
            out = _MATMUL_NT(flat, embedding_weight.astype(h.dtype))  # [B*L, V]
        else:
            out = tied_head(flat, embedding_weight)                   # [B*L, V]
    else:
        out = lm_head(flat)
    return out.reshape(h.shape[:-1] + (-1,)).astype(ms.float32)       # [B, L, V]


class TextForCausalLM(nn.Cell):
    """A text-only Qwen2/Qwen3 causal LM (parameter names as HF: model.*, lm_head.weight)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.model = TextModel(cfg)
        self.tied = cfg.tie_word_embeddings
        self.lm_head = None if self.tied else dense(cfg.hidden_size, cfg.vocab_size, cfg.initializer_range)
        self.tied_head = TiedHead() if self.tied else None

    def construct(self, input_ids, position_ids, segment_ids):
        h, aux, load = self.model(self.model.embed(input_ids), position_ids, segment_ids)
        return lm_logits(h, self.model.embed_tokens.weight, self.lm_head, self.tied_head), aux, load
