"""MindVL-MoE end to end: `mindvl init` (Qwen2.5-ViT + DeepSeek-V3 checkpoints), forward + loss on a mixed
image/text batch, text rows equal to transformers' DeepseekV3ForCausalLM, and the export back bit-exact."""
import numpy as np
import pytest
from mindspore import Tensor, nn

from tests.support import hf_tiny as hf_tiny
from mindvl_ms.checkpoint.hf import convert
from mindvl_ms.checkpoint.pretrained import init_from_pretrained, load_pretrained
from mindvl_ms.checkpoint.io import read_tensors
from mindvl_ms.data.collate import build_model_inputs, model_args
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.train.loss import token_ce
from tests.models.test_moe_parity import hf_logits, hf_tiny_deepseek


@pytest.fixture(scope="module")
def moe_vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_vl")
    vit_dir, _ = hf_tiny.tiny_qwen2_5_vl(root)
    ds_dir, ds = hf_tiny_deepseek(root / "ds", seed=2)
    out = str(root / "native")
    init_from_pretrained(MindVLModel, vit_dir, ds_dir, out, seed=0)
    model = load_pretrained(MindVLModel, out)
    return model, ds, ds_dir, out, root


class _Loss(nn.Cell):
    """The loss with the forward's outputs: one compiled graph serves the forward checks and the loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, *args):
        *inputs, targets = args
        logits, aux, load = self.model(*inputs)
        ce, mask = token_ce(logits, targets)
        return ce.sum() / mask.sum() + aux, logits, aux, load


def test_mixed_batch_forward_loss_and_text_parity(moe_vl):
    model, ds, _, _, _ = moe_vl
    rng = np.random.default_rng(0)
    ids, pv, grid = hf_tiny.image_sample(rng, [(28, 56), (56, 56)])
    image = {"input_ids": ids, "labels": ids.copy(), "pixel_values": pv, "image_grid_thw": grid}
    texts = [rng.integers(0, 200, n) for n in (9, 6)]
    rows = [[image], [{"input_ids": t, "labels": t.copy(), "pixel_values": None, "image_grid_thw": None}
                      for t in texts]]
    batch = build_model_inputs(rows, model.config)
    loss, logits, aux, load = _Loss(model)(*model_args(batch), Tensor(batch["targets"]))
    logits = logits.asnumpy()
    assert logits.shape == (2, batch["input_ids"].shape[1], 256) and np.isfinite(logits).all()
    m = model.config.text.moe
    real = int((batch["segment_ids"] > 0).sum())
    assert load.shape == (2, m.n_routed_experts)
    np.testing.assert_array_equal(load.asnumpy().sum(1), [real * m.num_experts_per_tok] * 2)
    at = 0  # text-only samples use 1D positions, so the MoE LM must equal the HF DeepSeek-V3 model
    for t in texts:
        err = np.abs(logits[1, at:at + len(t)] - hf_logits(ds, t)).max()
        assert err < 1e-4, err
        at += len(t)
    assert np.isfinite(float(loss)) and float(loss) > 0


def test_export_back_to_hf_is_bit_exact_for_the_language_model(moe_vl):
    _, _, ds_dir, native, root = moe_vl
    out = str(root / "hf_out")
    convert(native, out, to="hf")
    original = read_tensors(ds_dir)
    exported = read_tensors(out)
    for k, t in original.items():
        assert k in exported, k
        assert exported[k].data.tobytes() == t.data.tobytes(), k
