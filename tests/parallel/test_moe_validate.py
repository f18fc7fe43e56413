"""MindVL-671B-A37B abstract instantiation (shapes only), parameter arithmetic, and MoE parallel validation."""
import os

import numpy as np
import pytest

from mindvl_ms.config import ConfigError, load_model_config
from mindvl_ms.config.train import ParallelConfig
from mindvl_ms.parallel.moe_validate import abstract_parameter_shapes, count_parameters, validate_moe_parallel
from tests.support.paths import ROOT

BIG = os.path.join(ROOT, "configs/model/mindvl-671b-a37b.yaml")
TINY = os.path.join(ROOT, "configs/model/tiny-moe.yaml")


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def test_671b_abstract_instantiation_counts_671b_total_37b_activated():
    text = load_model_config(BIG).text
    counts = count_parameters(text)
    assert 670.5e9 < counts["total"] < 671.5e9, counts["total"]
    assert 37.0e9 < counts["activated"] < 38.0e9, counts["activated"]
    with open("/proc/self/clear_refs", "w") as f:  # restart the peak (VmHWM) at today's RSS: earlier tests'
        f.write("5")                              # peaks in this process do not count
    rss = _status_kb("VmRSS")
    shapes = abstract_parameter_shapes(text)  # real cells, no weights allocated
    built = sum(int(np.prod(s)) for s in shapes.values())
    assert built == counts["total"] + counts["mtp"]
    mtp = sum(int(np.prod(s)) for n, s in shapes.items() if n.startswith("model.mtp."))
    assert mtp == counts["mtp"]
    # a few shapes straight from the DeepSeek-V3 config
    assert shapes["model.layers.0.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert shapes["model.layers.3.mlp.experts.gate_proj"] == (256, 7168, 2048)
    assert shapes["model.layers.3.mlp.gate.e_score_correction_bias"] == (256,)
    assert "model.layers.2.mlp.gate_proj.weight" in shapes  # first 3 layers dense
    # 671e9 fp32 weights would need 2.7 TB; building the cells raises the peak by far less than 4 GB
    assert _status_kb("VmHWM") - rss < 4 * 2 ** 20


def test_tiny_counts_equal_an_allocated_model():
    from mindvl_ms.models.moe import DeepseekV3ForCausalLM

    text = load_model_config(TINY).text
    lm = DeepseekV3ForCausalLM(text)
    real = sum(int(np.prod(p.shape)) for p in lm.get_parameters())
    counts = count_parameters(text)
    assert real == counts["total"] + counts["mtp"]
    m = text.moe
    expert = 3 * text.hidden_size * m.moe_intermediate_size
    moe_layers = text.num_hidden_layers - m.first_k_dense_replace
    assert counts["total"] - counts["activated"] == moe_layers * (m.n_routed_experts - m.num_experts_per_tok) * expert


def test_671b_parallel_layout_is_valid():
    import yaml

    with open(BIG) as f:
        raw = yaml.safe_load(f)
    sizes = ParallelConfig(**raw["parallel_config"])
    validate_moe_parallel(load_model_config(BIG).text, sizes, device_num=64 * 8)


@pytest.mark.parametrize("sizes, devices, message", [
    (dict(data_parallel=8, model_parallel=8, pipeline_stage=8, expert_parallel=48), 512, "must divide moe.n_routed_experts"),
    (dict(data_parallel=16, model_parallel=8, pipeline_stage=4, expert_parallel=128), 512, "exceeds the 512 devices"),
    (dict(data_parallel=8, model_parallel=8, pipeline_stage=8, expert_parallel=64), 256, "but 256 devices"),
    (dict(data_parallel=4, model_parallel=4, pipeline_stage=32, expert_parallel=32), 512, "must divide data_parallel x"),
    (dict(data_parallel=8, model_parallel=3, pipeline_stage=1, expert_parallel=8), None, "num_attention_heads"),
])
def test_invalid_parallel_layouts_are_rejected(sizes, devices, message):
    text = load_model_config(BIG).text
    with pytest.raises(ConfigError, match=message):
        validate_moe_parallel(text, sizes, device_num=devices)


def test_expert_parallel_needs_a_moe_model():
    text = load_model_config(TINY).text
    text.model_type = "qwen3"
    with pytest.raises(ConfigError, match="needs a MoE model"):
        validate_moe_parallel(text, {"data_parallel": 2, "expert_parallel": 2}, device_num=2)
    validate_moe_parallel(text, {"data_parallel": 2}, device_num=2)  # plain data parallel is fine
