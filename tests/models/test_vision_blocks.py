"""Per-window / per-image vision attention (host-side block gathers) equals the dense N x N mask path and
transformers' Qwen2.5-VL vision tower, in outputs and in gradients."""
import numpy as np
import pytest
import torch

import mindspore as ms
from mindspore import Parameter, Tensor, nn

from tests.support import hf_tiny as hf_tiny
from mindvl_ms.data.collate import build_model_inputs
from mindvl_ms.checkpoint.pretrained import load_pretrained
from mindvl_ms.models.mindvl import MindVLModel

META = ["pixel_values", "vision_pos_ids", "window_index", "reverse_index", "window_segment_ids",
        "full_segment_ids"]
SIZES = [(28, 56), (112, 84), (252, 196)]  # several windows per image (HF tiny: 56 px windows), odd sizes


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path, hf = hf_tiny.tiny_qwen2_5_vl(tmp_path_factory.mktemp("hf"))
    ids, pv, grid = hf_tiny.image_sample(np.random.default_rng(3), SIZES)
    model = load_pretrained(MindVLModel, path)
    batch = build_model_inputs([[{"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid}]], model.config)
    batch = {k: batch[k][0] for k in META + ["window_gather", "full_gather"]}  # the one row: the ViT's inputs
    return hf, model, batch, pv, grid


class _Probe(nn.Cell):
    """sum(visual(...) * w): its gradient w.r.t. the Parameter w is the tower's output itself."""

    def __init__(self, visual, weights):
        super().__init__()
        self.visual, self.w = visual, Parameter(Tensor(weights), name="probe_w")

    def construct(self, *args):
        return (self.visual(*args) * self.w).sum()


def test_blocks_equal_dense_and_hf_outputs_and_gradients(pair):
    hf, model, batch, pv, grid = pair
    assert batch["window_gather"].shape[0] > len(SIZES)  # really several windows per image
    n_out = int(np.prod(grid, 1).sum()) // 4
    w = np.random.default_rng(4).standard_normal((n_out, 64)).astype(np.float32)
    probe = _Probe(model.visual, w)
    params = model.visual.trainable_params()
    grad = ms.grad(probe, None, [probe.w] + params)
    dense = [g.asnumpy() for g in grad(*[Tensor(batch[k]) for k in META])]
    blocks = [g.asnumpy() for g in grad(*[Tensor(batch[k]) for k in META + ["window_gather", "full_gather"]])]
    pt = torch.tensor(pv)
    out = hf.model.visual(pt, torch.tensor(grid))
    hf.zero_grad(set_to_none=True)
    (out * torch.tensor(w)).sum().backward()
    # outputs (the gradient w.r.t. w)
    assert blocks[0].shape == tuple(out.shape)
    assert np.abs(blocks[0] - dense[0]).max() <= 1e-5
    assert np.abs(blocks[0] - out.detach().numpy()).max() <= 1e-5
    # parameter gradients
    ref = dict(hf.model.visual.named_parameters())
    checked = 0
    for p, gd, gb in zip(params, dense[1:], blocks[1:]):
        scale = max(1.0, np.abs(gd).max())
        assert np.abs(gb - gd).max() <= 1e-5 * scale, p.name
        r = ref[p.name.replace("visual.", "", 1)].grad.numpy()
        if r.shape != gb.shape:  # the patch embedding: HF Conv3d [E, C, T, P, P], ours [E, C*T*P*P]
            r = r.reshape(gb.shape)
        assert np.abs(gb - r).max() <= 1e-4 * scale, p.name
        checked += 1
    assert checked == len(params)


def test_rotate_half_matrix_and_qkv_rotary_equal_apply_rotary():
    """The block path's one-pass RoPE over the fused qkv (x @ R, cos/sin with v rows at 1/0) gives
    bit-identical q, k to ApplyRotary's split/neg/concat form and leaves v unchanged."""
    import mindspore as ms
    from mindspore import Tensor

    from mindvl_ms.models.vision import qkv_rotary, rotate_half_matrix
    from mindvl_ms.ops.rotary import ApplyRotary

    rng = np.random.default_rng(0)
    n, h, hd = 5, 2, 8
    x = rng.standard_normal((n, 3, h, hd)).astype(np.float32)
    ang = rng.uniform(-3, 3, (n, hd)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    r = rotate_half_matrix(hd)
    x2 = x.reshape(-1, hd)
    assert np.array_equal(x2 @ r, np.concatenate([-x2[:, hd // 2:], x2[:, :hd // 2]], -1))
    c3, s3 = (t.asnumpy() for t in qkv_rotary(Tensor(cos), Tensor(sin), 1.0, h))
    assert c3.shape == (n, 3, h, hd) and np.all(c3[:, 2] == 1) and np.all(s3[:, 2] == 0)
    assert np.array_equal(c3[:, :, 1], c3[:, :, 0]) and np.array_equal(s3[:, :, 1], s3[:, :, 0])  # every head
    got = x * c3 + (x2 @ r).reshape(x.shape) * s3
    rope = ApplyRotary()
    for i in range(2):
        ref = rope(Tensor(x[:, i]), Tensor(cos[:, None]), Tensor(sin[:, None])).asnumpy()
        np.testing.assert_array_equal(got[:, i], ref)
    np.testing.assert_array_equal(got[:, 2], x[:, 2])
    # the queries may carry the attention scale: their rows scaled, k and v rows unchanged
    cq, sq = (t.asnumpy() for t in qkv_rotary(Tensor(cos), Tensor(sin), 0.125, h))
    np.testing.assert_array_equal(cq[:, 1:], c3[:, 1:])
    np.testing.assert_array_equal(sq[:, 1:], s3[:, 1:])
    np.testing.assert_allclose(x[:, 0] * cq[:, 0] + (x2 @ r).reshape(x.shape)[:, 0] * sq[:, 0], got[:, 0] * 0.125,
                               rtol=1e-6, atol=1e-7)
    assert ms.float32 == rope(Tensor(x[:, 0]), Tensor(cos[:, None]), Tensor(sin[:, None])).dtype
