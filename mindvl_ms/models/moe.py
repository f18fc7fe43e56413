"""DeepSeek-V3 style language model for MindVL-MoE: MLA attention, first-k dense layers, then MoE layers.

    model = DeepseekV3Model(text_config)          # text_config.model_type == "deepseek_v3"
    hidden, aux_loss, expert_load = model(inputs_embeds, position_ids, segment_ids)
      inputs_embeds float32 [B, L, D], position_ids int32 [3, B, L] (M-RoPE), segment_ids int32 [B, L]
      -> hidden [B, L, D] (after the final norm), aux_loss scalar (seq_aux_loss_coef * sequence-wise
         balance loss, 0 when disabled), expert_load float32 [num_moe_layers, E] (routed token copies per
         expert this step, padding excluded; feed it to ExpertBiasUpdate for aux-loss-free balancing)
    lm = DeepseekV3ForCausalLM(text_config)       # text-only: logits, aux_loss, expert_load = lm(ids, pos, seg)

Parameter names follow HF `DeepseekV3ForCausalLM` (`model.layers.{i}.self_attn.q_a_proj.weight`,
`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`, `mlp.shared_experts.*`), except that the routed
experts of a layer are stacked for the grouped matmul: `mlp.experts.gate_proj` / `up_proj` [E, D, I] and
`down_proj` [E, I, D] (input-major, as GroupedMatmul takes them); `mindvl_ms.checkpoint.hf_deepseek`
maps them to and from HF's per-expert Linear weights. Multi-token-prediction layers live at `model.mtp.{k}`
(HF/DeepSeek store them as `model.layers.{num_hidden_layers + k}`).

Routed experts, by device:
- The cell itself: DeepSeek-V3's routing (moe_router.TopkRouter) and the experts of `RoutedExperts`, whose
  dispatch defaults to "grouped" on Ascend (TokenPermute -> GroupedMatmul -> TokenUnpermute, the fused
  kernels) and "sparse" on CPU: routed rows only, in an [E, C] capacity layout or, when an expert overflows
  C, expert-pure row blocks; static shapes either way, nothing dropped. "dense" (every expert on every
  token) is the reference the others are tested against; "grouped" runs on CPU through the kernels' CPU
  equivalents.
- Under a parallel layout, `mindvl_ms.parallel` binds the cell to MindFormers' MoE code with this cell's
  parameters (`parallel.parallelize.apply_ep`; `parallel.moe.use_mindformers` on one device): the router's
  `mindformers_select` (MindFormers' TopKRouter selection) and the experts' `parallel_experts` (its
  MoEAlltoAllTokenDispatcher with GroupedMatmul experts in one Morph, split by expert_parallel). The model
  holds the two slots (None by default) and no parallel code. MindFormers' group score is the sum of each
  group's top (k / topk_group) scores, DeepSeek-V3's the top 2: equal for DeepSeek-V3's own sizes (8 / 4)
  and the tiny config (2 / 1), different otherwise (tests/parallel/test_mindformers_moe.py shows both).
Semi-auto graphs cannot compile on CPU: on CPU only data parallel runs.

Multi-token prediction (num_nextn_predict_layers > 0, DeepSeek-V3 section 2.2): depth k combines
enorm(embedding of token i+k) and hnorm(depth k-1 hidden) with eh_proj, runs one decoder layer, then
shared_head.norm and the shared lm_head; `mtp_forward` returns those hidden states and `CausalLMLoss`
weights their loss by mtp_loss_scale. Depth 1 takes the main model's final (normed) hidden states.
Run the tests: pytest tests/models/test_moe_*.py
"""
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from mindvl_ms.ops import AddRMSNorm, RMSNorm, SwiGLU, is_ascend, segment_bias
from mindvl_ms.ops.moe import (Cumsum, GroupedMatmul, TokenPermute, TokenUnpermute, block_layout, capacity_layout,
                       expert_block_size, expert_capacity, expert_ranks, tokens_per_expert)
from mindvl_ms.ops.layers import Embedding, MRotaryEmbedding, dense
from mindvl_ms.ops.softmax import log_softmax
from mindvl_ms.models.mla import MLAttention
from mindvl_ms.models.moe_router import ExpertBiasUpdate, TopkRouter, expert_load, seq_aux_loss


class DeepseekV3MLP(nn.Cell):
    """SwiGLU FFN: down(silu(gate(x)) * up(x)); dense layers and shared experts."""

    def __init__(self, d: int, inter: int, std: float):
        super().__init__()
        self.gate_proj = dense(d, inter, std)
        self.up_proj = dense(d, inter, std)
        self.down_proj = dense(inter, d, std)
        self.swiglu = SwiGLU()

    def construct(self, x):
        return self.down_proj(self.swiglu(self.gate_proj(x), self.up_proj(x)))


class RoutedExperts(nn.Cell):
    """E SwiGLU experts with stacked weights: x [T, D], idx int32 [T, k], weights [T, k] -> [T, D].

    dispatch "grouped" (the Ascend path): TokenPermute -> GroupedMatmul (gate, up) -> SwiGLU -> GroupedMatmul
    (down) -> TokenUnpermute.
    dispatch "sparse" (the CPU default): routed rows only, static shapes, nothing dropped. Usually an [E, C]
    capacity layout (`capacity_layout`, C = mean + 4 sqrt(mean) rows per expert, `expert_capacity`): one
    batched matmul per projection over [E, C, D] with the expert weights used in place. When an expert got
    more than C copies, a graph branch takes the block layout instead (`block_layout`): rows in expert-pure
    blocks padded to the block size (static bound T*k + E*(block-1)), each block against its expert's
    weights gathered per block. Outputs are gathered back per copy and combined with the routing weights.
    dispatch "dense": every expert on every token as one wide matmul [T, D] x [D, E*I], the routing weights
    (scattered to [T, E]) folded into the activations, then one [T, E*I] x [E*I, D] matmul; E/k times the
    expert FLOPs, kept as the reference the sparse path is tested against.
    """

    DISPATCHES = ("grouped", "sparse", "dense")

    def __init__(self, e: int, d: int, inter: int, std: float, dispatch: str = None):
        super().__init__()
        self.gate_proj = Parameter(initializer(Normal(std), (e, d, inter), ms.float32), name="gate_proj")
        self.up_proj = Parameter(initializer(Normal(std), (e, d, inter), ms.float32), name="up_proj")
        self.down_proj = Parameter(initializer(Normal(std), (e, inter, d), ms.float32), name="down_proj")
        self.num_experts = e
        self.dispatch = dispatch or ("grouped" if is_ascend() else "sparse")
        if self.dispatch not in self.DISPATCHES:
            raise ValueError(f"expert dispatch '{self.dispatch}': expected one of {self.DISPATCHES}")
        self.permute = TokenPermute()
        self.unpermute = TokenUnpermute()
        self.gmm = GroupedMatmul()
        self.cumsum = Cumsum(0)
        self.swiglu = SwiGLU()
        # Set by mindvl_ms.parallel.moe.shard_moe under expert parallel: a cell taking
        # (x, idx, weights, gate_proj, up_proj, down_proj) that dispatches tokens across the EP group.
        self.parallel_experts = None

    def construct(self, x, idx, weights):
        if self.parallel_experts is not None:
            return self.parallel_experts(x, idx, weights, self.gate_proj, self.up_proj, self.down_proj)
        if self.dispatch == "sparse":
            return self.sparse(x, idx, weights)
        if self.dispatch == "dense":
            e, d, inter = self.gate_proj.shape
            w_gate = self.gate_proj.swapaxes(0, 1).reshape(d, e * inter)  # [D, E*I]: one wide matmul
            w_up = self.up_proj.swapaxes(0, 1).reshape(d, e * inter)
            h = self.swiglu(ops.matmul(x, w_gate), ops.matmul(x, w_up)).reshape(-1, e, inter)  # [T, E, I]
            onehot = ops.one_hot(idx, e, Tensor(1.0, x.dtype), Tensor(0.0, x.dtype))  # [T, k, E]
            combine = (onehot * weights.astype(x.dtype)[:, :, None]).sum(1)  # [T, E]
            h = (h * combine[:, :, None]).reshape(-1, e * inter)  # routing weight folded in before down_proj
            return ops.matmul(h, self.down_proj.reshape(e * inter, d))  # [T, D] = sum_e w_e * expert_e(x)
        permuted, order = self.permute(x, idx)  # [T*k, D]
        group_list = self.cumsum(tokens_per_expert(idx, self.num_experts).astype(ms.int64))  # [E]
        h = self.swiglu(self.gmm(permuted, self.gate_proj, group_list),
                        self.gmm(permuted, self.up_proj, group_list))  # [T*k, I]
        y = self.gmm(h, self.down_proj, group_list)  # [T*k, D]
        return self.unpermute(y, order, weights)

    @property
    def stand_alone(self) -> bool:
        """No parallel mode set (read when the graph compiles)."""
        return ms.get_auto_parallel_context("parallel_mode") == "stand_alone"

    def sparse(self, x, idx, weights):
        t, d = x.shape
        k = idx.shape[-1]
        _, rank, counts = expert_ranks(idx, self.num_experts)  # [M], [E]
        x_ext = ops.cat((x, ops.zeros((1, d), x.dtype)), 0)  # [T+1, D], row T feeds the empty slots
        # both branches return [M, D] (one row per routed copy), so the graph branches join.
        # Dynamic shapes have no static capacity, and data-parallel graphs (msrun) do not join the branches:
        # both take the block layout, which fits any routing.
        if ops.is_sequence_value_unknown(x.shape):
            out = self.block_rows(x_ext, idx, rank, counts)
        elif not self.stand_alone:
            out = self.block_rows(x_ext, idx, rank, counts)
        elif counts.max() <= expert_capacity(t * k, self.num_experts):  # usual case: [E, C], weights in place
            out = self.capacity_rows(x_ext, idx, rank)
        else:  # an expert got more than C copies: expert-pure row blocks, any routing fits
            out = self.block_rows(x_ext, idx, rank, counts)
        out = out.reshape(t, k, d)  # [T, k, D]
        return (out * weights.astype(x.dtype)[:, :, None]).sum(1)  # [T, D]

    def capacity_rows(self, x_ext, idx, rank):
        """Expert output of every routed copy [M, D], computed in the [E, C] layout."""
        e, d = self.num_experts, x_ext.shape[-1]
        cap = expert_capacity(idx.shape[0] * idx.shape[1], e)
        dest, slot_token = capacity_layout(idx, rank, e, cap)  # [M], [E*C]
        rows = ops.gather(x_ext, slot_token, 0).reshape(e, cap, d)  # [E, C, D]
        h = self.swiglu(ops.bmm(rows, self.gate_proj), ops.bmm(rows, self.up_proj))  # [E, C, I]
        y = ops.bmm(h, self.down_proj).reshape(e * cap, d)  # [E*C, D]
        return ops.gather(y, dest, 0)  # [M, D]

    def block_rows(self, x_ext, idx, rank, counts):
        """Expert output of every routed copy [M, D], computed in the block layout."""
        e, d = self.num_experts, x_ext.shape[-1]
        block = 16  # row count known only at run time (dynamic shapes)
        if not ops.is_sequence_value_unknown(idx.shape):
            block = expert_block_size(idx.shape[0] * idx.shape[1], e)
        dest, slot_token, block_expert = block_layout(idx, e, block, rank, counts)  # [M], [P], [NB]
        nb = block_expert.shape[0]
        rows = ops.gather(x_ext, slot_token, 0).reshape(nb, block, d)  # [NB, b, D]
        h = self.swiglu(ops.bmm(rows, ops.gather(self.gate_proj, block_expert, 0)),
                        ops.bmm(rows, ops.gather(self.up_proj, block_expert, 0)))  # [NB, b, I]
        y = ops.bmm(h, ops.gather(self.down_proj, block_expert, 0)).reshape(nb * block, d)  # [P, D]
        return ops.gather(y, dest, 0)  # [M, D]


class DeepseekV3MoE(nn.Cell):
    """Router + routed experts + shared experts: x [B, L, D] -> (y [B, L, D], load [E], aux scalar)."""

    def __init__(self, cfg, expert_dispatch: str = None):
        super().__init__()
        m = cfg.moe
        std = cfg.initializer_range
        d = cfg.hidden_size
        self.num_experts = m.n_routed_experts
        self.top_k = m.num_experts_per_tok
        self.use_aux = m.seq_aux_loss_coef > 0
        self.gate = TopkRouter(d, m, std)
        self.experts = RoutedExperts(m.n_routed_experts, d, m.moe_intermediate_size, std, expert_dispatch)
        self.has_shared = m.n_shared_experts > 0
        if self.has_shared:
            self.shared_experts = DeepseekV3MLP(d, m.moe_intermediate_size * m.n_shared_experts, std)

    def construct(self, x, valid):
        b, l, d = x.shape
        flat = x.reshape(b * l, d)  # [T, D]
        idx, weights, scores = self.gate(flat)  # [T, k], [T, k], [T, E]
        y = self.experts(flat, idx, weights).astype(x.dtype).reshape(b, l, d)
        if self.has_shared:
            y = y + self.shared_experts(x)
        aux = seq_aux_loss(scores, idx, valid, b, self.top_k) if self.use_aux else ops.zeros((), ms.float32)
        return y, expert_load(idx, self.num_experts, valid), aux


class DeepseekV3DecoderLayer(nn.Cell):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); returns (x, load [E], aux)."""

    def __init__(self, cfg, layer_idx: int, expert_dispatch: str = None):
        super().__init__()
        self.self_attn = MLAttention(cfg)
        self.is_moe = layer_idx >= cfg.moe.first_k_dense_replace
        if self.is_moe:
            self.mlp = DeepseekV3MoE(cfg, expert_dispatch)
        else:
            self.mlp = DeepseekV3MLP(cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = AddRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # + the attention residual
        self.num_experts = cfg.moe.n_routed_experts
        self.add = ops.Add()  # the MLP residual add

    def construct(self, x, cos, sin, bias, valid, actual_seq_len=None):
        h, x = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, bias, actual_seq_len), x)
        if self.is_moe:
            h, load, aux = self.mlp(h, valid)
        else:
            h = self.mlp(h)
            load, aux = ops.zeros((self.num_experts,), ms.float32), ops.zeros((), ms.float32)
        return self.add(x, h), load, aux


class MTPLayer(DeepseekV3DecoderLayer):
    """One multi-token-prediction depth: eh_proj([enorm(emb), hnorm(h)]) -> decoder layer -> shared_head.norm."""

    def __init__(self, cfg, layer_idx: int, expert_dispatch: str = None):
        super().__init__(cfg, layer_idx, expert_dispatch)
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = dense(2 * d, d, cfg.initializer_range)
        self.shared_head = nn.Cell()
        self.shared_head.norm = RMSNorm(d, cfg.rms_norm_eps)

    def step(self, h, emb, cos, sin, bias, valid):
        x = self.eh_proj(ops.cat((self.enorm(emb), self.hnorm(h)), -1))
        x, _, aux = self.construct(x, cos, sin, bias, valid)
        return x, self.shared_head.norm(x), aux


class DeepseekV3Model(nn.Cell):
    """Decoder stack; see the module docstring for the construct contract."""

    def __init__(self, cfg, expert_dispatch: str = None):
        super().__init__()
        if cfg.model_type != "deepseek_v3":
            raise ValueError(f"DeepseekV3Model needs text.model_type 'deepseek_v3', got '{cfg.model_type}'")
        m = cfg.moe
        if m.first_k_dense_replace >= cfg.num_hidden_layers:
            raise ValueError(f"moe.first_k_dense_replace {m.first_k_dense_replace} leaves no MoE layer in "
                             f"{cfg.num_hidden_layers} layers; use a dense model_type instead")
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.initializer_range)
        self.layers = nn.CellList([DeepseekV3DecoderLayer(cfg, i, expert_dispatch)
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(m.qk_rope_head_dim, cfg.rope_theta, cfg.mrope_section,
                                           cfg.mrope_layout)
        n = cfg.num_hidden_layers
        self.mtp = nn.CellList([MTPLayer(cfg, n + k, expert_dispatch) for k in range(m.num_nextn_predict_layers)])
        self.aux_coef = float(m.seq_aux_loss_coef)

    def routers(self):
        """The TopkRouter of each MoE layer in order (rows of expert_load)."""
        return [layer.mlp.gate for layer in self.layers if layer.is_moe]

    def bias_updater(self) -> ExpertBiasUpdate:
        return ExpertBiasUpdate(self.routers(), self.config.moe.bias_update_speed)

    def construct(self, inputs_embeds, position_ids, segment_ids, actual_seq_len=None):
        bias = segment_bias(segment_ids, segment_ids, True)  # [B, 1, L, L]
        cos, sin = self.rotary_emb(position_ids)  # [B, 1, L, rope]
        valid = (segment_ids > 0).astype(ms.float32).reshape(-1)  # [B*L]
        x = inputs_embeds
        loads = []
        aux = ops.zeros((), ms.float32)
        for layer in self.layers:
            x, load, layer_aux = layer(x, cos, sin, bias, valid, actual_seq_len)
            if layer.is_moe:
                loads.append(load)
                aux = aux + layer_aux
        return self.norm(x), aux * self.aux_coef, ops.stack(loads)

    def mtp_forward(self, hidden, inputs_embeds, position_ids, segment_ids):
        """Normed hidden states of each MTP depth k (predicting token i+k+1 at position i), and their aux."""
        bias = segment_bias(segment_ids, segment_ids, True)
        cos, sin = self.rotary_emb(position_ids)
        valid = (segment_ids > 0).astype(ms.float32).reshape(-1)
        outs = []
        aux = ops.zeros((), ms.float32)
        h = hidden
        for k, layer in enumerate(self.mtp):
            emb = shift_left(inputs_embeds, k + 1)  # embedding of token i + k + 1
            h, normed, layer_aux = layer.step(h, emb, cos, sin, bias, valid)
            outs.append(normed)
            aux = aux + layer_aux
        return outs, aux * self.aux_coef


def shift_left(x, k: int):
    """x [B, L, ...] -> x[:, k:] padded with zeros at the end (same shape)."""
    pad = ops.zeros_like(x[:, :k])
    return ops.cat((x[:, k:], pad), 1)


def mtp_targets(targets, segment_ids, k: int):
    """Depth-k MTP labels: targets[:, i + k] where position i + k is in the same segment, else -100."""
    same = shift_left(segment_ids, k) == segment_ids
    return ops.where(same, shift_left(targets + 100, k) - 100, ops.full_like(targets, -100))


class DeepseekV3ForCausalLM(nn.Cell):
    """Text-only DeepSeek-V3: (input_ids, position_ids [3, B, L], segment_ids) -> (logits, aux, expert_load)."""

    def __init__(self, cfg, expert_dispatch: str = None):
        super().__init__()
        self.model = DeepseekV3Model(cfg, expert_dispatch)
        self.lm_head = dense(cfg.hidden_size, cfg.vocab_size, cfg.initializer_range)

    def construct(self, input_ids, position_ids, segment_ids):
        hidden, aux, load = self.model(self.model.embed_tokens(input_ids), position_ids, segment_ids)
        return self.lm_head(hidden), aux, load


def masked_ce(logits, targets):
    """Mean cross entropy over targets != -100: logits [B, L, V], targets int32 [B, L]."""
    v = logits.shape[-1]
    mask = (targets >= 0).astype(ms.float32).reshape(-1)
    safe = ops.maximum(targets, 0).reshape(-1)
    logp = log_softmax(logits.reshape(-1, v).astype(ms.float32), -1)
    nll = -ops.gather_elements(logp, 1, safe[:, None])[:, 0]
    return (nll * mask).sum() / ops.maximum(mask.sum(), 1.0)


class CausalLMLoss(nn.Cell):
    """Training loss of DeepseekV3ForCausalLM: CE + aux + mtp_loss_scale * mean MTP CE; returns (loss, load).

    targets int32 [B, L] are next-token labels (-100 = none); the depth-k MTP target at position i is
    targets[i + k] when it belongs to the same segment.
    """

    def __init__(self, lm: DeepseekV3ForCausalLM):
        super().__init__()
        self.lm = lm
        self.num_mtp = lm.model.config.moe.num_nextn_predict_layers
        self.mtp_scale = float(lm.model.config.moe.mtp_loss_scale)

    def construct(self, input_ids, position_ids, segment_ids, targets):
        model = self.lm.model
        embeds = model.embed_tokens(input_ids)
        hidden, aux, load = model(embeds, position_ids, segment_ids)
        loss = masked_ce(self.lm.lm_head(hidden), targets) + aux
        if self.num_mtp > 0:
            outs, mtp_aux = model.mtp_forward(hidden, embeds, position_ids, segment_ids)
            mtp = ops.zeros((), ms.float32)
            for k, h in enumerate(outs):
                mtp = mtp + masked_ce(self.lm.lm_head(h), mtp_targets(targets, segment_ids, k + 1))
            loss = loss + self.mtp_scale * mtp / self.num_mtp + mtp_aux
        return loss, load
