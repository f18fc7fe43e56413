"""DPO on the tiny MindVL-MoE (DeepSeek-V3 style LM: its forward returns logits, the sequence-wise aux loss
and the expert load): the post-training step takes the aux-loss path and the margin grows."""
import os
import pytest

from tests.support import hf_tiny as hf_tiny
from tests.support import post as H
from mindvl_ms.config.base import read_yaml

from tests.support.paths import ROOT  # noqa: E402

pytestmark = pytest.mark.slow  # over ~12 s: -m 'not slow' leaves it out, CI runs it


def test_dpo_on_moe_model(tmp_path, monkeypatch):
    moe = read_yaml(os.path.join(ROOT, "configs", "model", "tiny-moe.yaml"))
    # one ViT block and one LM layer, a MoE one: the smallest graph with the aux-loss path
    moe["vision"].update(depth=1, fullatt_block_indexes=[0])
    moe["text"].update(vocab_size=hf_tiny.VOCAB, num_hidden_layers=1)
    moe["text"]["moe"].update(num_nextn_predict_layers=0, first_k_dense_replace=0)
    moe.update({k: H.MODEL[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                        "vision_end_token_id")})
    monkeypatch.setattr(H, "MODEL", moe)
    stage = {"name": "dpo", "type": "dpo", "seq_length": 64, "global_batch_size": 2, "micro_batch_size": 1,
             "max_lr": 5e-3, "warmup_ratio": 0.0, "epochs": None, "max_steps": 3, "weight_decay": 0.0,
             "dpo": {"beta": 0.5}}
    model, _, recs = H.run(str(tmp_path / "m"), stage, lambda *a: H.pair_source(n_ntp=0), plot=False)
    assert model.config.text.model_type == "deepseek_v3" and model.config.text.moe.first_k_dense_replace == 0
    m = [r["margin"] for r in recs]
    assert abs(m[0]) < 1e-4 and m[2] > m[1] > m[0] and all(r["applied"] for r in recs)
