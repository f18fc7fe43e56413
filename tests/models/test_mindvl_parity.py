"""Parity of the MindSpore MindVL model with transformers 4.57.1 (fp32, CPU, tiny random models).

Vision tower output, full logits for 0, 1 and 3 images of different odd sizes (padded batch rows and one
packed row), a Qwen3ForCausalLM checkpoint, and one compile for all of them.
"""
import numpy as np
import pytest
import torch

import mindspore as ms
from mindspore import Tensor

from tests.support import hf_tiny as hf_tiny
from tests.support import infer_tiny as infer_tiny
from mindvl_ms.data.collate import build_model_inputs, model_args
from mindvl_ms.checkpoint.pretrained import load_pretrained
from mindvl_ms.models.mindvl import MindVLModel

SIZES = [[], [(28, 56)], [(28, 56), (112, 84), (252, 196)]]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_pair():
    """The infer tests' shared tiny pair (tests/support/infer_tiny.py: the hf_tiny checkpoint, transformers'
    model and the MindSpore model with dynamic inputs), so a process that runs both compiles the full
    forward graph once."""
    path, hf, model, _ = infer_tiny.setup()
    return path, hf, model


def _samples(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for sizes in SIZES:
        ids, pv, grid = hf_tiny.image_sample(rng, sizes)
        out.append({"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid, "labels": ids.copy()})
    return out


def _hf_logits(hf, s):
    kw = {"input_ids": torch.tensor(s["input_ids"][None])}
    if s["pixel_values"] is not None:
        kw.update(pixel_values=torch.tensor(s["pixel_values"]), image_grid_thw=torch.tensor(s["image_grid_thw"]))
    with torch.no_grad():
        return hf(**kw).logits[0].numpy()


def test_vision_tower_matches_hf(hf_pair):
    _, hf, model = hf_pair
    s = _samples()[2]
    batch = build_model_inputs([[s]], model.config)
    names = ["pixel_values", "vision_pos_ids", "window_index", "reverse_index", "window_segment_ids",
             "full_segment_ids"]
    ours = model.visual(*[Tensor(batch[k][0]) for k in names]).asnumpy()  # the one row's arrays
    with torch.no_grad():
        ref = hf.model.visual(torch.tensor(s["pixel_values"]), torch.tensor(s["image_grid_thw"])).numpy()
    assert ours.shape == ref.shape == (int(s["image_grid_thw"].prod(1).sum()) // 4, 64)
    assert np.abs(ours - ref).max() <= TOL


def test_logits_match_hf_batched_and_packed(hf_pair):
    _, hf, model = hf_pair
    samples = _samples()
    refs = [_hf_logits(hf, s) for s in samples]
    # three padded rows (0, 1 and 3 images), then the same samples packed into one row
    for rows in ([[s] for s in samples], [samples]):
        batch = build_model_inputs(rows, model.config)
        logits = model(*model_args(batch))[0].asnumpy()
        k = 0
        for r, row in enumerate(rows):
            col = 0
            for s in row:
                n = len(s["input_ids"])
                err = np.abs(logits[r, col:col + n] - refs[k]).max()
                assert err <= TOL, (r, k, err)
                col, k = col + n, k + 1
    assert len(model.compile_cache) == 1  # every shape above ran on one compiled graph


def test_no_recompile_between_different_inputs(hf_pair):
    _, _, model = hf_pair
    rng = np.random.default_rng(5)
    before = len(model.compile_cache)
    for sizes in ([(56, 84)], [(140, 28), (28, 28)]):
        ids, pv, grid = hf_tiny.image_sample(rng, sizes, text_len=3 + len(sizes))
        model(*model_args(build_model_inputs([[{"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid}]],
                                             model.config)))
    assert len(model.compile_cache) == before == 1


def test_image_token_count_mismatch_is_an_error(hf_pair):
    _, _, model = hf_pair
    ids, pv, grid = hf_tiny.image_sample(np.random.default_rng(1), [(28, 56)])
    ids = np.concatenate([ids, [hf_tiny.IMAGE]])
    with pytest.raises(ValueError, match="image tokens"):
        build_model_inputs([[{"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid}]], model.config)
    with pytest.raises(ValueError, match="3 image tokens but its images give 0"):
        build_model_inputs([[{"input_ids": ids}]], model.config)


def test_qwen3_causal_lm_matches_hf(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mindvl_ms.checkpoint.hf import read_config_json
    from mindvl_ms.checkpoint.pretrained import load_into
    from mindvl_ms.checkpoint.io import read_tensors
    from mindvl_ms.config.model import text_from_hf
    from mindvl_ms.models.text import TextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    hf = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "q3")
    text_cfg = text_from_hf(read_config_json(str(tmp_path / "q3")))
    assert text_cfg.model_type == "qwen3" and text_cfg.use_qk_norm and not text_cfg.attention_bias
    ours = TextForCausalLM(text_cfg)
    load_into(ours, read_tensors(str(tmp_path / "q3")))
    ids = np.random.default_rng(0).integers(0, 256, (2, 11))
    pos = np.broadcast_to(np.arange(11), (3, 2, 11)).astype(np.int32)
    seg = np.ones((2, 11), np.int32) * np.array([[1], [2]], np.int32)
    logits = ours(Tensor(ids.astype(np.int32)), Tensor(pos), Tensor(seg))[0].asnumpy()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(logits - ref).max() <= TOL


def test_fp16_forward_close_to_fp32(hf_pair):
    path, _, model = hf_pair
    from mindvl_ms.models.mindvl import cast_params

    s = _samples()[1]
    batch = build_model_inputs([[s]], model.config)
    ref = model(*model_args(batch))[0].asnumpy()
    half = cast_params(load_pretrained(MindVLModel, path), ms.float16)
    assert all(p.dtype == ms.float16 for p in half.get_parameters())
    out = half(*model_args(batch))[0].asnumpy()
    assert out.dtype == np.float32
    assert np.abs(out - ref).max() < 2e-2 * max(1.0, np.abs(ref).max())


def test_training_loss_matches_hf_loss(hf_pair):
    """Token-mean loss of the train step's loss cell on a labelled multi-image batch equals HF's loss."""
    from mindvl_ms.train.loss import TrainLoss

    _, hf, model = hf_pair
    s = dict(_samples()[2])
    labels = s["input_ids"].copy()
    labels[:7] = -100  # an unsupervised prompt
    labels[labels == hf_tiny.IMAGE] = -100
    s["labels"] = labels
    batch = build_model_inputs([[s]], model.config)
    logits = model(*model_args(batch))[0]
    n_sup = float((batch["targets"] != -100).sum())
    ours = TrainLoss("token_mean")(logits, Tensor(batch["targets"]), Tensor(batch["segment_ids"]),
                                   Tensor(batch["token_index"]), Tensor(n_sup, ms.float32),
                                   Tensor(1.0, ms.float32)).asnumpy()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(s["input_ids"][None]), pixel_values=torch.tensor(s["pixel_values"]),
                 image_grid_thw=torch.tensor(s["image_grid_thw"]), labels=torch.tensor(labels[None])).loss.item()
    assert abs(float(ours) - ref) <= 1e-5
