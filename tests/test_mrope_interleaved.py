"""Interleaved M-RoPE (`text.mrope_interleaved`): same cos/sin as transformers' Qwen3-VL text rotary, for the
dense model's head_dim rotary and for MLA's decoupled rope dims; text-only positions are unaffected; the
config validates the section and round-trips through config.json."""
import os

import numpy as np
import pytest
import torch
from mindspore import Tensor
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from mindvl_ms.config import ConfigError, MindVLConfig, from_hf_dict, load_model_config, to_hf_dict
from mindvl_ms.models import mla, text
from mindvl_ms.models.moe import DeepseekV3Model


def _reference(rot_dim, section, theta, pos):
    """transformers' Qwen3-VL cos/sin [B, L, rot_dim] for int positions [3, B, L]."""
    cfg = Qwen3VLTextConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=rot_dim,
                            rope_theta=theta, rope_scaling={"rope_type": "default", "mrope_section": section,
                                                            "mrope_interleaved": True})
    rotary = Qwen3VLTextRotaryEmbedding(cfg)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.tensor(pos, dtype=torch.long))
    return cos.numpy(), sin.numpy()


@pytest.mark.parametrize("rotary, rot_dim, section, theta", [
    (text.MRotaryEmbedding, 32, [7, 5, 4], 10000.0),       # h and w of different sizes
    (text.MRotaryEmbedding, 128, [24, 20, 20], 5000000.0),  # Qwen3-VL-8B's split and base
    (mla.MRotaryEmbedding, 16, [5, 1, 2], 10000.0),         # MLA rope dims (tiny-moe: 16)
])
def test_interleaved_cos_sin_match_qwen3_vl(rotary, rot_dim, section, theta):
    rng = np.random.default_rng(0)
    pos = rng.integers(0, 200, (3, 2, 7)).astype(np.int32)  # distinct t, h, w positions
    ref_cos, ref_sin = _reference(rot_dim, section, theta, pos)
    cos, sin = rotary(rot_dim, theta, section, True)(Tensor(pos))
    np.testing.assert_allclose(cos.asnumpy()[:, 0], ref_cos, atol=2e-5)
    np.testing.assert_allclose(sin.asnumpy()[:, 0], ref_sin, atol=2e-5)
    # the layouts really differ on image positions ...
    chunked, _ = rotary(rot_dim, theta, section, False)(Tensor(pos))
    assert np.abs(chunked.asnumpy() - cos.asnumpy()).max() > 0.1
    # ... and agree exactly on text positions (t = h = w): plain 1D RoPE either way
    same = np.broadcast_to(pos[:1], pos.shape).copy()
    a, _ = rotary(rot_dim, theta, section, True)(Tensor(same))
    b, _ = rotary(rot_dim, theta, section, False)(Tensor(same))
    np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def test_pair_axis_layouts_by_hand():
    np.testing.assert_array_equal(text.mrope_pair_axis([2, 3, 3]), [0, 0, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(text.mrope_pair_axis([4, 2, 2], interleaved=True), [0, 1, 2, 0, 1, 2, 0, 0])


def test_interleaved_section_validated_and_round_trips(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("text:\n  head_dim: 32\n  mrope_section: [4, 6, 6]\n  mrope_interleaved: true\n")
    with pytest.raises(ConfigError, match=r"\[4, 6, 6\] does not fit the interleaved.*at most 5 and 5.*\[6, 5, 5\]"):
        load_model_config(str(p))

    cfg = MindVLConfig()
    cfg.text.model_type, cfg.text.mrope_interleaved, cfg.text.mrope_section = "qwen3", True, [24, 20, 20]
    d = to_hf_dict(cfg)
    assert d["text_config"]["rope_scaling"]["mrope_interleaved"] is True
    back = from_hf_dict(d)
    assert back.text.mrope_interleaved and back.text.mrope_section == [24, 20, 20]
    assert not from_hf_dict(to_hf_dict(MindVLConfig())).text.mrope_interleaved

    cfg.text.model_type = "qwen2"  # transformers' Qwen2.5-VL would silently read it chunked
    with pytest.raises(ConfigError, match="always reads M-RoPE chunked"):
        to_hf_dict(cfg)


@pytest.mark.parametrize("yaml, section, build", [
    ("tiny.yaml", [6, 5, 5], text.TextModel),
    ("tiny-moe.yaml", [4, 2, 2], DeepseekV3Model),
])
def test_models_pass_the_flag_to_their_rotary(yaml, section, build):
    """The dense and the MoE language models built from a shipped config rotate as Qwen3-VL with the flag on."""
    cfg = load_model_config(os.path.join(os.path.dirname(__file__), "..", "configs", "model", yaml)).text
    cfg.mrope_interleaved, cfg.mrope_section = True, section
    cfg.validate()
    rot_dim = 2 * sum(section)
    pos = np.random.default_rng(1).integers(0, 100, (3, 1, 5)).astype(np.int32)
    cos, sin = build(cfg).rotary_emb(Tensor(pos))
    ref_cos, ref_sin = _reference(rot_dim, section, cfg.rope_theta, pos)
    np.testing.assert_allclose(cos.asnumpy()[:, 0], ref_cos, atol=2e-5)
    np.testing.assert_allclose(sin.asnumpy()[:, 0], ref_sin, atol=2e-5)
