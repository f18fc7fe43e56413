"""M-RoPE layouts (`text.mrope_layout`): interleaved gives the same cos/sin as transformers' Qwen3-VL text
rotary, for the dense model's head_dim rotary and for MLA's decoupled rope dims; spread (openPangu-VL's
3D-IM-RoPE) against an independent numpy construction; text-only positions are unaffected by the layout;
the config validates the section and round-trips through config.json."""
import os

import numpy as np
import pytest
import torch
from mindspore import Tensor
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from mindvl_ms.config import ConfigError, MindVLConfig, from_hf_dict, load_model_config, to_hf_dict
from mindvl_ms.ops import layers
from mindvl_ms.models.moe import DeepseekV3Model
from mindvl_ms.models.text import TextModel
from tests.support.paths import ROOT


def _reference(rot_dim, section, theta, pos):
    """transformers' Qwen3-VL cos/sin [B, L, rot_dim] for int positions [3, B, L]."""
    cfg = Qwen3VLTextConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=rot_dim,
                            rope_theta=theta, rope_scaling={"rope_type": "default", "mrope_section": section,
                                                            "mrope_interleaved": True})
    rotary = Qwen3VLTextRotaryEmbedding(cfg)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.tensor(pos, dtype=torch.long))
    return cos.numpy(), sin.numpy()


@pytest.mark.parametrize("rotary, rot_dim, section, theta", [
    (layers.MRotaryEmbedding, 32, [7, 5, 4], 10000.0),       # h and w of different sizes
    (layers.MRotaryEmbedding, 128, [24, 20, 20], 5000000.0),  # Qwen3-VL-8B's split and base
    (layers.MRotaryEmbedding, 16, [5, 1, 2], 10000.0),         # MLA rope dims (tiny-moe: 16)
])
def test_interleaved_cos_sin_match_qwen3_vl(rotary, rot_dim, section, theta):
    rng = np.random.default_rng(0)
    pos = rng.integers(0, 200, (3, 2, 7)).astype(np.int32)  # distinct t, h, w positions
    ref_cos, ref_sin = _reference(rot_dim, section, theta, pos)
    # one cell per layout, each called on two position arrays of one shape: one compiled graph each
    interleaved, chunked_rope = (rotary(rot_dim, theta, section, layout) for layout in ("interleaved", "chunked"))
    cos, sin = interleaved(Tensor(pos))
    np.testing.assert_allclose(cos.asnumpy()[:, 0], ref_cos, atol=2e-5)
    np.testing.assert_allclose(sin.asnumpy()[:, 0], ref_sin, atol=2e-5)
    # the layouts really differ on image positions ...
    chunked, _ = chunked_rope(Tensor(pos))
    assert np.abs(chunked.asnumpy() - cos.asnumpy()).max() > 0.1
    # ... and agree exactly on text positions (t = h = w): plain 1D RoPE either way
    same = np.broadcast_to(pos[:1], pos.shape).copy()
    a, _ = interleaved(Tensor(same))
    b, _ = chunked_rope(Tensor(same))
    np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def test_pair_axis_layouts_by_hand():
    np.testing.assert_array_equal(layers.mrope_pair_axis([2, 3, 3]), [0, 0, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(layers.mrope_pair_axis([4, 2, 2], "interleaved"), [0, 1, 2, 0, 1, 2, 0, 0])


def test_interleaved_section_validated_and_round_trips(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("text:\n  head_dim: 32\n  mrope_section: [4, 6, 6]\n  mrope_layout: interleaved\n")
    with pytest.raises(ConfigError, match=r"\[4, 6, 6\] does not fit the interleaved.*at most 5 and 5.*\[6, 5, 5\]"):
        load_model_config(str(p))

    cfg = MindVLConfig()
    cfg.text.model_type, cfg.text.mrope_layout, cfg.text.mrope_section = "qwen3", "interleaved", [24, 20, 20]
    d = to_hf_dict(cfg)
    assert d["text_config"]["rope_scaling"]["mrope_interleaved"] is True
    back = from_hf_dict(d)
    assert back.text.mrope_layout == "interleaved" and back.text.mrope_section == [24, 20, 20]
    assert from_hf_dict(to_hf_dict(MindVLConfig())).text.mrope_layout == "chunked"

    cfg.text.model_type = "qwen2"  # transformers' Qwen2.5-VL would silently read it chunked
    with pytest.raises(ConfigError, match="always reads M-RoPE chunked"):
        to_hf_dict(cfg)


@pytest.mark.parametrize("yaml, section, build", [
    ("tiny.yaml", [6, 5, 5], TextModel),
    ("tiny-moe.yaml", [4, 2, 2], DeepseekV3Model),
])
def test_models_pass_the_flag_to_their_rotary(yaml, section, build):
    """The dense and the MoE language models built from a shipped config rotate as Qwen3-VL with the flag on."""
    cfg = load_model_config(os.path.join(ROOT, "configs", "model", yaml)).text
    cfg.mrope_layout, cfg.mrope_section = "interleaved", section
    cfg.validate()
    rot_dim = 2 * sum(section)
    pos = np.random.default_rng(1).integers(0, 100, (3, 1, 5)).astype(np.int32)
    cos, sin = build(cfg).rotary_emb(Tensor(pos))
    ref_cos, ref_sin = _reference(rot_dim, section, cfg.rope_theta, pos)
    np.testing.assert_allclose(cos.asnumpy()[:, 0], ref_cos, atol=2e-5)
    np.testing.assert_allclose(sin.asnumpy()[:, 0], ref_sin, atol=2e-5)


def _spread_reference(section):
    """Independent construction: place each axis's k pairs at the evenly spaced slots round((i + 0.5) * n / k - 0.5)
    and check the greedy layout gives every axis pairs that span the frequency range evenly."""
    n = sum(section)
    return {a: np.round((np.arange(k) + 0.5) * n / k - 0.5) for a, k in enumerate(section) if k}


@pytest.mark.parametrize("section", [[9, 27, 28], [2, 7, 7], [3, 6, 7], [1, 1, 6], [5, 5, 6]])
def test_spread_layout_counts_and_even_spacing(section):
    axis = layers.mrope_pair_axis(section, "spread")
    n = sum(section)
    assert [int((axis == a).sum()) for a in range(3)] == section  # the band ratio is exactly the section
    for a, slots in _spread_reference(section).items():
        got = np.flatnonzero(axis == a)
        # every pair of axis a sits within one slot of its evenly spaced ideal position
        assert np.abs(got - slots).max() <= 1.0, (a, got, slots)
        # so the axis reaches both ends of the spectrum: high (low j) and low (high j) frequencies
        assert got[0] <= n / len(got) and got[-1] >= n - 1 - n / len(got)


def test_spread_equal_split_is_the_interleaved_pattern():
    np.testing.assert_array_equal(layers.mrope_pair_axis([5, 5, 5], "spread"), layers.mrope_pair_axis([5, 5, 5], "interleaved"))
    np.testing.assert_array_equal(layers.mrope_pair_axis([1, 3, 3], "spread"), [1, 2, 0, 1, 2, 1, 2])


def test_spread_cos_sin_against_numpy():
    """The rotary module with the spread layout equals cos/sin built in numpy from the pair-axis table."""
    section, theta, rot = [2, 7, 7], 10000.0, 32
    pos = np.random.default_rng(2).integers(0, 300, (3, 2, 6))
    axis = np.tile(layers.mrope_pair_axis(section, "spread"), 2)  # [rot]
    inv = 1.0 / theta ** (np.arange(0, rot, 2) / rot)
    inv = np.concatenate([inv, inv])
    ang = np.take_along_axis(pos.transpose(1, 2, 0)[..., None].repeat(rot, -1),
                             axis[None, None, None, :].repeat(2, 0).repeat(6, 1), 2)[:, :, 0] * inv
    cos, sin = layers.MRotaryEmbedding(rot, theta, section, "spread")(Tensor(pos.astype(np.int32)))
    np.testing.assert_allclose(cos.asnumpy()[:, 0], np.cos(ang), atol=2e-5)
    np.testing.assert_allclose(sin.asnumpy()[:, 0], np.sin(ang), atol=2e-5)


def test_spread_round_trips_and_bad_layout_is_named(tmp_path):
    cfg = MindVLConfig()
    cfg.text.model_type, cfg.text.mrope_layout, cfg.text.mrope_section = "qwen3", "spread", [9, 27, 28]
    assert from_hf_dict(to_hf_dict(cfg)).text.mrope_layout == "spread"
    p = tmp_path / "m.yaml"
    p.write_text("text:\n  mrope_layout: diagonal\n")
    with pytest.raises(ConfigError, match="mrope_layout 'diagonal': expected chunked, interleaved or spread"):
        load_model_config(str(p))
