"""Model configs: vision encoder, language model (Qwen2/Qwen3 dense, DeepSeek-V3 MoE), MindVL.

Field names follow the Hugging Face configs (Qwen2_5_VLVisionConfig, Qwen3Config,
DeepseekV3Config) so that `config.json` converts near-identically (`from_hf_dict` / `to_hf_dict`).
Shapes that cannot work are rejected in `validate()` at load time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional

from mindvl_ms.config.base import F, ConfigError, load, sub


@dataclass
class VisionConfig:
    """Qwen2.5-ViT style native-resolution encoder plus the 2x2 patch-merger projector."""

    depth: int = F(32, "number of transformer blocks")
    hidden_size: int = F(1280, "width of the vision transformer")
    intermediate_size: int = F(3456, "FFN hidden size of each block")
    num_heads: int = F(16, "attention heads (hidden_size / num_heads is the head dim)")
    in_channels: int = F(3, "image channels")
    patch_size: int = F(14, "spatial patch size in pixels")
    temporal_patch_size: int = F(2, "frames per temporal patch (an image is repeated to fill it)")
    spatial_merge_size: int = F(2, "patch merger groups merge x merge patches into one LLM token")
    window_size: int = F(112, "window attention side in pixels (must be a multiple of patch*merge)")
    fullatt_block_indexes: List[int] = F([7, 15, 23, 31], "0-based blocks that use full attention")
    hidden_act: str = F("silu", "FFN activation: silu or gelu (gelu_pytorch_tanh accepted)")
    mlp_type: str = F("gated", "gated: gate/up/down (SwiGLU-style); plain: fc1/fc2 (openPangu-ViT)")
    out_hidden_size: int = F(4096, "projector output width (= the LLM hidden size)")
    rms_norm_eps: float = F(1e-6, "epsilon of the RMSNorms in the vision tower")
    tokens_per_second: int = F(2, "temporal position scale for video (kept for HF compatibility)")
    initializer_range: float = F(0.02, "std of the normal init")
    abs_pos_grid: int = F(0, "learned row and column embeddings added to the patch embeddings for patch rows/cols "
                             "0..abs_pos_grid-1 (later ones clip to the last); 0 = none, as Qwen2.5-ViT")
    hierarchical_layers: List[int] = F([], "openPangu-VL's hierarchical connector: 0-based blocks whose outputs "
                                           "are each normalised and 2x2-merged, then fused (hierarchical_fusion) "
                                           "and projected by one MLP; must end with the last block; empty = "
                                           "Qwen2.5-VL merger")
    hierarchical_fusion: str = F("sum", "how the connector's levels meet before its MLP: sum (the levels added, "
                                        "a single-level-sized MLP: the report's 'lightweight' connector) or concat "
                                        "(concatenated: the MLP's first layer takes L x 4 x hidden_size inputs)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"vision hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ConfigError(f"vision head dim {self.head_dim} must be a multiple of 4 for 2D RoPE")
        unit = self.patch_size * self.spatial_merge_size
        if self.window_size % unit:
            raise ConfigError(f"window_size {self.window_size} must be a multiple of patch_size*spatial_merge_size={unit}")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ConfigError(f"fullatt_block_indexes {bad} outside 0..{self.depth - 1}")
        if self.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu"):
            raise ConfigError(f"vision hidden_act '{self.hidden_act}': expected silu, gelu, gelu_pytorch_tanh or quick_gelu")
        if self.mlp_type not in ("gated", "plain"):
            raise ConfigError(f"vision mlp_type '{self.mlp_type}': expected 'gated' or 'plain'")
        hl = list(self.hierarchical_layers)
        if hl and (hl != sorted(set(hl)) or hl[0] < 0 or hl[-1] != self.depth - 1):
            raise ConfigError(f"vision hierarchical_layers {hl}: expected increasing 0-based block indices ending "
                              f"with the last block ({self.depth - 1})")
        if self.abs_pos_grid < 0:
            raise ConfigError(f"vision abs_pos_grid {self.abs_pos_grid}: expected 0 (none) or a positive grid side")
        if self.hierarchical_fusion not in ("sum", "concat"):
            raise ConfigError(f"vision hierarchical_fusion '{self.hierarchical_fusion}': expected sum or concat")


@dataclass
class MoEConfig:
    """DeepSeek-V3 style MLA attention and routed experts (used when text.model_type is deepseek_v3)."""

    q_lora_rank: Optional[int] = F(1536, "rank of the query down-projection (null: full-rank q_proj)")
    kv_lora_rank: int = F(512, "rank of the compressed key/value latent")
    qk_rope_head_dim: int = F(64, "decoupled RoPE dims per head (carry M-RoPE for visual tokens)")
    qk_nope_head_dim: int = F(128, "non-rotary query/key dims per head")
    rope_interleave: bool = F(True, "rope dims paired as (0,1),(2,3),... in the weights (DeepSeek-V3/HF default)")
    v_head_dim: int = F(128, "value dims per head")
    n_routed_experts: int = F(256, "routed experts per MoE layer")
    num_experts_per_tok: int = F(8, "experts chosen per token (top-k)")
    n_group: int = F(8, "expert groups for group-limited routing")
    topk_group: int = F(4, "groups a token may route into")
    n_shared_experts: int = F(1, "always-active shared experts")
    moe_intermediate_size: int = F(2048, "FFN size of one expert")
    first_k_dense_replace: int = F(3, "the first k layers use a dense FFN instead of MoE")
    routed_scaling_factor: float = F(2.5, "scale applied to the routed experts' weighted sum")
    norm_topk_prob: bool = F(True, "renormalise the top-k routing weights to sum to 1")
    scoring_func: str = F("sigmoid", "router score function (DeepSeek-V3: sigmoid)")
    bias_update_speed: float = F(0.001, "aux-loss-free balancing: step of the per-expert bias update (0 disables)")
    seq_aux_loss_coef: float = F(0.0, "sequence-wise auxiliary balance loss weight (0 disables)")
    num_nextn_predict_layers: int = F(0, "multi-token prediction layers (0 disables)")
    mtp_loss_scale: float = F(0.3, "weight of the multi-token prediction loss")

    def validate(self) -> None:
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_routed_experts {self.n_routed_experts} not divisible by n_group {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group {self.topk_group} must be in 1..n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ConfigError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts reachable in "
                f"topk_group={self.topk_group} groups of {per_group}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ConfigError(f"scoring_func '{self.scoring_func}': expected sigmoid or softmax")


@dataclass
class TextConfig:
    """The language model: Qwen3 (QK-norm, no bias), Qwen2 (qkv bias) or DeepSeek-V3 (MLA + MoE)."""

    model_type: str = F("qwen3", "qwen3, qwen2 or deepseek_v3")
    vocab_size: int = F(151936, "vocabulary size (embedding rows)")
    hidden_size: int = F(4096, "model width")
    intermediate_size: int = F(12288, "dense FFN hidden size")
    num_hidden_layers: int = F(36, "decoder layers")
    num_attention_heads: int = F(32, "query heads")
    num_key_value_heads: int = F(8, "key/value heads (GQA); must divide num_attention_heads")
    head_dim: Optional[int] = F(128, "per-head dim (null: hidden_size / num_attention_heads)")
    hidden_act: str = F("silu", "FFN activation of the gated MLP, down(act(gate(x)) * up(x)): silu (SwiGLU), gelu, "
                                "gelu_pytorch_tanh or quick_gelu; deepseek_v3 needs silu")
    max_position_embeddings: int = F(40960, "longest position the model is meant for")
    rms_norm_eps: float = F(1e-6, "RMSNorm epsilon")
    rope_theta: float = F(1000000.0, "RoPE base")
    mrope_section: List[int] = F([16, 24, 24], "M-RoPE split of head_dim/2 rotary pairs over (t, h, w)")
    mrope_layout: str = F("chunked", "M-RoPE pair layout: chunked t|h|w (Qwen2.5-VL), interleaved thw thw ... "
                                     "(Qwen3-VL), or spread (openPangu-VL's 3D-IM-RoPE: each axis's pairs spread "
                                     "evenly over the frequencies, any t:h:w split, e.g. [9, 27, 28] = 1:6)")
    mrope_accumulate: bool = F(False, "video positions accumulate frame by frame: each temporal patch is placed "
                                      "after the previous one like a new image (openPangu-VL's accumulative "
                                      "strategy); false: Qwen2.5-VL's shared h/w grid with absolute time on t")
    attention_bias: bool = F(False, "bias on q/k/v projections (Qwen2: true, Qwen3: false)")
    use_qk_norm: bool = F(True, "RMSNorm on each head of q and k before RoPE (Qwen3)")
    tie_word_embeddings: bool = F(False, "lm_head shares the embedding matrix")
    initializer_range: float = F(0.02, "std of the normal init")
    moe: MoEConfig = sub(MoEConfig, "MLA/MoE settings, used only when model_type is deepseek_v3")

    @property
    def head_dim_(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        if self.model_type not in ("qwen3", "qwen2", "deepseek_v3"):
            raise ConfigError(f"text model_type '{self.model_type}': expected qwen3, qwen2 or deepseek_v3")
        if self.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu"):
            raise ConfigError(f"text hidden_act '{self.hidden_act}': expected silu, gelu, gelu_pytorch_tanh or "
                              f"quick_gelu")
        if self.model_type == "deepseek_v3" and self.hidden_act != "silu":
            raise ConfigError(f"text hidden_act '{self.hidden_act}': deepseek_v3 experts are SwiGLU, use silu")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"text hidden_size {self.hidden_size} not divisible by num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} not divisible by num_key_value_heads "
                f"{self.num_key_value_heads}")
        rot = (self.moe.qk_rope_head_dim if self.model_type == "deepseek_v3" else self.head_dim_) // 2
        if sum(self.mrope_section) != rot:
            raise ConfigError(f"mrope_section {self.mrope_section} sums to {sum(self.mrope_section)}, "
                              f"expected rotary dim / 2 = {rot}")
        if len(self.mrope_section) != 3:
            raise ConfigError(f"mrope_section needs 3 entries (t, h, w), got {self.mrope_section}")
        if self.mrope_layout not in ("chunked", "interleaved", "spread"):
            raise ConfigError(f"text.mrope_layout '{self.mrope_layout}': expected chunked, interleaved or spread")
        if min(self.mrope_section) < 0:
            raise ConfigError(f"mrope_section {self.mrope_section}: entries must be >= 0")
        if self.mrope_layout == "interleaved":
            t, h, w = self.mrope_section
            if 3 * h - 2 >= rot or 3 * w - 1 >= rot or min(h, w) < 0:
                top = (rot + 1) // 3
                raise ConfigError(
                    f"mrope_section {self.mrope_section} does not fit the interleaved M-RoPE layout over {rot} "
                    f"pairs: h takes pairs 1, 4, 7, ... and w pairs 2, 5, 8, ..., so h and w can have at most "
                    f"{top} and {rot // 3} pairs (e.g. [{rot - 2 * (rot // 3)}, {rot // 3}, {rot // 3}])")


@dataclass
class MindVLConfig:
    """The whole model: vision tower + merger projector + language model, and the special token ids."""

    vision: VisionConfig = sub(VisionConfig, "vision encoder and patch merger")
    text: TextConfig = sub(TextConfig, "language model")
    image_token_id: int = F(151655, "id of <|image_pad|>; each is replaced by one merged visual token")
    video_token_id: int = F(151656, "id of <|video_pad|>")
    vision_start_token_id: int = F(151652, "id of <|vision_start|>")
    vision_end_token_id: int = F(151653, "id of <|vision_end|>")
    dtype: str = F("float32", "compute dtype: float32, float16 or bfloat16 (bf16 only where the device has it)")

    def validate(self) -> None:
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ConfigError(f"vision.out_hidden_size {self.vision.out_hidden_size} must equal "
                              f"text.hidden_size {self.text.hidden_size}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"dtype '{self.dtype}': expected float32, float16 or bfloat16")
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            if not 0 <= getattr(self, name) < self.text.vocab_size:
                raise ConfigError(f"{name} {getattr(self, name)} outside the vocabulary (size {self.text.vocab_size})")


# ----------------------------------------------------------------------------------------------
# Hugging Face config.json <-> MindVLConfig

_HF_ACT = {"gelu_pytorch_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "silu": "silu", "quick_gelu": "quick_gelu"}


def _pick(cls: type, d: Dict[str, Any]) -> Dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def text_from_hf(d: Dict[str, Any]) -> TextConfig:
    """Qwen2/Qwen3/Qwen2.5-VL text/DeepseekV3 config.json dict -> TextConfig."""
    mt = d.get("model_type", "qwen2")
    kw = _pick(TextConfig, d)
    kw.pop("moe", None)
    if mt in ("qwen2_5_vl_text", "qwen2_5_vl", "qwen2", "qwen2_vl"):
        kw.update(model_type="qwen2", attention_bias=True, use_qk_norm=False)
    elif mt in ("qwen3",):
        kw.update(model_type="qwen3", use_qk_norm=True, attention_bias=bool(d.get("attention_bias", False)))
    elif mt == "deepseek_v3":
        kw.update(model_type="deepseek_v3", use_qk_norm=False)
        kw["moe"] = _pick(MoEConfig, d)
        kw["moe"]["num_nextn_predict_layers"] = d.get("num_nextn_predict_layers", 0) or 0
        kw["moe"].setdefault("scoring_func", d.get("scoring_func", "sigmoid"))
    else:
        raise ConfigError(f"unsupported text model_type '{mt}' in config.json")
    if kw.get("head_dim") is None and mt != "qwen3":
        kw["head_dim"] = None
    rs = d.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ConfigError(f"config.json: rope_scaling type '{kind}' is not supported (only default RoPE and "
                          f"M-RoPE); loading these weights would silently use wrong positions")
    if "mrope_section" in rs:
        kw["mrope_section"] = list(rs["mrope_section"])
    elif "mrope_section" not in kw:
        rot = (kw["moe"]["qk_rope_head_dim"] if mt == "deepseek_v3" else
               (kw.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])) // 2
        # a plain 1D-RoPE LLM: any split works since text positions are equal on t/h/w;
        # this gives Qwen2.5-VL's [16, 24, 24] for 64 rotary pairs
        kw["mrope_section"] = [rot - 2 * (rot * 3 // 8), rot * 3 // 8, rot * 3 // 8]
    if rs.get("mrope_interleaved"):  # the key Qwen3-VL's config.json uses
        kw["mrope_layout"] = "interleaved"
    return load(TextConfig, kw, source="config.json")


def vision_from_hf(d: Dict[str, Any]) -> VisionConfig:
    kw = _pick(VisionConfig, d)
    kw.pop("mlp_type", None)
    if "embed_dim" in d and "hidden_size" not in d:
        kw["hidden_size"] = d["embed_dim"]
    return load(VisionConfig, kw, source="config.json:vision_config")


def from_hf_dict(d: Dict[str, Any]) -> MindVLConfig:
    """Qwen2.5-VL config.json dict -> MindVLConfig (text fields at top level or in text_config)."""
    text = dict(d)
    text.update(d.get("text_config") or {})
    if text.get("model_type") in (None, "qwen2_5_vl"):
        text["model_type"] = "qwen2_5_vl"
    extra = d.get("mindvl") or {}
    t = text_from_hf(text)
    if "use_qk_norm" in extra:
        t.use_qk_norm = bool(extra["use_qk_norm"])
    vd = dict(d.get("vision_config") or {})
    v = vision_from_hf(vd)
    v.mlp_type = extra.get("vision_mlp_type", v.mlp_type)
    top = {k: d[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                             "vision_end_token_id") if k in d}
    cfg = MindVLConfig(vision=v, text=t, **top)
    cfg.validate()
    return cfg


def to_hf_dict(cfg: MindVLConfig) -> Dict[str, Any]:
    """MindVLConfig -> a Qwen2.5-VL style config.json (readable by transformers when text is qwen2)."""
    if cfg.vision.hierarchical_layers:
        raise ConfigError("vision.hierarchical_layers: transformers' Qwen2.5-VL merger reads only the last block, "
                          "so this model cannot be written in its layout (save it in native format)")
    if cfg.vision.abs_pos_grid:
        raise ConfigError("vision.abs_pos_grid: transformers' Qwen2.5-VL vision tower has no absolute position "
                          "embedding, so this model cannot be written in its layout (save it in native format)")
    t = dataclasses.asdict(cfg.text)
    moe = t.pop("moe")
    mt = t.pop("model_type")
    mrope = t.pop("mrope_section")
    layout = t.pop("mrope_layout")
    t.pop("use_qk_norm")
    text = dict(t)
    text["rope_scaling"] = {"type": "mrope", "rope_type": "default", "mrope_section": mrope}
    if layout != "chunked" and mt == "qwen2":
        raise ConfigError(f"text.mrope_layout {layout}: transformers' Qwen2.5-VL always reads M-RoPE chunked, so "
                          "this model cannot be written as a Qwen2.5-VL config.json (use model_type qwen3)")
    if layout == "interleaved":
        text["rope_scaling"]["mrope_interleaved"] = True  # the key Qwen3-VL's config.json uses
    elif layout == "spread":
        text["mrope_layout"] = layout  # no transformers model reads this layout; read back by text_from_hf
    if mt == "deepseek_v3":
        text.update({k: v for k, v in moe.items() if k not in ("bias_update_speed", "seq_aux_loss_coef", "mtp_loss_scale")})
    text["model_type"] = {"qwen2": "qwen2_5_vl_text", "qwen3": "qwen3", "deepseek_v3": "deepseek_v3"}[mt]
    vision = dataclasses.asdict(cfg.vision)
    vision.pop("mlp_type")
    vision.pop("abs_pos_grid")
    vision.pop("hierarchical_layers")
    vision.pop("hierarchical_fusion")
    vision["model_type"] = "qwen2_5_vl"
    out = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "image_token_id": cfg.image_token_id,
        "video_token_id": cfg.video_token_id,
        "vision_start_token_id": cfg.vision_start_token_id,
        "vision_end_token_id": cfg.vision_end_token_id,
        "vision_config": vision,
        "text_config": text,
        "mindvl": {"text_model_type": mt, "vision_mlp_type": cfg.vision.mlp_type,
                   "use_qk_norm": cfg.text.use_qk_norm},
    }
    out.update({k: v for k, v in text.items() if k != "model_type"})  # top-level copy, as HF writes it
    out["torch_dtype"] = cfg.dtype
    return out
