"""Qwen2.5-ViT style native-resolution vision encoder and 2x2 patch-merger projector.

Reads top to bottom: patch embedding (a MatMul equal to HF's Conv3d with stride = kernel, the MindVL
paper's Conv3d replacement; the converter reshapes the Conv3d weight [E, C, T, P, P] to [E, C*T*P*P]),
optional learned absolute positions (off by default, as in Qwen2.5-ViT; the demo's from-scratch model
uses them), 2D rotary embedding, MLP, attention, block, patch merger, the encoder.

All images of a batch are one packed sequence of N patches. Everything that depends on image sizes is
computed host-side (`mindvl_ms.models.inputs.vision_metadata`) and passed in:
  vision_pos_ids     int32[N, 2]   (row, col) of each patch, already in window order
  window_index       int32[N/4]    merge-unit order that groups units by attention window
  reverse_index      int32[N/4]    argsort(window_index), restores image order after the merger
  window_segment_ids int32[N]      window id of each patch (window-attention layers)
  full_segment_ids   int32[N]      image id of each patch (full-attention layers)
Module names follow transformers' Qwen2_5_VisionTransformerPretrainedModel so HF weights load by name.
"""
import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ..config import VisionConfig
from ..ops import ApplyRotary, CoreAttention, RMSNorm, SwiGLU, segment_bias


def dense(d_in: int, d_out: int, bias: bool, std: float) -> nn.Dense:
    """nn.Dense (weight [out, in], as torch Linear) with a normal init and zero bias."""
    return nn.Dense(d_in, d_out, weight_init=Normal(std), bias_init="zeros", has_bias=bias)


def activation(name: str) -> nn.Cell:
    if name == "gelu":
        return nn.GELU(approximate=False)
    if name == "gelu_pytorch_tanh":
        return nn.GELU(approximate=True)
    if name == "quick_gelu":
        return QuickGELU()
    return nn.SiLU()


class QuickGELU(nn.Cell):
    def construct(self, x):
        return x * ops.sigmoid(1.702 * x)


class VisionPatchEmbed(nn.Cell):
    """[N, C*T*P*P] patches -> [N, E] by one MatMul (no bias)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        k = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.proj = dense(k, cfg.hidden_size, False, cfg.initializer_range)

    def construct(self, pixel_values):
        return self.proj(pixel_values.astype(self.proj.weight.dtype))


class VisionAbsPosEmbed(nn.Cell):
    """(row, col) [N, 2] -> learned row + column embeddings [N, E] (Pix2Struct-style absolute positions).

    Optional (`abs_pos_grid` > 0): Qwen2.5-ViT has only relative 2D RoPE, so nothing in the model says where a
    visual token is; the demo's small model trained from scratch did not learn to map a shape to box
    coordinates without it. Rows and columns past the grid share its last entry. Init std = the patch
    embedding's output scale at init.
    """

    def __init__(self, grid: int, dim: int, std: float):
        super().__init__()
        self.row = Parameter(initializer(Normal(std), (grid, dim), ms.float32), name="row")
        self.col = Parameter(initializer(Normal(std), (grid, dim), ms.float32), name="col")
        self.last = grid - 1

    def construct(self, pos_ids):  # [N, 2] (row, col)
        pos = ops.minimum(pos_ids, self.last)
        return ops.gather(self.row, pos[:, 0], 0) + ops.gather(self.col, pos[:, 1], 0)  # [N, E]


class VisionRotaryEmbedding(nn.Cell):
    """2D RoPE: (row, col) positions -> cos/sin [N, head_dim] (row freqs then col freqs, repeated twice)."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        dim = head_dim // 2
        inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        self.inv_freq = Tensor(inv.astype(np.float32))  # [head_dim/4], constant

    def construct(self, pos_ids):  # [N, 2]
        freqs = pos_ids.astype(ms.float32)[:, :, None] * self.inv_freq[None, None, :]  # [N, 2, hd/4]
        freqs = freqs.reshape(freqs.shape[0], -1)  # [N, hd/2]
        emb = ops.cat((freqs, freqs), -1)  # [N, hd]
        return ops.cos(emb), ops.sin(emb)


class VisionMLP(nn.Cell):
    """gated: down(act(gate(x)) * up(x)) as Qwen2.5-ViT; plain: fc2(act(fc1(x))) as openPangu-ViT."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        std = cfg.initializer_range
        self.gated = cfg.mlp_type == "gated"
        self.swiglu = cfg.hidden_act == "silu"
        if self.gated:
            self.gate_proj = dense(cfg.hidden_size, cfg.intermediate_size, True, std)
            self.up_proj = dense(cfg.hidden_size, cfg.intermediate_size, True, std)
            self.down_proj = dense(cfg.intermediate_size, cfg.hidden_size, True, std)
            self.glu = SwiGLU()
        else:
            self.fc1 = dense(cfg.hidden_size, cfg.intermediate_size, True, std)
            self.fc2 = dense(cfg.intermediate_size, cfg.hidden_size, True, std)
        self.act = activation(cfg.hidden_act)

    def construct(self, x):
        if not self.gated:
            return self.fc2(self.act(self.fc1(x)))
        if self.swiglu:
            return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionAttention(nn.Cell):
    """Fused qkv projection, 2D RoPE on q/k, block-diagonal attention given an additive bias."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = dense(cfg.hidden_size, cfg.hidden_size * 3, True, cfg.initializer_range)
        self.proj = dense(cfg.hidden_size, cfg.hidden_size, True, cfg.initializer_range)
        self.rotary = ApplyRotary()
        self.core = CoreAttention(cfg.num_heads, cfg.num_heads, cfg.head_dim, causal=False)

    def construct(self, x, cos, sin, bias):  # x [N, E], cos/sin [N, hd], bias [1, 1, N, N]
        qkv = self.qkv(x).reshape(-1, 3, self.num_heads, self.head_dim)  # [N, 3, H, hd]
        qkv = qkv.transpose(1, 2, 0, 3)  # [3, H, N, hd]
        q, k, v = qkv[0:1], qkv[1:2], qkv[2:3]  # [1, H, N, hd] each
        cos = cos[None, None]
        sin = sin[None, None]
        q = self.rotary(q, cos, sin)
        k = self.rotary(k, cos, sin)
        out = self.core(q, k, v, bias)  # [1, H, N, hd]
        out = out[0].transpose(1, 0, 2).reshape(-1, self.num_heads * self.head_dim)  # [N, E]
        return self.proj(out)


class VisionBlock(nn.Cell):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def construct(self, x, cos, sin, bias):
        x = x + self.attn(self.norm1(x), cos, sin, bias)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Cell):
    """The MLP projector: RMSNorm, group 2x2 neighbouring patches, Linear-GELU-Linear to the LLM width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.unit_dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        std = cfg.initializer_range
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        self.mlp = nn.SequentialCell([dense(self.unit_dim, self.unit_dim, True, std), nn.GELU(approximate=False),
                                      dense(self.unit_dim, cfg.out_hidden_size, True, std)])

    def construct(self, x):  # [N, E] -> [N/4, D_llm]
        return self.mlp(self.ln_q(x).reshape(-1, self.unit_dim))


class VisionTransformer(nn.Cell):
    """Packed patches of several images -> merged visual tokens [N/4, D_llm] in image order."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.unit = cfg.spatial_merge_size ** 2
        self.full = tuple(i in cfg.fullatt_block_indexes for i in range(cfg.depth))
        self.patch_embed = VisionPatchEmbed(cfg)
        self.abs_pos = cfg.abs_pos_grid > 0
        if self.abs_pos:
            k = self.patch_embed.proj.in_channels  # C*T*P*P
            self.pos_embed = VisionAbsPosEmbed(cfg.abs_pos_grid, cfg.hidden_size, cfg.initializer_range * k ** 0.5)
        self.rotary_pos_emb = VisionRotaryEmbedding(cfg.head_dim)
        self.blocks = nn.CellList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)

    def construct(self, pixel_values, vision_pos_ids, window_index, reverse_index, window_segment_ids,
                  full_segment_ids):
        x = self.patch_embed(pixel_values)  # [N, E] in image order
        e = x.shape[-1]
        x = ops.gather(x.reshape(-1, self.unit, e), window_index, 0).reshape(-1, e)  # window order
        if self.abs_pos:
            x = x + self.pos_embed(vision_pos_ids).astype(x.dtype)  # pos ids are given in window order
        cos, sin = self.rotary_pos_emb(vision_pos_ids)
        win_bias = segment_bias(window_segment_ids[None], window_segment_ids[None], False)  # [1, 1, N, N]
        full_bias = segment_bias(full_segment_ids[None], full_segment_ids[None], False)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, full_bias if self.full[i] else win_bias)
        x = self.merger(x)  # [N/4, D]
        return ops.gather(x, reverse_index, 0)
