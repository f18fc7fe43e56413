"""research/easy_vqa_reference: the seeds trained together as one stacked ensemble are, seed by seed, the
per-seed torch model trained alone (its modules, its Adam, its batches), up to float rounding; and the
evaluation's one pass per test image gives the per-question evaluation's answers. Small synthetic data:
flat-coloured 64x64 images with a rectangle (ties in the max-pools, as in easy-VQA's images)."""
import numpy as np
import pytest
import torch
from torch.nn import functional as F

from tests.research.helpers import load

ref = load("easy_vqa_reference/run.py", "research_easy_vqa_reference")

SEEDS = (0, 1, 2)
N_WORDS, N_ANS = 10, 13


def images(n, rng):
    """n flat-coloured images [n, 3, 64, 64] in [-0.5, 0.5] (255 levels), each with a rectangle of another colour."""
    im = np.empty((n, 3, 64, 64), np.float32)
    for k in range(n):
        im[k] = (rng.integers(0, 256, (3, 1, 1)) / 255 - 0.5)
        r, c = rng.integers(0, 40, 2)
        im[k, :, r:r + rng.integers(8, 24), c:c + rng.integers(8, 24)] = rng.integers(0, 256, (3, 1, 1)) / 255 - 0.5
    return im


def split(n_questions, n_images, rng):
    """(bags of words, answer ids, image rows, images) as `load` and `bag_of_words` give them; the first
    two images have no question (the evaluation's features per image are gathered by the rows in use)."""
    bow = (rng.random((n_questions, N_WORDS)) < 0.3).astype(np.float32)
    return bow, rng.integers(0, N_ANS, n_questions), rng.integers(2, n_images, n_questions), images(n_images, rng)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as the experiment runs (`train` sets it), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(123)
    train, test = split(64, 10, rng), split(45, 8, rng)
    kinds = np.array([ref.TYPES[k % 3] for k in range(45)])
    return train, test, kinds, N_ANS


def params(model):
    return [p for m in model for p in m.parameters()]


def test_the_ensemble_starts_from_each_seeds_own_weights_bit_for_bit():
    models = [ref.seed_model(s, N_WORDS, N_ANS) for s in SEEDS]
    ens = ref.Ensemble(models)
    for i, s in enumerate(SEEDS):
        alone = ref.seed_model(s, N_WORDS, N_ANS)  # built again: the same weights whatever was built before
        mine = [t for w_b in ens.seed_weights(i).values() for t in w_b]
        assert len(mine) == len(params(alone)) == 14
        for a, b in zip(params(alone), mine):
            assert torch.equal(a.detach(), b)
    assert not torch.equal(params(models[0])[0], params(models[1])[0])  # the seeds differ


def test_each_seeds_gradient_and_adam_step_are_its_own(data):
    """Three steps on each seed's own batches: the stacked loss's gradient, sliced per seed, is the seed's
    own mean loss's gradient (not a third of it), and the stacked Adam's weights follow the per-seed Adam's."""
    (b_tr, y_tr, i_tr, im_tr), _, _, _ = data
    n = len(SEEDS)
    alone = [ref.seed_model(s, N_WORDS, N_ANS) for s in SEEDS]
    opts = [torch.optim.Adam(params(m), lr=5e-4) for m in alone]
    ens = ref.Ensemble([ref.seed_model(s, N_WORDS, N_ANS) for s in SEEDS])
    opt = torch.optim.Adam(ens.parameters(), lr=5e-4, foreach=True)
    rng = np.random.default_rng(7)
    t_im, t_b, t_y = torch.from_numpy(im_tr), torch.from_numpy(b_tr), torch.from_numpy(y_tr)
    for _ in range(3):
        idx = rng.integers(0, len(y_tr), (n, 8))  # seed i's batch: idx[i]
        want = []
        for m, o, ix in zip(alone, opts, idx):
            loss = F.cross_entropy(ref.seed_logits(m, t_im[i_tr[ix]], t_b[ix]), t_y[ix])
            o.zero_grad()
            loss.backward()
            want.append(loss.item())
        t_idx = torch.from_numpy(idx)
        opt.zero_grad()
        losses = ens.backward(ref.stack_images(t_im, torch.from_numpy(i_tr)[t_idx.t()], n), t_b[t_idx], t_y[t_idx])
        np.testing.assert_allclose(losses, want, rtol=1e-6, atol=1e-6)
        for i, m in enumerate(alone):
            for a, b in zip(params(m), [t for w_b in ens.seed_weights(i, grads=True).values() for t in w_b]):
                scale = float(a.grad.abs().max()) + 1e-12
                assert float((a.grad - b).abs().max()) <= 1e-4 * scale
        for o in opts:
            o.step()
        opt.step()
        for i, m in enumerate(alone):
            for a, b in zip(params(m), [t for w_b in ens.seed_weights(i).values() for t in w_b]):
                assert float((a.detach() - b).abs().max()) < 1e-5  # an Adam step is 5e-4


def test_train_is_each_seed_trained_alone_and_evaluated_per_question(data, monkeypatch):
    """`train` (seeds stacked, batches from default_rng(seed), the CNN once per test image) against a plain
    per-seed loop: the same losses step by step and the same held-out answers at each evaluation."""
    (b_tr, y_tr, i_tr, im_tr), (b_te, y_te, i_te, im_te), kinds, _ = data
    monkeypatch.setattr(ref, "EVERY", 64)  # an evaluation every 2 steps
    got_losses = []
    curves = ref.train(list(SEEDS), 128, data, on_step=lambda losses: got_losses.append(np.array(losses)))
    got_losses = np.stack(got_losses)  # [steps, seeds]
    assert got_losses.shape == (4, 3)

    t_im, t_b, t_y = torch.from_numpy(im_tr), torch.from_numpy(b_tr), torch.from_numpy(y_tr)
    for i, s in enumerate(SEEDS):
        model, rng = ref.seed_model(s, N_WORDS, N_ANS), np.random.default_rng(s)
        opt = torch.optim.Adam(params(model), lr=5e-4)
        want_losses, want_points = [], []
        for step in range(4):
            idx = rng.integers(0, len(y_tr), 32)
            loss = F.cross_entropy(ref.seed_logits(model, t_im[i_tr[idx]], t_b[idx]), t_y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            want_losses.append(loss.item())
            if step % 2 == 1:
                with torch.no_grad():
                    pred = ref.seed_logits(model, torch.from_numpy(im_te[i_te]), torch.from_numpy(b_te)).argmax(-1)
                ok = pred.numpy() == y_te
                want_points.append({"views": 32 * (step + 1), "all": float(ok.mean()),
                                    **{k: float(ok[kinds == k].mean()) for k in ref.TYPES}})
        np.testing.assert_allclose(got_losses[:, i], want_losses, rtol=1e-6, atol=1e-6)
        assert curves[s] == want_points
