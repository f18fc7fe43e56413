"""DeepSeek-V3 LM (mindvl_ms.models.moe) against transformers 4.57.1 DeepseekV3ForCausalLM (fp32, CPU).

Tiny random HF models are saved with save_pretrained, their safetensors read and mapped through
mindvl_ms.checkpoint.hf_deepseek, and logits compared within 1e-4; the export back is compared bit for bit.
"""
import json
import os

import numpy as np
import pytest
import torch
import mindspore as ms
from mindspore import Tensor

from mindvl_ms.checkpoint import hf_deepseek
from mindvl_ms.checkpoint.pretrained import load_into, model_tensors
from mindvl_ms.checkpoint.io import read_tensors
from mindvl_ms.config.model import text_from_hf
from mindvl_ms.ops.layers import MRotaryEmbedding
from mindvl_ms.models.moe import DeepseekV3ForCausalLM
from mindvl_ms.ops import ApplyRotary

VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=256,
            rope_theta=10000.0, routed_scaling_factor=2.5)


def hf_tiny_deepseek(path, seed=0, **overrides):
    """Save a tiny random DeepseekV3ForCausalLM (norm weights and routing bias randomised); return (dir, model)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM as HF

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**{**BASE, **overrides})
    cfg._attn_implementation = "eager"
    model = HF(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    out = str(path)
    model.save_pretrained(out, safe_serialization=True)
    return out, model


def load_native(hf_dir, expert_dispatch=None):
    with open(os.path.join(hf_dir, "config.json")) as f:
        tc = text_from_hf(json.load(f))
    lm = DeepseekV3ForCausalLM(tc, expert_dispatch)
    load_into(lm, hf_deepseek.hf_to_native(read_tensors(hf_dir), tc))
    return lm, tc


def packed_inputs(rows):
    """rows: list of lists of 1D id arrays -> ids, positions [3, B, L] restarting per sample, segment ids."""
    b, length = len(rows), max(sum(len(s) for s in r) for r in rows)
    ids = np.zeros((b, length), np.int32)
    pos = np.zeros((3, b, length), np.int32)
    seg = np.zeros((b, length), np.int32)
    sid = 0
    for i, row in enumerate(rows):
        at = 0
        for s in row:
            sid += 1
            ids[i, at:at + len(s)] = s
            pos[:, i, at:at + len(s)] = np.arange(len(s))
            seg[i, at:at + len(s)] = sid
            at += len(s)
    return ids, pos, seg


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids, np.int64)[None])).logits[0].numpy()


def dynamic_inputs(lm):
    """Dynamic batch and length: one compiled graph for every shape."""
    lm.set_inputs(Tensor(shape=[None, None], dtype=ms.int32), Tensor(shape=[3, None, None], dtype=ms.int32),
                  Tensor(shape=[None, None], dtype=ms.int32))
    return lm


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    """(hf dir, transformers model, our model with dynamic inputs, text config) of the default variant: one
    model and one compiled graph for the logits test's default variant and the packed-samples test."""
    hf_dir, hf = hf_tiny_deepseek(tmp_path_factory.mktemp("moe") / "hf", seed=1)
    lm, tc = load_native(hf_dir)
    return hf_dir, hf, dynamic_inputs(lm), tc


@pytest.mark.parametrize("variant", [
    {},  # MLA with q LoRA, interleaved rope, group-limited routing to 1 of 2 groups
    {"q_lora_rank": None, "rope_interleave": False, "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
     "first_k_dense_replace": 2},
])
def test_logits_match_transformers_and_export_is_bit_exact(tmp_path, variant, request):
    if variant:
        hf_dir, hf = hf_tiny_deepseek(tmp_path / "hf", **variant)
        lm, tc = load_native(hf_dir)
    else:
        hf_dir, hf, lm, tc = request.getfixturevalue("default_model")
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, (2, 12))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    i, p, s = packed_inputs([[ids[0]], [ids[1]]])
    logits, aux, load = lm(Tensor(i), Tensor(p), Tensor(s))
    err = np.abs(logits.asnumpy() - ref).max()
    assert err < 1e-4, f"max |logit diff| {err}"
    n_moe = tc.num_hidden_layers - tc.moe.first_k_dense_replace
    assert load.shape == (n_moe, tc.moe.n_routed_experts)
    np.testing.assert_array_equal(load.asnumpy().sum(1), np.full(n_moe, 2 * 12 * tc.moe.num_experts_per_tok))
    assert float(aux) == 0.0  # seq_aux_loss_coef defaults to 0

    original = read_tensors(hf_dir)
    back = hf_deepseek.native_to_hf(model_tensors(lm), tc)
    assert set(back) == set(original)
    for k, t in original.items():
        assert back[k].dtype == t.dtype and back[k].data.tobytes() == t.data.tobytes(), k


def test_grouped_dispatch_equals_dense_and_transformers(tmp_path):
    hf_dir, hf = hf_tiny_deepseek(tmp_path / "hf", seed=3)
    lm, _ = load_native(hf_dir, expert_dispatch="grouped")
    ids = np.random.default_rng(2).integers(0, VOCAB, 10)
    i, p, s = packed_inputs([[ids]])
    err = np.abs(lm(Tensor(i), Tensor(p), Tensor(s))[0].asnumpy()[0] - hf_logits(hf, ids)).max()
    assert err < 1e-4, err


def test_packed_samples_match_separate_runs_with_dynamic_shapes(default_model):
    _, hf, lm, _ = default_model
    rng = np.random.default_rng(5)
    a, b, c = (rng.integers(0, VOCAB, n) for n in (7, 5, 9))
    for rows in ([[a, b], [c]], [[c, a]]):  # two layouts, two lengths: one compiled graph (with the logits test's)
        i, p, s = packed_inputs(rows)
        out = lm(Tensor(i), Tensor(p), Tensor(s))[0].asnumpy()
        for r, row in enumerate(rows):
            at = 0
            for sample in row:
                got = out[r, at:at + len(sample)]
                np.testing.assert_allclose(got, hf_logits(hf, sample), atol=1e-4, rtol=0)
                at += len(sample)
    assert len(lm.compile_cache) == 1


def test_router_matches_transformers_topk_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from mindvl_ms.models.moe_router import TopkRouter

    cfg = DeepseekV3Config(**{**BASE, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
                              "topk_group": 2})
    torch.manual_seed(0)
    ref = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        ref.weight.normal_(0, 0.5)
        ref.e_score_correction_bias.normal_(0, 0.1)
    tc = text_from_hf(cfg.to_dict())
    ours = TopkRouter(cfg.hidden_size, tc.moe)
    ours.weight.set_data(Tensor(ref.weight.detach().numpy()))
    ours.e_score_correction_bias.set_data(Tensor(ref.e_score_correction_bias.numpy()))
    x = np.random.randn(64, cfg.hidden_size).astype(np.float32)
    ref_idx, ref_w = ref(torch.tensor(x))
    idx, w, _ = ours(Tensor(x))
    order_ref = np.argsort(ref_idx.numpy(), -1)
    order = np.argsort(idx.asnumpy(), -1)
    np.testing.assert_array_equal(np.take_along_axis(idx.asnumpy(), order, -1),
                                  np.take_along_axis(ref_idx.numpy(), order_ref, -1))
    np.testing.assert_allclose(np.take_along_axis(w.asnumpy(), order, -1),
                               np.take_along_axis(ref_w.detach().numpy(), order_ref, -1), rtol=1e-6, atol=1e-7)


def test_mrope_on_rope_dims_matches_qwen2_5_vl_rotation():
    """Distinct t/h/w positions: our cos/sin + rotate-half equals transformers' apply_multimodal_rotary_pos_emb."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_multimodal_rotary_pos_emb

    rope, section, theta = 16, [2, 3, 3], 10000.0
    b, heads, length = 2, 3, 6
    pos = np.random.randint(0, 50, (3, b, length)).astype(np.int32)
    q = np.random.randn(b, heads, length, rope).astype(np.float32)
    inv = 1.0 / theta ** (np.arange(0, rope, 2, dtype=np.float32) / rope)
    freqs = pos[..., None].astype(np.float32) * inv  # [3, B, L, rope/2]
    emb = np.concatenate([freqs, freqs], -1)
    ref_q, _ = apply_multimodal_rotary_pos_emb(torch.tensor(q), torch.tensor(q), torch.tensor(np.cos(emb)),
                                               torch.tensor(np.sin(emb)), section)
    cos, sin = MRotaryEmbedding(rope, theta, section)(Tensor(pos))
    ours = ApplyRotary()(Tensor(q), cos, sin).asnumpy()
    np.testing.assert_allclose(ours, ref_q.numpy(), atol=2e-5, rtol=1e-5)
