"""research/shape_views: the probe reads easy-VQA images as the demo does, its table's figures are the
curves' (hand-made curves, hand-computed means), and seeds stacked in one process train as each seed's model
alone does."""
import numpy as np
import pytest

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


def test_stacked_seeds_train_as_the_per_seed_models_do():
    """Seeds stacked in one process (`stack`, `seed_losses`, `train`) against today's per-seed model trained
    alone (`model`, its own AdamW, batches from its own default_rng(seed)), for a mean-pool arm and a 4-layer
    decoder arm on easy-VQA test images (600 to train on, 280 to score): the same initial weights bit for
    bit, each seed's own gradient, the same loss at every step up to float32 rounding and the same test
    accuracy."""
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(1)
    x, y = shape_views.load("test")
    data = ((x[:600], y[:600]), (x[600:], y[600:]))
    seeds, steps = (0, 1), 6

    def alone(arm, seed):  # today's run of one seed: init, first gradient, loss per step, accuracy at the end
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        (x_tr, y_tr), (x_te, y_te) = [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in data]
        net = shape_views.model(arm, 64, 1176)
        init = {n: p.detach().clone() for n, p in net.named_parameters()}
        vision = [p for n, p in net.named_parameters() if n.split(".")[0] in ("embed", "pos", "blocks")]
        rest = [p for n, p in net.named_parameters() if n.split(".")[0] not in ("embed", "pos", "blocks")]
        spec = shape_views.ARMS[arm]
        opt = torch.optim.AdamW([{"params": vision, "lr": spec["lr"]}, {"params": rest, "lr": spec["rest_lr"]}],
                                weight_decay=0.1)
        losses, grad = [], None
        for _ in range(steps):
            idx = torch.tensor(rng.integers(0, len(y_tr), 32))
            loss = F.cross_entropy(net(x_tr[idx]), y_tr[idx])
            opt.zero_grad()
            loss.backward()
            grad = grad or {n: p.grad.clone() for n, p in net.named_parameters()}
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            acc = float((net(x_te).argmax(-1) == y_te).float().mean())
        return init, grad, losses, acc

    data1 = [(shape_views.one_frame(a), b) for a, b in data]
    for arm in ("mean pool, LR 4e-3", "merger, 4-layer decoder"):
        ref = [alone(arm, s) for s in seeds]
        p = shape_views.stack(arm, seeds, 64, 1176)
        for i, (init, _, _, _) in enumerate(ref):
            assert all(torch.equal(p[n][i], w) for n, w in init.items())      # bit-identical init
        idx = torch.from_numpy(np.stack([np.random.default_rng(s).integers(0, 600, 32) for s in seeds]))  # batch 1
        x1, y1 = torch.from_numpy(data1[0][0])[idx], torch.from_numpy(data1[0][1])[idx]
        shape_views.seed_losses(arm, p, x1, y1).sum().backward()
        for i, (_, grad, _, _) in enumerate(ref):                              # each seed's first gradient: its own
            for n, g in grad.items():
                assert torch.allclose(p[n].grad[i], g, rtol=1e-3, atol=1e-6), (arm, n)
        got = []
        curves = shape_views.train(arm, seeds, 32 * steps, data1, every=32 * steps, on_step=got.append)
        got, want = np.array(got), np.array([r[2] for r in ref]).T             # [steps, seeds]
        assert got.shape == want.shape == (steps, len(seeds))
        assert (np.abs(got - want) <= 2e-5 * want).all()                       # observed: <= 4e-6 of the loss
        assert np.abs(got[:, 0] - want[:, 1]).max() > 1e-2                      # and the seeds' losses differ
        for s, r in zip(seeds, ref):
            assert curves[s] == [{"views": 32 * steps, "acc": r[3]}]
            assert 0.2 < r[3] < 0.8                                             # a real score of 280 images


def test_one_frame_keeps_the_first_of_the_repeated_frames():
    x = np.random.default_rng(0).normal(size=(2, 3, 3, 1, 196)).astype(np.float32).repeat(2, 3).reshape(2, 3, 1176)
    assert np.array_equal(shape_views.one_frame(x), x.reshape(2, 3, 3, 2, 196)[:, :, :, 0].reshape(2, 3, 588))
    x[1, 2, 300] += 1   # a second frame that differs: not a still image
    with pytest.raises(ValueError):
        shape_views.one_frame(x)
