"""Per-device memory and per-step communication of a parallel layout: `mindvl plan --config RUN.yaml`.

The plan is arithmetic on the run config (no MindSpore import, no cell built); `tests/parallel/test_plan.py`
checks its parameter counts against the real cells and its activation formulas against the paper they come
from. Sizes come from `mindvl_ms.parallel.layout.Layout`; `t` = tensor parallel (model_parallel), `ep` =
expert parallel, `p` = pipeline stages, `dp` = data parallel, a stage holds `dp * t` devices.

Parameters, gradients, optimizer states (bytes per element; training runs AMP O2: fp32 master weights,
bf16 compute; Adam m and v in fp32; gradients added into fp32 accumulators):
- a parameter group of E elements split over `split` devices of a stage (t for column/row-parallel weights,
  ep for routed experts, 1 for replicated ones) has e = E / split elements per device and N = stage
  devices / split identical copies (dp for tensor-parallel weights, dp*t for replicated ones, dp*t/ep for
  experts: the copies MindSpore's optimizer parallel can shard over);
- frozen: weights 4e. Trainable without the parallel optimizer: weights 4e, gradients 4e (accumulator) +
  4e (the backward's output before it is added in), optimizer 8e;
- with `parallel.enable_parallel_optimizer`: weights 4e/N + 2e (the all-gathered bf16 copy the layer
  computes with), gradients 4e/N + 4e, optimizer 8e/N.

Activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4; 2-byte activations, 1-byte dropout masks; s sequence, b micro-batch, h hidden,
a heads). The paper's Table 2 is `korthikanti_layer_bytes`:
  no parallelism      sbh (34 + 5as/h)
  tensor parallel     sbh (10 + 24/t + 5as/(ht))
  TP + sequence par.  sbh/t (34 + 5as/h)
  TP + selective rc.  sbh (10 + 24/t)
  TP + SP + selective 34 sbh/t
  full recompute      2 sbh  (the layer input only; 2sbh/t under sequence parallel)
`layer_activation_terms` is the same bookkeeping for the layers this project trains; it reduces to the
table for a GPT layer (tested):
- outside the tensor-parallel regions (divided by t only under sequence parallel): the two norm inputs
  4sbh, the attention and MLP inputs 2sbh + 2sbh, dropout masks 2sbh (none here), MLA's replicated
  latents 2sb(2 q_lora + kv_lora + rope + kv_lora);
- inside (divided by t): Q and K 2sb(q + k), V 2sb v, the out-projection input 2sb v, QK-norm inputs
  2sb(q + k); MLP plain 4sbf (activation input and output), gated SwiGLU 6sbf ([gate|up] and the output);
- the attention core (divided by t): softmax 2as^2b (+ 3as^2b with dropout), or with FlashAttentionScore
  only its softmax_max and softmax_sum, [B, N, S, 8] fp32 each = 64asb; selective recompute drops the
  s^2 terms;
- MoE layers (tokens per device n = sb/t: the sequence is split over the TP group before dispatch, which
  MindFormers' MoE with TP requires): router scores 4nE (fp32), permuted tokens and expert outputs
  2nkh + 2nkh, expert SwiGLU 6nkf_e (balanced routing assumed), shared experts 6sb f_s / t;
- full recompute keeps 2sbh (/t with SP) per layer and in-flight micro-batch, plus one layer's complete
  activations (the layer being recomputed).
Pipeline: stage i holds layers `layers // p + offset[i]`; embedding, ViT and projector on stage 0; final norm,
lm_head and MTP on the last. Under 1F1B, stage i holds min(p - i, n) micro-batches in flight, n = the
stage's micro-batches per rank (global_batch_size / (dp x micro_batch_size)).
ViT (stage 0): the same terms with the ViT shapes over P = b * visual budget * merge^2 patches (the budget is
data.max_image_tokens, or seq_length when 0); with `parallel_config.vision_parallel: dp` each rank of a TP
group encodes its share of the images with whole weights, padded to `data.collate.share_budget`'s Pd
patches (ceil(P / t) + the largest item, at most P), with `tp` the ViT's linears are split by t. A frozen ViT (projector warm-up) keeps nothing for
backward: one block's activations at a time. Logits (last stage): the LM head runs in chunks of
each stage's `loss.logits_chunk_tokens` supervised tokens (train/loss_head.py): fp32 logits plus fp32 log-softmax, 8 * chunk * V / t bytes (V / t when the head is
vocab-parallel: `vocab_emb_dp: false`).

Communication per optimizer step and device (m = micro-batches per rank per step, x = 2sbh bytes):
- TP: per layer and micro-batch two all-reduces forward and two backward (two more forward with full
  recompute), each 2(t-1)/t x; under sequence parallel the same volume as all-gather + reduce-scatter;
- EP all-to-all: per MoE layer and micro-batch dispatch + combine forward and backward (again forward
  with full recompute), each 2nkh (ep-1)/ep;
- PP send/recv: per micro-batch the stage's output forward and the input gradient backward, 2sbh bytes
  (/t with SP) each;
- DP gradient reduce: once per step, 2(N-1)/N of the fp32 trainable gradients (a ring all-reduce, or the
  reduce-scatter + all-gather of the parallel optimizer).

Host memory per process (`host_plan`; one process drives one device), what it counts:
- accumulators and Adam moments: host bytes only where the device is the host (`context.device_target`
  CPU): the fp32 accumulator 4e (4e/N with the parallel optimizer) and m, v 8e (8e/N) of the process's
  trainable share. On Ascend they are clones of the parameters (train/optim.py), allocated in device
  memory, so 0 here (they are in the per-device table's gradients and optimizer states);
- pinned data: the input arrays of one optimizer step, which the trainer holds on the host from the
  loader until the step ends: m micro-batches of b rows, each row `TOKEN_INT32` int32 arrays of
  seq_length (input_ids, the 3 M-RoPE position rows, segment_ids, targets, token_index) and the
  visual budget padded in patches (budget x merge^2 per row): fp32 pixel values (in_channels x
  temporal_patch_size x patch_size^2 each) and `PATCH_INT32` int32 index arrays (vision_pos_ids 2,
  window_index, reverse_index, window_segment_ids, full_segment_ids); under semi/auto parallel twice, the
  micro-batches plus the one feed the one-graph step joins them into (train/mf_step.py). An upper bound: rows are padded
  to the visual budget only as far as the batch needs. Not counted: the loader's workers and prefetch
  queue, the Python and MindSpore runtime, the transient host copy of one feed while it is sent.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from mindvl_ms.config.base import ConfigError
from mindvl_ms.data.collate import share_budget
from mindvl_ms.parallel.layout import Layout

GB = 2 ** 30  # MindSpore's max_device_memory "58GB" means 58 * 2**30 bytes
TOKEN_INT32 = 7  # int32 arrays per token of a micro-batch: input_ids, position_ids x 3, segment_ids, targets, token_index
PATCH_INT32 = 6  # int32 arrays per patch: vision_pos_ids x 2, window/reverse index, window/full segment ids


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """The paper's Table 2: activation bytes per transformer layer (recompute: none, selective, full)."""
    if recompute == "full":
        return 2.0 * s * b * h
    core = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if sp:
        return s * b * h / t * (34.0 + core)
    return s * b * h * (10.0 + 24.0 / t + core / t)


@dataclass(frozen=True)
class LayerShape:
    """What a transformer layer stores, in widths (see the module docstring)."""

    h: int                 # layer input / output width
    heads: int             # attention heads
    q: int                 # query width entering Q.K^T
    k: int                 # key width
    v: int                 # value width (= out-projection input)
    ffn: int = 0           # dense FFN width (0 in MoE layers)
    gated: bool = True     # SwiGLU (gate|up) or plain fc1 -> act -> fc2
    flash: bool = True     # FlashAttentionScore (no s^2 terms)
    dropout: bool = False  # attention / residual dropout (the paper's GPT)
    qk_norm: bool = False  # Qwen3 RMSNorm on q and k heads
    latent: int = 0        # MLA's replicated low-rank widths stored (2 q_lora + kv_lora + rope + kv_lora)
    experts: int = 0       # routed experts (0: dense layer)
    topk: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0


def layer_activation_terms(x: LayerShape, s: int, b: int, t: int = 1, sp: bool = False,
                           recompute: str = "none") -> Dict[str, float]:
    """Bytes one layer stores for backward, by part: outside TP, inside TP, attention core, MoE."""
    if recompute == "full":
        return {"layer input": 2.0 * s * b * x.h / (t if sp else 1)}
    sb = float(s) * b
    outside = sb * (4 * x.h + 2 * x.h + 2 * x.h + (2 * x.h if x.dropout else 0) + 2 * x.latent)
    inside = sb * (2 * (x.q + x.k) + 2 * x.v + 2 * x.v + (2 * (x.q + x.k) if x.qk_norm else 0))
    inside += sb * x.ffn * (6 if x.gated else 4)
    if x.flash:
        core = 64.0 * x.heads * sb
    elif recompute == "selective":
        core = 0.0
    else:
        core = sb * x.heads * s * (5 if x.dropout else 2)
    out = {"outside TP": outside / (t if sp else 1), "inside TP": inside / t, "attention core": core / t}
    if x.experts:
        n = sb / t
        out["MoE"] = n * (4 * x.experts + 4 * x.topk * x.h + 6 * x.topk * x.expert_ffn) + 6 * sb * x.shared_ffn / t
    return out


def llm_layer_shape(text, moe_layer: bool) -> LayerShape:
    if text.model_type == "deepseek_v3":
        m = text.moe
        a = text.num_attention_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        latent = 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + m.qk_rope_head_dim
        if moe_layer:
            kw = dict(experts=m.n_routed_experts, topk=m.num_experts_per_tok, expert_ffn=m.moe_intermediate_size,
                      shared_ffn=m.moe_intermediate_size * m.n_shared_experts)
        else:
            kw = dict(ffn=text.intermediate_size)
        return LayerShape(h=text.hidden_size, heads=a, q=a * qk, k=a * qk, v=a * m.v_head_dim, latent=latent, **kw)
    hd = text.head_dim_
    return LayerShape(h=text.hidden_size, heads=text.num_attention_heads, q=text.num_attention_heads * hd,
                      k=text.num_key_value_heads * hd, v=text.num_key_value_heads * hd, ffn=text.intermediate_size,
                      qk_norm=text.use_qk_norm)


def vit_layer_shape(vision) -> LayerShape:
    h = vision.hidden_size
    return LayerShape(h=h, heads=vision.num_heads, q=h, k=h, v=h, ffn=vision.intermediate_size,
                      gated=vision.mlp_type == "gated")


# ------------------------------------------------------------------------------------------------
# parameters


@dataclass
class ParamGroup:
    """Elements of one component, how a stage splits them, and where they live."""

    name: str      # component shown in the table
    prefix: str    # a parameter-name prefix of the group (decides trainability per training stage)
    count: int     # elements in the model
    split: int     # distinct slices across one stage's devices (t, ep or 1)
    place: str     # "first", "last" or "layer"
    layer: int = -1


def _vision_groups(v, t: int, vit_parallel: str) -> List[ParamGroup]:
    h, f = v.hidden_size, v.intermediate_size
    mlp = (2 * (h * f + f) + f * h + h) if v.mlp_type == "gated" else (h * f + f + f * h + h)
    lin = 3 * h * h + 3 * h + h * h + h + mlp
    vt = t if vit_parallel == "tp" else 1
    patch = v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * h + 2 * v.abs_pos_grid * h
    u = h * v.spatial_merge_size ** 2
    levels = max(len(v.hierarchical_layers), 1)  # the hierarchical connector: one norm per level,
    inputs = levels * u if v.hierarchical_fusion == "concat" else u  # L*4E inputs when concatenated, else 4E
    return [ParamGroup("vision", "visual.blocks.", v.depth * lin, vt, "first"),
            ParamGroup("vision", "visual.blocks.", v.depth * 2 * h + patch, 1, "first"),
            ParamGroup("projector", "visual.merger.",
                       levels * h + inputs * u + u + u * v.out_hidden_size + v.out_hidden_size, 1, "first")]


def _dense_layer(text, t: int):
    hd, d = text.head_dim_, text.hidden_size
    q, kv = text.num_attention_heads * hd, text.num_key_value_heads * hd
    split = d * q + 2 * d * kv + q * d + 3 * d * text.intermediate_size
    if text.attention_bias:
        split += q + 2 * kv
    rep = 2 * d + (2 * hd if text.use_qk_norm else 0)
    return split, rep


def _mla_layer(text, moe_layer: bool):
    """(tensor-parallel, replicated, routed-expert) elements of one DeepSeek-V3 layer."""
    m, d, a = text.moe, text.hidden_size, text.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    rep = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + 2 * d
    split = m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim) + a * m.v_head_dim * d
    if m.q_lora_rank is None:
        split += d * a * qk
    else:
        rep += d * m.q_lora_rank + m.q_lora_rank
        split += m.q_lora_rank * a * qk
    if text.attention_bias:
        rep += (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim + d
    if not moe_layer:
        return split + 3 * d * text.intermediate_size, rep, 0
    rep += m.n_routed_experts * d + m.n_routed_experts  # router weight + correction bias
    split += 3 * d * m.moe_intermediate_size * m.n_shared_experts
    return split, rep, 3 * d * m.moe_intermediate_size * m.n_routed_experts


def param_groups(model, layout: Layout, vit_parallel: str = "dp") -> List[ParamGroup]:
    """Every parameter of the MindVL model as groups with their split over one stage's devices."""
    text, t = model.text, layout.tp
    vocab_split = t if (not layout.vocab_emb_dp and text.vocab_size % t == 0) else 1
    d = text.hidden_size
    groups = _vision_groups(model.vision, t, vit_parallel)
    groups.append(ParamGroup("embedding", "model.embed_tokens.", text.vocab_size * d, vocab_split, "first"))
    if not text.tie_word_embeddings:
        groups.append(ParamGroup("lm_head", "lm_head.", text.vocab_size * d, vocab_split, "last"))
    groups.append(ParamGroup("final norm", "model.norm.", d, 1, "last"))
    moe = text.model_type == "deepseek_v3"
    for i in range(text.num_hidden_layers):
        if moe:
            split, rep, routed = _mla_layer(text, i >= text.moe.first_k_dense_replace)
            if routed:
                groups.append(ParamGroup("routed experts", f"model.layers.{i}.", routed, layout.ep, "layer", i))
        else:
            (split, rep), routed = _dense_layer(text, t), 0
        groups.append(ParamGroup("decoder layers", f"model.layers.{i}.", split, t, "layer", i))
        groups.append(ParamGroup("decoder layers", f"model.layers.{i}.", rep, 1, "layer", i))
    if moe and text.moe.num_nextn_predict_layers:
        for k in range(text.moe.num_nextn_predict_layers):
            split, rep, routed = _mla_layer(text, True)
            groups += [ParamGroup("MTP", f"model.mtp.{k}.", split, t, "last"),
                       ParamGroup("MTP", f"model.mtp.{k}.", rep + 2 * d * d + 3 * d, 1, "last"),
                       ParamGroup("MTP", f"model.mtp.{k}.", routed, layout.ep, "last")]
    return groups


def stage_layers(num_layers: int, pp: int, offset: List[int]) -> List[range]:
    """Decoder layers of each pipeline stage (MindFormers `offset`: stage i has layers // pp + offset[i])."""
    per = [num_layers // pp + (offset[i] if offset else 0) for i in range(pp)]
    if sum(per) != num_layers or min(per) < 1:
        raise ConfigError(f"pipeline: {num_layers} layers over {pp} stages with offset {offset} gives {per}")
    starts = [sum(per[:i]) for i in range(pp)]
    return [range(a, a + n) for a, n in zip(starts, per)]


# ------------------------------------------------------------------------------------------------
# the plan


@dataclass
class DevicePlan:
    """One device of one pipeline stage for one training stage: bytes by component and comm by kind."""

    training_stage: str
    pp: int
    ranks: range
    memory: Dict[str, float] = field(default_factory=dict)   # component -> bytes
    comm: Dict[str, float] = field(default_factory=dict)     # kind -> bytes per step
    detail: Dict[str, float] = field(default_factory=dict)   # parameter bytes by group name

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    def largest(self) -> str:
        """The biggest single contributor, naming the parameter group for weights/gradients/optimizer."""
        name, val = max(self.memory.items(), key=lambda kv: kv[1])
        if name in ("weights", "gradients", "optimizer states") and self.detail:
            g, gv = max(self.detail.items(), key=lambda kv: kv[1])
            return f"{name} {val / GB:.1f} GB (most from {g}: {gv / GB:.1f} GB of parameter state)"
        return f"{name} {val / GB:.1f} GB"


def parse_memory(text: str) -> Optional[float]:
    """'58GB' / '58 GB' / '1024MB' -> bytes (powers of 1024, as MindSpore reads them); '' -> None."""
    if not text:
        return None
    m = re.fullmatch(r"\s*([0-9.]+)\s*([GM])B?\s*", text, re.I)
    if not m:
        raise ConfigError(f"context.max_device_memory '{text}': expected e.g. '58GB'")
    return float(m.group(1)) * (GB if m.group(2).upper() == "G" else 2 ** 20)


def recompute_mode(run_cfg) -> str:
    r = run_cfg.recompute_config
    return "full" if r.recompute else ("selective" if r.select_recompute else "none")


def _parameter_memory(dev: DevicePlan, groups: List[ParamGroup], layout: Layout, prefixes: List[str],
                      po: bool) -> float:
    """Fill weights / gradients / optimizer states of `dev`; returns the DP gradient-reduce bytes."""
    w = gr = opt = dp_bytes = 0.0
    for g in groups:
        e, copies = g.count / g.split, layout.stage_size / g.split
        train = any(g.prefix.startswith(x) for x in prefixes)
        n = copies if (po and train) else 1
        gw = 4 * e / n + (2 * e if n > 1 else 0)
        gg = (4 * e / n + 4 * e) if train else 0.0
        go = 8 * e / n if train else 0.0
        w, gr, opt = w + gw, gr + gg, opt + go
        dev.detail[g.name] = dev.detail.get(g.name, 0.0) + gw + gg + go
        if train:
            dp_bytes += 2 * (copies - 1) / copies * 4 * e
    dev.memory.update({"weights": w, "gradients": gr, "optimizer states": opt})
    return dp_bytes


def _stack_activations(shapes: List[LayerShape], s: int, b: int, t: int, sp: bool, rc: str, inflight: int) -> float:
    """Stored activations of a stack of layers for `inflight` micro-batches (+ one recomputed layer)."""
    act = sum(sum(layer_activation_terms(x, s, b, t, sp, rc).values()) for x in shapes) * inflight
    if rc == "full":
        act += max(sum(layer_activation_terms(x, s, b, t, sp, "none").values()) for x in shapes)
    return act


def plan_run(run_cfg) -> List[DevicePlan]:
    """A DevicePlan per (training stage, pipeline stage). The ViT layout is `parallel_config.vision_parallel`:
    `tp` splits its linears over the TP group; `dp` keeps them whole, and each rank of a TP group encodes its
    share of the micro-batch's images (parallel/vit_balance.py), sized by `data.collate.share_budget`."""
    vit_parallel = run_cfg.parallel_config.vision_parallel
    layout = Layout.from_run_config(run_cfg)
    model, text = run_cfg.model, run_cfg.model.text
    t, pp, ep = layout.tp, layout.pp, layout.ep
    rc = recompute_mode(run_cfg)
    sp = layout.seq_parallel and t > 1
    layers = stage_layers(text.num_hidden_layers, pp, run_cfg.parallel_config.offset)
    groups = param_groups(model, layout, vit_parallel)
    is_moe = [text.model_type == "deepseek_v3" and i >= text.moe.first_k_dense_replace
              for i in range(text.num_hidden_layers)]
    head_split = t if (not layout.vocab_emb_dp and text.vocab_size % t == 0) else 1
    plans = []
    for st in run_cfg.stages:
        s, b, m = st.seq_length, st.micro_batch_size, st.accumulation(layout.dp)
        image_tokens = dict(st.data).get("max_image_tokens", run_cfg.data.max_image_tokens) or s  # 0: seq_length
        for p in range(pp):
            dev = DevicePlan(st.name, p, range(p * layout.stage_size, (p + 1) * layout.stage_size))
            mine = [g for g in groups if (g.place == "layer" and g.layer in layers[p]) or
                    (g.place == "first" and p == 0) or (g.place == "last" and p == pp - 1)]
            dp_bytes = _parameter_memory(dev, mine, layout, st.trainable_prefixes(),
                                         run_cfg.parallel.enable_parallel_optimizer)
            inflight = min(pp - p, m) if pp > 1 else 1
            shapes = [llm_layer_shape(text, is_moe[i]) for i in layers[p]]
            dev.memory["activations"] = _stack_activations(shapes, s, b, t, sp, rc, inflight)
            if p == 0:
                patches = b * image_tokens * model.vision.spatial_merge_size ** 2
                if run_cfg.parallel_config.vision_ranks > 1:  # this rank's share of its TP group's images
                    patches = share_budget(model, run_cfg.stage_data(st), t).patches
                vs, vt = (patches, 1) if vit_parallel == "dp" else (patches, t)
                vshape = vit_layer_shape(model.vision)
                if any("visual.blocks.".startswith(x) for x in st.trainable_prefixes()):
                    dev.memory["ViT activations"] = _stack_activations(
                        [vshape] * model.vision.depth, vs, 1, vt, False, rc, inflight)
                else:  # frozen ViT: nothing kept for backward, one block's forward at a time
                    dev.memory["ViT activations"] = sum(layer_activation_terms(vshape, vs, 1, vt, False).values())
            if p == pp - 1:
                chunk = st.loss.logits_chunk_tokens
                dev.memory["logits chunk"] = 8.0 * min(chunk, s * b) * text.vocab_size / head_split
            x = 2.0 * s * b * text.hidden_size  # one full-sequence activation, bytes
            passes = 3 if rc == "full" else 2  # forward, backward (+ the recomputed forward)
            if t > 1:
                kind = "TP all-gather/reduce-scatter" if sp else "TP all-reduce"
                dev.comm[kind] = len(layers[p]) * m * passes * 2 * 2 * (t - 1) / t * x
            n_moe = sum(is_moe[i] for i in layers[p])
            if ep > 1 and n_moe:
                routed = 2.0 * s * b / t * text.moe.num_experts_per_tok * text.hidden_size
                dev.comm["EP all-to-all"] = n_moe * m * passes * 2 * routed * (ep - 1) / ep
            if pp > 1:
                dev.comm["PP send/recv"] = m * (x / (t if sp else 1)) * ((p < pp - 1) + (p > 0))
            if layout.stage_size > 1:
                dev.comm["DP gradient reduce"] = dp_bytes
            plans.append(dev)
    return plans


@dataclass
class HostPlan:
    """Host memory of one process (one device) of one pipeline stage for one training stage, in bytes."""

    training_stage: str
    pp: int
    memory: Dict[str, float] = field(default_factory=dict)  # accumulators, moments, pinned data

    @property
    def total(self) -> float:
        return sum(self.memory.values())


def micro_batch_bytes(model, seq_length: int, rows: int, image_tokens: int) -> float:
    """Host bytes of one collated micro-batch at the visual budget (see the module docstring)."""
    v = model.vision
    patches = rows * image_tokens * v.spatial_merge_size ** 2
    width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    return 4.0 * (TOKEN_INT32 * rows * seq_length + patches * (width + PATCH_INT32))


def host_plan(run_cfg) -> List[HostPlan]:
    """A HostPlan per (training stage, pipeline stage): what one process holds in host memory."""
    layout = Layout.from_run_config(run_cfg)
    model, text, pp = run_cfg.model, run_cfg.model.text, layout.pp
    on_host = run_cfg.context.device_target == "CPU"
    po = run_cfg.parallel.enable_parallel_optimizer
    joined = run_cfg.parallel.parallel_mode in (1, 2)  # semi/auto: the step also holds the joined feed
    layers = stage_layers(text.num_hidden_layers, pp, run_cfg.parallel_config.offset)
    groups = param_groups(model, layout, run_cfg.parallel_config.vision_parallel)
    out = []
    for st in run_cfg.stages:
        m = st.accumulation(layout.dp)
        image_tokens = dict(st.data).get("max_image_tokens", run_cfg.data.max_image_tokens) or st.seq_length
        pinned = m * micro_batch_bytes(model, st.seq_length, st.micro_batch_size, image_tokens) * (2 if joined else 1)
        prefixes = st.trainable_prefixes()
        for p in range(pp):
            acc = mom = 0.0
            for g in groups:
                mine = (g.place == "layer" and g.layer in layers[p]) or (g.place == "first" and p == 0) or \
                    (g.place == "last" and p == pp - 1)
                if on_host and mine and any(g.prefix.startswith(x) for x in prefixes):
                    e = g.count / g.split
                    n = layout.stage_size / g.split if po else 1
                    acc, mom = acc + 4 * e / n, mom + 8 * e / n
            out.append(HostPlan(st.name, p, {"accumulators": acc, "moments": mom, "pinned data": pinned}))
    return out


def format_host_plan(run_cfg, hosts: List[HostPlan]) -> str:
    """The host-memory table of `mindvl plan`."""
    where = ("host (device_target CPU)" if run_cfg.context.device_target == "CPU" else
             "device memory (parameter clones), not host")
    rows = [[h.training_stage, str(h.pp)] + [f"{h.memory[k] / GB:.2f}" for k in ("accumulators", "moments",
                                                                                   "pinned data")]
            + [f"{h.total / GB:.2f}"] for h in hosts]
    return "\n".join([f"host memory per process (GB): accumulators and moments in {where}; pinned data = one "
                      f"step's input arrays at the visual budget",
                      _table(["stage", "pp", "accum", "moments", "pinned data", "total GB"], rows)])


def format_plan(run_cfg, plans: List[DevicePlan], limit: Optional[float]) -> str:
    lay = Layout.from_run_config(run_cfg)
    comps = ["weights", "gradients", "optimizer states", "activations", "ViT activations", "logits chunk"]
    kinds = ["TP all-reduce", "TP all-gather/reduce-scatter", "EP all-to-all", "PP send/recv", "DP gradient reduce"]
    kinds = [k for k in kinds if any(k in d.comm for d in plans)]
    head = (f"layout: dp {lay.dp} x tp {lay.tp} x pp {lay.pp} = {lay.world} devices, ep {lay.ep}, "
            f"sequence parallel {lay.seq_parallel}, parallel optimizer {run_cfg.parallel.enable_parallel_optimizer}, "
            f"recompute {recompute_mode(run_cfg)}, limit {'none' if limit is None else f'{limit / GB:.1f} GB'}")
    short = {"optimizer states": "optim", "ViT activations": "ViT act", "logits chunk": "logits",
             "activations": "activ", "gradients": "grads"}
    cols = ["stage", "pp", "ranks"] + [short.get(c, c) for c in comps] + ["total GB", "fits"]
    rows = []
    for d in plans:
        fits = "-" if limit is None else ("yes" if d.total <= limit else "NO")
        rows.append([d.training_stage, str(d.pp), f"{d.ranks.start}-{d.ranks.stop - 1}"] +
                    [f"{d.memory.get(c, 0.0) / GB:.2f}" for c in comps] + [f"{d.total / GB:.2f}", fits])
    lines = [head, "per-device memory (GB):", _table(cols, rows), "", "communication per step and device (GB):"]
    crow = [[d.training_stage, str(d.pp)] + [f"{d.comm.get(k, 0.0) / GB:.1f}" for k in kinds] for d in plans]
    lines.append(_table(["stage", "pp"] + kinds, crow))
    return "\n".join(lines)


def _table(cols: List[str], rows: List[List[str]]) -> str:
    wid = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    fmt = lambda r: "  ".join(x.rjust(w) if i > 0 else x.ljust(w) for i, (x, w) in enumerate(zip(r, wid)))
    return "\n".join([fmt(cols), fmt(["-" * w for w in wid])] + [fmt(r) for r in rows])


def check(run_cfg, plans: List[DevicePlan], limit: Optional[float]) -> List[str]:
    """One message per device plan above the limit, naming its largest component."""
    if limit is None:
        return []
    return [f"training stage '{d.training_stage}', pipeline stage {d.pp} (ranks {d.ranks.start}-{d.ranks.stop - 1})"
            f" needs {d.total / GB:.2f} GB > context.max_device_memory {limit / GB:.1f} GB; largest: {d.largest()}"
            for d in plans if d.total > limit]


# ------------------------------------------------------------------------------------------------
# command line
