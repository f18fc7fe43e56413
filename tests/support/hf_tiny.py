"""Tiny random transformers models (no download) and matching inputs, shared by the parity tests.

torch and transformers are imported where a model is built, not here: the msrun workers and post-training
helpers that only draw `image_sample` inputs then start without them (docs/PERFORMANCE.md, ## tests).
"""
import numpy as np

IMAGE, VSTART, VEND = 250, 251, 252
VOCAB = 256


def tiny_qwen2_5_vl(tmp_path, seed=0, tie=False):
    """Save a tiny random Qwen2_5_VLForConditionalGeneration (fp32, eager attention); return (dir, model)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3, hidden_act="silu"),
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=10000.0, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         tie_word_embeddings=tie, rms_norm_eps=1e-6),
        image_token_id=IMAGE, video_token_id=253, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        tie_word_embeddings=tie,
    )
    cfg._attn_implementation = "eager"
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # make the random init less uniform (norm weights are ones by default)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "ln_q" in name or name.endswith("norm1.weight") or \
                    name.endswith("norm2.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif p.ndim == 1:
                p.normal_(0, 0.02)
    path = str(tmp_path / "hf_qwen2_5_vl")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def image_sample(rng, sizes, text_len=5, vocab=200):
    """A token sequence with one <|vision_start|><|image_pad|>*n<|vision_end|> block per image size (h, w),
    plus random normalised patches. Returns (ids, pixel_values, grid_thw)."""
    ids, pixels, grids = [], [], []
    for h, w in sizes:
        gh, gw = h // 14, w // 14
        ids += list(rng.integers(0, vocab, text_len)) + [VSTART] + [IMAGE] * (gh * gw // 4) + [VEND]
        pixels.append(rng.standard_normal((gh * gw, 3 * 2 * 14 * 14)).astype(np.float32))
        grids.append([1, gh, gw])
    ids += list(rng.integers(0, vocab, text_len))
    pv = np.concatenate(pixels) if pixels else None
    return np.array(ids, np.int64), pv, (np.array(grids, np.int64) if grids else None)
