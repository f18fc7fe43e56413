"""Qwen2.5-ViT style native-resolution vision encoder and 2x2 patch-merger projector.

Reads top to bottom: patch embedding (a MatMul equal to HF's Conv3d with stride = kernel, the MindVL
paper's Conv3d replacement; the converter reshapes the Conv3d weight [E, C, T, P, P] to [E, C*T*P*P]),
optional learned absolute positions (off by default, as in Qwen2.5-ViT; see VisionAbsPosEmbed for when
they help), 2D rotary embedding, MLP, attention, block, patch merger, the encoder.

All images of a batch are one packed sequence of N patches (`models.mindvl.flat_vision_inputs` packs the
rows of a batch, each padded to its patch budget, into it). Everything that depends on image sizes is
computed host-side (`mindvl_ms.data.rope_index.vision_metadata`) and passed in:
  vision_pos_ids     int32[N, 2]   (row, col) of each patch, already in window order
  window_index       int32[N/4]    merge-unit order that groups units by attention window
  reverse_index      int32[N/4]    argsort(window_index), restores image order after the merger
  window_segment_ids int32[N]      window id of each patch (window-attention layers), 1-based, in order
  full_segment_ids   int32[N]      image (frame) id of each patch (full-attention layers), 1-based
  window_gather      int32[Sw, Ww] patches of each window, padded with N (optional, see below)
  full_gather        int32[Sf, Wf] patches of each image (frame), padded with N (optional)
Attention layout (the design choice): with the gathers given, window layers attend per window and full
layers per image: q/k/v rows (RoPE applied to the fused qkv in one pass) are gathered into [S, H, W, hd]
blocks (padding slots read a real row; their keys are masked, their outputs dropped), attention runs on
[S, H, W, W] scores, and each patch's output is gathered back from its block slot. Cost is sum over
blocks of W^2 instead of N^2 for the whole batch (1280x720: 84 windows of <= 64 patches instead of one
4,784^2 mask). Without the gathers the encoder
falls back to one dense [N, N] mask built from the segment ids (same result; kept for the positional
6-input API). On Ascend the fused kernel takes the packed [N, H, hd] sequence in TND layout with
`actual_seq_qlen` = the blocks' cumulative ends, derived in-graph from the gathers (only runs there).
Module names follow transformers' Qwen2_5_VisionTransformerPretrainedModel so HF weights load by name.
"""
import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from mindvl_ms.config import VisionConfig
from mindvl_ms.ops import ApplyRotary, CoreAttention, RMSNorm, SwiGLU, segment_bias
from mindvl_ms.ops.activation import activation
from mindvl_ms.ops.attention import NEG_INF, BlocksToHeads, SwapHeads
from mindvl_ms.ops.cpu_kernels import custom_op
from mindvl_ms.ops.dispatch import is_ascend
from mindvl_ms.ops.layers import dense
from mindvl_ms.ops.linear import BiasAddMatMulGrad


class VisionPatchEmbed(nn.Cell):
    """[N, C*T*P*P] patches -> [N, E] by one MatMul (no bias)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        k = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.proj = dense(k, cfg.hidden_size, cfg.initializer_range)

    def construct(self, pixel_values):
        return self.proj(pixel_values.astype(self.proj.weight.dtype))


class VisionAbsPosEmbed(nn.Cell):
    """(row, col) [N, 2] -> learned row + column embeddings [N, E] (Pix2Struct-style absolute positions).

    Optional (`abs_pos_grid` > 0): Qwen2.5-ViT has only relative 2D RoPE, under which attention depends on
    the offsets between patches and not on where a patch sits in the image. Outputs in image coordinates
    (grounding boxes) need that absolute position, and a model trained from scratch, without a pretrained
    encoder's learned cues, gets it only from an input like this one. Rows and columns past the grid share
    its last entry. Init std = the patch embedding's output scale at init.
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
        n = pos_ids.shape[0]
        freqs = pos_ids.astype(ms.float32).reshape(n, 2, 1) * self.inv_freq.reshape(1, 1, -1)  # [N, 2, hd/4]
        freqs = freqs.reshape(n, -1)  # [N, hd/2]
        emb = ops.cat((freqs, freqs), -1)  # [N, hd]
        return ops.cos(emb), ops.sin(emb)


def qkv_rotary(cos, sin, q_scale: float, num_heads: int):
    """cos/sin [N, hd] -> [N, 3, H, hd] for RoPE over a fused [N, 3, H, hd] qkv in one pass: the k rows get
    cos/sin, the q rows cos/sin times `q_scale` (the attention's 1/sqrt(hd), applied to the [N, H, hd]
    queries instead of the [S, H, W, W] scores), the v rows cos 1 and sin 0 (v * 1 + rotate_half(v) * 0 = v).
    Broadcast to every head once here, for all blocks: MindSpore's CPU Mul of [N, 3, H, hd] by [N, 3, 1, hd]
    is several times slower than the same-shape Mul (docs/PERFORMANCE.md, "## models")."""
    n, hd = cos.shape
    one, zero = ops.ones((n, hd), cos.dtype), ops.zeros((n, hd), sin.dtype)
    shape = (n, 3, num_heads, hd)
    return (ops.broadcast_to(ops.stack((cos * q_scale, cos, one), 1).reshape(n, 3, 1, hd), shape),
            ops.broadcast_to(ops.stack((sin * q_scale, sin, zero), 1).reshape(n, 3, 1, hd), shape))


# the MatMul primitive: its backward is MatMuls with transpose flags. `ops.matmul` (MatMulExt) differentiates
# through Transpose kernels, and MindSpore's CPU Transpose keeps an 8-byte index per element per kernel
# (the memory saved: docs/PERFORMANCE.md, "## models")
_MATMUL = ops.MatMul()


def rotate_half_matrix(hd: int) -> np.ndarray:
    """R [hd, hd] with x @ R = rotate_half(x) = [-x2, x1] (one nonzero +-1 per column: exact in float32)."""
    half = hd // 2
    r = np.zeros((hd, hd), np.float32)
    r[np.arange(half) + half, np.arange(half)] = -1.0
    r[np.arange(half), np.arange(half) + half] = 1.0
    return r


class _QkvRopeKernel(nn.Cell):
    """The C++ pass (ops/csrc/qkv_rope.cc) with its hand-written backward; float32 [N, 3E] in and out."""

    def __init__(self, fwd, bwd):
        super().__init__()
        self.fwd, self.bwd = fwd, bwd

    def construct(self, mm, bias, cos, sin):
        return self.fwd(mm, bias, cos, sin)

    def bprop(self, mm, bias, cos, sin, out, dout):
        d = self.bwd(dout, cos, sin)  # [N, 3E]
        ones = ops.ones((1, d.shape[0]), d.dtype)
        return d, _MATMUL(ones, d).reshape(bias.shape), ops.zeros_like(cos), ops.zeros_like(sin)


class QkvBiasRope(nn.Cell):
    """CPU block path of VisionAttention: rows [N, 3E] = t * cos + rotate_half(t) * sin on the q and k parts
    and t on the v part, t = mm + bias (the fused qkv projection without, then with, its bias).

    With `kernel` (the default where `ops/cpu_kernels.py` can build its library) this is one C++ pass over
    [N, 3E] whose every float op rounds as the composite ops below round it: for float32 the same values bit
    for bit, forward and backward (tests/ops/test_cpu_kernels.py; bench/bench_vision.py's gain is in the README's
    kernel section). Other dtypes are cast to float32 before the bias add (the composite adds it first).
    The composite: BiasAdd, rotate_half as one MatMul with a +-1 matrix (exact), two Muls by `qkv_rotary`'s
    broadcast tables, Add. `tables` gives the cos/sin layout each path takes; `drop_kernel` switches to the
    composite for good.
    """

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        fwd = bwd = None
        if not is_ascend():  # Ascend runs the block layout through its fused attention instead
            fwd = custom_op("QkvBiasRope", 4)
            bwd = custom_op("QkvRopeGrad", 3)
        self.fused = _QkvRopeKernel(fwd, bwd) if fwd is not None and bwd is not None else None
        self.kernel = self.fused is not None  # read by the graph; only drop_kernel changes it
        self.bias_add = BiasAddMatMulGrad()
        self.rot_half = Tensor(rotate_half_matrix(head_dim))

    def drop_kernel(self):
        """Composite ops from now on, and no C++ op held (`parallelize`: a parallel layout compiles for
        Ascend, where this CPU kernel never runs, and every primitive the model holds gets a strategy)."""
        self.kernel = False
        self.fused = None

    def tables(self, cos, sin, q_scale: float):
        """cos/sin [N, hd] -> the kernel's [N, 2, hd] (q rows times q_scale, k rows) or `qkv_rotary`'s
        [N, 3, H, hd]."""
        if self.kernel:
            return ops.stack((cos * q_scale, cos), 1), ops.stack((sin * q_scale, sin), 1)
        return qkv_rotary(cos, sin, q_scale, self.num_heads)

    def construct(self, mm, bias, cos, sin):  # mm [N, 3E] = x @ W_qkv^T, bias [3E]
        dtype = mm.dtype
        if self.kernel:
            if dtype != ms.float32:
                mm, bias = mm.astype(ms.float32), bias.astype(ms.float32)
            return self.fused(mm, bias, cos, sin).astype(dtype)
        n = mm.shape[0]
        qkv32 = self.bias_add(mm, bias).astype(ms.float32).reshape(n, 3, self.num_heads, self.head_dim)
        rot = _MATMUL(qkv32.reshape(-1, self.head_dim), self.rot_half).reshape(qkv32.shape)
        return (qkv32 * cos + rot * sin).astype(dtype).reshape(n, -1)  # [N, 3E]


class VisionMLP(nn.Cell):
    """gated: down(act(gate(x)) * up(x)) as Qwen2.5-ViT; plain: fc2(act(fc1(x))) as openPangu-ViT."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        std = cfg.initializer_range
        self.gated = cfg.mlp_type == "gated"
        self.swiglu = cfg.hidden_act == "silu"
        if self.gated:
            self.gate_proj = dense(cfg.hidden_size, cfg.intermediate_size, std, bias=True)
            self.up_proj = dense(cfg.hidden_size, cfg.intermediate_size, std, bias=True)
            self.down_proj = dense(cfg.intermediate_size, cfg.hidden_size, std, bias=True)
            self.glu = SwiGLU()
        else:
            self.fc1 = dense(cfg.hidden_size, cfg.intermediate_size, std, bias=True)
            self.fc2 = dense(cfg.intermediate_size, cfg.hidden_size, std, bias=True)
        self.act = activation(cfg.hidden_act)
        self.mul = ops.Mul()  # act(gate) * up (gated, non-SiLU)

    def construct(self, x):
        if not self.gated:
            return self.fc2(self.act(self.fc1(x)))
        if self.swiglu:
            return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.mul(self.act(self.gate_proj(x)), self.up_proj(x)))


class VisionBlocks(nn.Cell):
    """A host-side block gather [S, W] -> what every layer of that attention kind reuses (no parameters).

    unpad int32[N]: flat slot (block * W + offset) of each patch; key_bias float32[S, 1, 1, W]: 0 for real
    patches, NEG_INF for the padding slots; seq_ends int32[S]: cumulative block lengths (TND actual lengths).
    """

    def construct(self, gather, seg, n):  # gather [S, W], seg [N] 1-based block ids
        width = gather.shape[1]
        valid = gather < n  # [S, W]
        block = seg - 1  # [N]
        start = ops.gather(gather[:, 0], block, 0)  # [N] first patch of each patch's block
        unpad = block * width + ops.arange(n, dtype=ms.int32) - start  # [N]
        key_bias = ops.logical_not(valid).astype(ms.float32)[:, None, None, :] * NEG_INF  # [S, 1, 1, W]
        seq_ends = ops.cumsum(valid.astype(ms.int32).sum(1), 0).astype(ms.int32)  # [S]
        return unpad.astype(ms.int32), key_bias, seq_ends


class VisionAttention(nn.Cell):
    """Fused qkv projection, 2D RoPE on q/k, attention within windows or images (see the module doc)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = dense(cfg.hidden_size, cfg.hidden_size * 3, cfg.initializer_range, bias=True)
        self.proj = dense(cfg.hidden_size, cfg.hidden_size, cfg.initializer_range, bias=True)
        self.rotary = ApplyRotary()
        self.core = CoreAttention(cfg.num_heads, cfg.num_heads, cfg.head_dim, causal=False)
        self.fused = self.core.fused
        # CPU block path: bias and RoPE over the fused qkv in one pass (QkvBiasRope), q/k/v split off the
        # gathered blocks (functional ops, like its gathers: this path never runs under a parallel layout,
        # Ascend takes the fused one); the queries come pre-scaled, so attention is `core.prescaled`
        self.qkv_rope = QkvBiasRope(cfg.num_heads, cfg.head_dim)
        self.swap_heads = SwapHeads()  # the block outputs [S, H, W, hd] -> [S, W, H, hd] (a C++ copy on CPU)
        self.to_heads = BlocksToHeads()  # gathered rows [S, W, 3, H, hd] -> [3, S, H, W, hd] (likewise)

    def construct(self, x, cos, sin, bias, blocks=None):
        """x [N, E]; `bias` [1, 1, N, N] (dense path) or `blocks` (gather, unpad, key_bias, seq_ends) from
        VisionBlocks. cos/sin: [N, hd], or `QkvBiasRope.tables` on the CPU block path."""
        n, e = x.shape
        if blocks is None or self.fused:
            qkv = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim)  # [N, 3, H, hd]
            qkv = qkv.transpose(1, 2, 0, 3)  # [3, H, N, hd]
            q, k, v = qkv[0:1], qkv[1:2], qkv[2:3]  # [1, H, N, hd] each
            q = self.rotary(q, cos[None, None], sin[None, None])
            k = self.rotary(k, cos[None, None], sin[None, None])
            if blocks is None:
                out = self.core(q, k, v, bias)  # [1, H, N, hd]
            else:  # Ascend only: TND flash attention over the packed sequence, block-diagonal by seq_ends
                out = self.core(q, k, v, None, blocks[3], blocks[3])
            out = out[0].transpose(1, 0, 2).reshape(n, e)  # [N, E]
            return self.proj(out)
        gather, unpad, key_bias = blocks[0], blocks[1], blocks[2]
        s, w = gather.shape
        # RoPE on q and k in one pass (the values of ApplyRotary: x * cos + rotate_half(x) * sin, float32)
        rows = self.qkv_rope(self.qkv.matmul(x, self.qkv.weight), self.qkv.bias, cos, sin)  # [N, 3E]
        # padding slots (index N) read row N - 1: their keys are masked by key_bias (weight exactly 0) and
        # their queries' outputs are never gathered back, so any real row gives the same result
        idx = ops.minimum(gather.reshape(-1), n - 1)
        blk = ops.gather(rows, idx, 0).reshape(s, w, 3, self.num_heads, self.head_dim)
        q, k, v = ops.split(self.to_heads(blk), 1, 0)  # 3 x [1, S, H, W, hd]
        shape = (s, self.num_heads, w, self.head_dim)
        out = self.core.prescaled(q.reshape(shape), k.reshape(shape), v.reshape(shape), key_bias)  # [S, H, W, hd]
        out = self.swap_heads(out).reshape(s * w, e)  # [S*W, E]
        return self.proj(ops.gather(out, unpad, 0))  # [N, E]


class VisionBlock(nn.Cell):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)
        self.add = ops.Add()  # the two residual adds

    def construct(self, x, cos, sin, bias, blocks=None):
        x = self.add(x, self.attn(self.norm1(x), cos, sin, bias, blocks))
        return self.add(x, self.mlp(self.norm2(x)))


class PatchMerger(nn.Cell):
    """The MLP projector: RMSNorm, group 2x2 neighbouring patches, Linear-GELU-Linear to the LLM width.

    With `hierarchical_layers`, openPangu-VL's "lightweight hierarchical connector" (report section 2.1: "we
    choose multiple outputs of the vision encoder and reduce the effective number of tokens forwarded with
    the patch merger module ... And the outputs of hierarchical patch merger are mapped to the LLM embedding
    space with the projector"): the outputs of several blocks are each normalised (`ln_hier.{i}` for the
    earlier ones, `ln_q` for the last) and grouped 2x2 (the token reduction), and ONE projector MLP maps
    them to the LLM width. `hierarchical_fusion` says how the levels meet before that MLP:
    - `sum` (the default): the normalised levels are added, so the MLP is the single-level one,
      [N/4, 4E] -> 4E -> D_llm. Each level's RMSNorm gain weights it channel by channel in the sum, so a
      learned weighting costs no parameter beyond the norms. This is the lightest reading that keeps every
      element the report names (several outputs, one patch merger, one projector) and the one that matches
      the word it uses twice, "lightweight" (section 2.1, and section 4.1: warm-up trains "only the
      lightweight connector").
    - `concat`: the groups are concatenated per merge unit, [N/4, L*4E] -> 4E -> D_llm, which keeps the
      levels apart until the projector at the price of a first linear layer L times as large.
    With one level both are exactly the Qwen2.5-VL merger (parameter names and shapes included).
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.unit_dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        std = cfg.initializer_range
        self.n_hier = max(len(cfg.hierarchical_layers) - 1, 0)
        self.concat = cfg.hierarchical_fusion == "concat"
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        if self.n_hier:
            self.ln_hier = nn.CellList([RMSNorm(cfg.hidden_size, 1e-6) for _ in range(self.n_hier)])
        in_dim = self.unit_dim * (self.n_hier + 1 if self.concat else 1)
        self.mlp = nn.SequentialCell([dense(in_dim, self.unit_dim, std, bias=True), nn.GELU(approximate=False),
                                      dense(self.unit_dim, cfg.out_hidden_size, std, bias=True)])

    def construct(self, x, earlier=()):  # x [N, E] (last block), earlier: n_hier x [N, E] -> [N/4, D_llm]
        h = self.ln_q(x)  # [N, E]
        if self.n_hier and self.concat:
            parts = ()
            for i in range(self.n_hier):
                parts += (self.ln_hier[i](earlier[i]).reshape(-1, self.unit_dim),)
            return self.mlp(ops.cat(parts + (h.reshape(-1, self.unit_dim),), -1))  # [N/4, L*4E] in
        for i in range(self.n_hier):  # sum: [N, E] per level, then grouped 2x2 once
            h = h + self.ln_hier[i](earlier[i])
        return self.mlp(h.reshape(-1, self.unit_dim))  # [N/4, 4E] in


class VisionTransformer(nn.Cell):
    """Packed patches of several images -> merged visual tokens [N/4, D_llm] in image order."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.unit = cfg.spatial_merge_size ** 2
        self.full = tuple(i in cfg.fullatt_block_indexes for i in range(cfg.depth))
        self.taps = tuple(i in cfg.hierarchical_layers[:-1] for i in range(cfg.depth))  # connector inputs
        self.patch_embed = VisionPatchEmbed(cfg)
        self.abs_pos = cfg.abs_pos_grid > 0
        if self.abs_pos:
            k = self.patch_embed.proj.in_channels  # C*T*P*P
            self.pos_embed = VisionAbsPosEmbed(cfg.abs_pos_grid, cfg.hidden_size, cfg.initializer_range * k ** 0.5)
        self.rotary_pos_emb = VisionRotaryEmbedding(cfg.head_dim)
        self.blocks = nn.CellList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)
        self.block_layout = VisionBlocks()
        self.fused = is_ascend()  # the attention's path (VisionAttention.fused)
        self.scale = cfg.head_dim ** -0.5  # the block path folds it into the queries' cos/sin

    def construct(self, pixel_values, vision_pos_ids, window_index, reverse_index, window_segment_ids,
                  full_segment_ids, window_gather=None, full_gather=None):
        x = self.patch_embed(pixel_values)  # [N, E] in image order
        n, e = x.shape
        x = ops.gather(x.reshape(-1, self.unit, e), window_index, 0).reshape(-1, e)  # window order
        if self.abs_pos:
            x = x + self.pos_embed(vision_pos_ids).astype(x.dtype)  # pos ids are given in window order
        cos, sin = self.rotary_pos_emb(vision_pos_ids)
        taps = ()  # outputs of the hierarchical connector's earlier blocks
        if window_gather is None:  # dense fallback: one [N, N] mask per attention kind
            win_bias = segment_bias(window_segment_ids[None], window_segment_ids[None], False)  # [1, 1, N, N]
            full_bias = segment_bias(full_segment_ids[None], full_segment_ids[None], False)
            for i, blk in enumerate(self.blocks):
                x = blk(x, cos, sin, full_bias if self.full[i] else win_bias)
                if self.taps[i]:
                    taps += (x,)
        else:
            win = (window_gather,) + self.block_layout(window_gather, window_segment_ids, n)
            full = (full_gather,) + self.block_layout(full_gather, full_segment_ids, n)
            if not self.fused:  # the CPU block path's layout of the RoPE tables
                cos, sin = self.blocks[0].attn.qkv_rope.tables(cos, sin, self.scale)
            for i, blk in enumerate(self.blocks):
                x = blk(x, cos, sin, None, full if self.full[i] else win)
                if self.taps[i]:
                    taps += (x,)
        x = self.merger(x, taps)  # [N/4, D]
        return ops.gather(x, reverse_index, 0)
