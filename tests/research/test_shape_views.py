"""research/shape_views: the probe reads easy-VQA images as the demo does, and its table's figures are the
curves' (hand-made curves, hand-computed means)."""
import numpy as np

from tests.research.helpers import load

shape_views = load("shape_views/run.py", "research_shape_views")


def test_images_are_the_demos_64_patches_and_labels_are_its_shapes():
    x, y = shape_views.load("test")
    assert x.shape == (880, 64, 1176) and x.dtype == np.float32   # 112x112 px: 8x8 patches of 2x3x14x14
    assert y.shape == (880,) and set(np.unique(y)) == {0, 1, 2}
    assert np.bincount(y).max() == 310                             # the table's prior: 35.2% of 880


def test_table_reads_the_curves():
    curve = lambda accs: [{"views": 2000 * (i + 1), "acc": a} for i, a in enumerate(accs)]  # noqa: E731
    runs = {}
    for arm in shape_views.ARMS:
        runs[(arm, 0)] = curve([0.4, 0.5, 0.8, 0.92, 0.95])   # 75% at 6,000 views, 90% at 8,000
        runs[(arm, 1)] = curve([0.4, 0.6, 0.7, 0.78, 0.85])   # 75% at 8,000, never 90%
    text = shape_views.table(runs, (0, 1), 10000, 0.352)
    lines = text.splitlines()
    assert lines[0] == "| arm | at 6,000 views | at 10,000 | views to 75% | views to 90% |"
    # at 6,000: 0.8 and 0.7 -> 75.0 ± 7.1; at 10,000: 0.95 and 0.85 -> 90.0 ± 7.1; 75% at 6,000 and 8,000
    assert lines[2] == "| mean pool, LR 4e-3 | 75.0 ± 7.1 | 90.0 ± 7.1 | 7000 ± 1414 | 1 of 2 seeds |"
    assert len(lines) == 2 + len(shape_views.ARMS) + 2
    assert "most frequent shape: 35.2%" in text


def test_every_arm_maps_64_patches_to_three_logits_through_its_path():
    import torch

    sizes = {}
    for arm, spec in shape_views.ARMS.items():
        net = shape_views.model(arm, 64, 1176)
        assert net(torch.zeros(2, 64, 1176)).shape == (2, 3)
        sizes[arm] = sum(p.numel() for p in net.parameters())
        assert hasattr(net, "merger") == (spec["path"] != "mean")
        assert len(getattr(net, "layers", [])) == spec.get("layers", 0)
        if spec.get("init"):  # the project's init: N(0, std) weights, zero biases
            w = net.layers[0].up.weight.detach().numpy()
            assert abs(w.std() / spec["init"] - 1) < 0.1 and not net.layers[0].up.bias.detach().numpy().any()
    # the ViT with its head: embed 1176x64+64, positions 64x64, 2 blocks (2 norms, qkv, proj, 3 MLP linears)
    block = 2 * 64 + (64 * 192 + 192) + (64 * 64 + 64) + 2 * (64 * 128 + 128) + (128 * 64 + 64)
    assert sizes["mean pool, LR 4e-3"] == 1176 * 64 + 64 + 64 * 64 + 2 * block + 64 * 3 + 3
