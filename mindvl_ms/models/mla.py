"""Multi-head latent attention (DeepSeek-V3) with M-RoPE on the decoupled rope dims.

Projections (HF `DeepseekV3Attention` names, weights [out, in]):
  q = q_b_proj(q_a_layernorm(q_a_proj(x)))            [B, L, H*(nope+rope)]   (q_proj when q_lora_rank is null)
  kv_a_proj_with_mqa(x) -> c_kv [kv_lora_rank], k_rot [rope] (one rope key shared by all heads)
  kv_b_proj(kv_a_layernorm(c_kv)) -> k_nope [H, nope], v [H, v_head_dim]
  keys = [k_nope, rope(k_rot)], queries = [q_nope, rope(q_rot)], softmax scale (nope+rope)^-1/2, o_proj.

M-RoPE with decoupled RoPE (the design choice): only the qk_rope_head_dim dims carry position, so the
three M-RoPE components (temporal, height, width) split those dims' rope_dim/2 frequency pairs by
`mrope_section` (sum = qk_rope_head_dim / 2), exactly as Qwen2.5-VL splits its head_dim/2 pairs (or
the interleaved or spread assignment of `mrope_layout`, see ops.layers.mrope_pair_axis; the cos/sin come
from `ops.layers.MRotaryEmbedding` over qk_rope_head_dim). The nope
dims and the compressed latent stay position-free, so MLA's latent caching is unchanged. For text tokens
t = h = w, every pair sees the same position and this reduces to DeepSeek-V3's 1D RoPE bit for bit.

Interleaved dims (unrelated to the M-RoPE layout above): DeepSeek-V3 weights pair rope dims as (0,1),
(2,3), ... (`rope_interleave`, the HF default). Like HF's `apply_rotary_pos_emb_interleave`, the rope
dims of q and k are reordered to (0,2,4,...,1,3,5,...) and then rotated in the rotate-half layout; q.k
is invariant to the common reorder. Frequency pair j therefore rotates dims (2j, 2j+1) of the checkpoint's layout.

Not implemented: YaRN rope scaling (DeepSeek-V3's long-context extension, its mscale on the softmax scale);
positions use plain RoPE with `rope_theta`.
"""
from mindspore import nn, ops

from mindvl_ms.ops import ApplyRotary, CoreAttention, RMSNorm
from mindvl_ms.ops.layers import dense


class MLAttention(nn.Cell):
    """x [B, L, D], cos/sin [B, 1, L, rope], bias [B, 1, L, L] -> [B, L, D]."""

    def __init__(self, cfg):
        super().__init__()
        m = cfg.moe
        std = cfg.initializer_range
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.nope = m.qk_nope_head_dim
        self.rope = m.qk_rope_head_dim
        self.v_dim = m.v_head_dim
        self.kv_rank = m.kv_lora_rank
        self.q_lora = m.q_lora_rank is not None
        self.interleave = bool(m.rope_interleave)
        qk = self.nope + self.rope
        if self.q_lora:
            self.q_a_proj = dense(d, m.q_lora_rank, std, cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = dense(m.q_lora_rank, self.num_heads * qk, std)
        else:
            self.q_proj = dense(d, self.num_heads * qk, std)
        self.kv_a_proj_with_mqa = dense(d, self.kv_rank + self.rope, std, cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, cfg.rms_norm_eps)
        self.kv_b_proj = dense(self.kv_rank, self.num_heads * (self.nope + self.v_dim), std)
        self.o_proj = dense(self.num_heads * self.v_dim, d, std, cfg.attention_bias)
        self.rotary = ApplyRotary()     # q's rope dims [B, H, L, rope]
        self.rotary_k = ApplyRotary()   # the shared rope key [B, 1, L, rope] (its own ops: no head split)
        self.core = CoreAttention(self.num_heads, self.num_heads, qk, scale=qk ** -0.5, v_head_dim=self.v_dim)

    def _deinterleave(self, x):  # [..., rope] pairs (2j, 2j+1) -> [evens, odds]
        if not self.interleave:
            return x
        shape = x.shape
        x = x.reshape(shape[:-1] + (self.rope // 2, 2))
        return ops.swapaxes(x, -1, -2).reshape(shape)

    def construct(self, x, cos, sin, bias, actual_seq_len=None):
        b, l, _ = x.shape
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.reshape(b, l, self.num_heads, self.nope + self.rope).swapaxes(1, 2)  # [B, H, L, qk]
        q_pass, q_rot = q[..., :self.nope], q[..., self.nope:]
        ckv = self.kv_a_proj_with_mqa(x)  # [B, L, rank + rope]
        c, k_rot = ckv[..., :self.kv_rank], ckv[..., self.kv_rank:]
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).reshape(b, l, self.num_heads, self.nope + self.v_dim)
        kv = kv.swapaxes(1, 2)  # [B, H, L, nope + v]
        k_pass, v = kv[..., :self.nope], kv[..., self.nope:]
        k_rot = k_rot.reshape(b, 1, l, self.rope)  # one rope key for all heads
        q_rot = self.rotary(self._deinterleave(q_rot), cos, sin)
        k_rot = self.rotary_k(self._deinterleave(k_rot), cos, sin)
        k_rot = ops.broadcast_to(k_rot, (b, self.num_heads, l, self.rope))
        q = ops.cat((q_pass, q_rot), -1)  # [B, H, L, qk]
        k = ops.cat((k_pass, k_rot), -1)  # [B, H, L, qk]
        out = self.core(q, k, v, bias, actual_seq_len, actual_seq_len)  # [B, H, L, v] (Ascend: v unpadded in TND)
        out = out.swapaxes(1, 2).reshape(b, l, self.num_heads * self.v_dim)
        return self.o_proj(out)
