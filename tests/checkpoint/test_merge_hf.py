"""Merging Hugging Face Qwen2.5-VL checkpoints: the result loads in transformers and equals a torch average.

Run: pytest -q tests/checkpoint/test_merge_hf.py
"""
import os

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from mindvl_ms.checkpoint.merge import merge

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})


def _tiny(seed, dtype):
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[1], window_size=56),
        text_config=TEXT, image_token_id=120, video_token_id=121, vision_start_token_id=122, **TEXT)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(cfg).to(dtype).eval()


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_merged_hf_qwen25vl_loads_and_matches_torch_average(tmp_path):
    models = [_tiny(s, torch.bfloat16) for s in range(3)]
    paths = []
    for i, m in enumerate(models):
        p = str(tmp_path / f"sft{i}")
        m.save_pretrained(p, max_shard_size="60KB" if i == 0 else "10GB")  # sharded and single-file inputs
        paths.append(p)
    assert os.path.exists(os.path.join(paths[0], "model.safetensors.index.json"))
    merge(paths, str(tmp_path / "avg"), weights=[0.5, 0.25, 0.25], progress=False)
    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "avg"), torch_dtype=torch.bfloat16)
    got, ps = _params(merged), [_params(m) for m in models]
    assert set(got) == set(ps[0])
    for k, v in got.items():
        assert v.dtype == torch.bfloat16, k
        ref = (0.5 * ps[0][k].float() + 0.25 * ps[1][k].float() + 0.25 * ps[2][k].float()).to(torch.bfloat16)
        assert torch.equal(v, ref), k
    ids = torch.tensor([[1, 5, 9, 17]])
    with torch.no_grad():
        logits = merged(input_ids=ids).logits
    assert torch.isfinite(logits.float()).all()


def test_hf_only_language_model_against_base(tmp_path):
    sft, base = _tiny(0, torch.float32), _tiny(1, torch.float32)
    sft.save_pretrained(str(tmp_path / "sft"))
    base.save_pretrained(str(tmp_path / "base"))
    merge([str(tmp_path / "sft")], str(tmp_path / "out"), method="task_arithmetic", base=str(tmp_path / "base"),
          weights=[0.5], only=["model.layers"], progress=False)
    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "out"))
    got, ps, pb = _params(merged), _params(sft), _params(base)
    n_layers = 0
    for k, v in got.items():
        if ".language_model.layers." in k or k.startswith("model.layers."):
            n_layers += 1
            torch.testing.assert_close(v, pb[k] + 0.5 * (ps[k] - pb[k]), rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(v, ps[k]), k
    assert n_layers > 0
