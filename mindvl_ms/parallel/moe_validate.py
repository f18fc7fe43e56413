"""MoE sizes and parallel layout: parameter counts from config arithmetic, and layout validation.

`count_parameters(text_config)` derives total / activated parameter counts of a DeepSeek-V3 style LM from
its config alone (no cell is built), split by part; `abstract_parameter_shapes(text_config)` builds the
real cells under `mindspore.nn.utils.no_init_parameters()` (shapes only, no weight memory) so the two can
be checked against each other, e.g. for configs/model/mindvl-671b-a37b.yaml (~671B total, ~37B activated;
like DeepSeek-V3's own figures, embeddings and lm_head are included, multi-token-prediction layers are
reported separately).

`validate_moe_parallel(text_config, parallel_sizes, device_num=None)` checks an expert-parallel layout
(called by the trainer's strategy validation): experts divisible by EP, EP x TP within the device count,
EP dividing DP x TP (MindFormers' alltoall dispatcher groups EP ranks inside the DP x TP ranks), heads
divisible by TP, and DP x TP x PP equal to the device count when it is given.
"""
from typing import Any, Dict, Optional

from mindspore.nn.utils import no_init_parameters

from mindvl_ms.config.base import ConfigError
from mindvl_ms.models.moe import DeepseekV3ForCausalLM


def _size(p: Any, *names: str, default: int = 1) -> int:
    for n in names:
        if isinstance(p, dict) and n in p:
            return int(p[n])
        if not isinstance(p, dict) and hasattr(p, n):
            return int(getattr(p, n))
    return default


def validate_moe_parallel(text_config, parallel_sizes, device_num: Optional[int] = None) -> None:
    """Raise ConfigError naming the offending `parallel_config.*` sizes; no return value.

    parallel_sizes: an object or dict with data_parallel, model_parallel (or tensor_parallel),
    pipeline_stage (or pipeline_parallel), expert_parallel.
    """
    dp = _size(parallel_sizes, "data_parallel")
    tp = _size(parallel_sizes, "model_parallel", "tensor_parallel")
    pp = _size(parallel_sizes, "pipeline_stage", "pipeline_parallel")
    ep = _size(parallel_sizes, "expert_parallel")
    for name, v in (("data_parallel", dp), ("model_parallel", tp), ("pipeline_stage", pp), ("expert_parallel", ep)):
        if v < 1:
            raise ConfigError(f"parallel_config.{name} must be >= 1, got {v}")
    devices = device_num if device_num is not None else dp * tp * pp
    if device_num is not None and dp * tp * pp != device_num:
        raise ConfigError(f"parallel_config: data_parallel x model_parallel x pipeline_stage = {dp}x{tp}x{pp} = "
                          f"{dp * tp * pp}, but {device_num} devices are used")
    if text_config.num_attention_heads % tp:
        raise ConfigError(f"parallel_config.model_parallel {tp} must divide num_attention_heads "
                          f"{text_config.num_attention_heads}")
    if pp > text_config.num_hidden_layers:
        raise ConfigError(f"parallel_config.pipeline_stage {pp} exceeds num_hidden_layers {text_config.num_hidden_layers}")
    if text_config.model_type != "deepseek_v3":
        if ep != 1:
            raise ConfigError(f"parallel_config.expert_parallel {ep} needs a MoE model (text.model_type deepseek_v3)")
        return
    experts = text_config.moe.n_routed_experts
    if experts % ep:
        raise ConfigError(f"parallel_config.expert_parallel {ep} must divide moe.n_routed_experts {experts}")
    if ep * tp > devices:
        raise ConfigError(f"parallel_config: expert_parallel x model_parallel = {ep}x{tp} = {ep * tp} exceeds the "
                          f"{devices} devices")
    if (dp * tp) % ep:
        raise ConfigError(f"parallel_config.expert_parallel {ep} must divide data_parallel x model_parallel = "
                          f"{dp * tp} (expert-parallel groups are formed inside the DP x TP ranks)")


def count_parameters(t) -> Dict[str, int]:
    """Parameter counts of a deepseek_v3 TextConfig by part, plus `total`, `activated` and `mtp`."""
    m = t.moe
    d, h = t.hidden_size, t.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    attn = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # kv_a_proj_with_mqa + kv_a_layernorm
    attn += m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d  # kv_b + o
    if m.q_lora_rank is None:
        attn += d * h * qk
    else:
        attn += d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * h * qk
    if t.attention_bias:
        attn += (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim + d
    norms = 2 * d
    expert = 3 * d * m.moe_intermediate_size
    dense_ffn = 3 * d * t.intermediate_size
    router = m.n_routed_experts * d + m.n_routed_experts  # weight + e_score_correction_bias
    shared = expert * m.n_shared_experts
    n_moe = t.num_hidden_layers - m.first_k_dense_replace
    n_dense = m.first_k_dense_replace
    moe_layer = attn + norms + router + shared + m.n_routed_experts * expert
    dense_layer = attn + norms + dense_ffn
    embed = t.vocab_size * d
    head = 0 if t.tie_word_embeddings else t.vocab_size * d
    total = n_dense * dense_layer + n_moe * moe_layer + embed + head + d
    inactive = n_moe * (m.n_routed_experts - m.num_experts_per_tok) * expert
    mtp = m.num_nextn_predict_layers * (moe_layer + 2 * d + 2 * d * d + d)  # + enorm, hnorm, eh_proj, head norm
    return {"attention_per_layer": attn, "dense_layer": dense_layer, "moe_layer": moe_layer,
            "routed_experts": n_moe * m.n_routed_experts * expert, "embedding": embed, "lm_head": head,
            "total": total, "activated": total - inactive, "mtp": mtp}


def abstract_parameter_shapes(text_config) -> Dict[str, tuple]:
    """Build DeepseekV3ForCausalLM without allocating weights; returns {name: shape}."""
    with no_init_parameters():
        lm = DeepseekV3ForCausalLM(text_config)
    return {name: tuple(p.shape) for name, p in lm.parameters_and_names()}
