"""(f) How many question views easy-VQA needs: the easy-VQA package's own model, as a reference for the
demo's VQA target (docs/DEMO.md, "How many views easy-VQA needs").

    python research/easy_vqa_reference/run.py [--seeds 0 1 2] [--views 600000] [--smoke]

The model of easy-VQA's write-up: a 2-layer CNN on the 64x64 image (conv 8, pool, conv 16, pool, dense
32 tanh), a bag-of-words question branch (dense 32 tanh, dense 32 tanh), the two multiplied
(the comparison of the question's word with the image is built in), dense 32 tanh, softmax over the 13
answers. Glorot-uniform init as in Keras (torch's default init stayed at the wording prior in a 400k-view
run), Adam 5e-4, batches of 32 questions drawn with replacement from easy-VQA's 38,575 train questions
(its own mix, 73% yes/no). Every 20,000 question views: exact match on all 9,673 test questions, per
question type. Writes results.json, results.md and views.png here.

torch, one process on one CPU thread, so it runs beside other work. The seeds train together as one stacked
model (`Ensemble`): each layer is one op over all the seeds (grouped convolutions, batched matmuls), and
seed by seed it is the model trained alone, up to float rounding: the same initial weights (`seed_model`),
the same batches (a numpy default_rng(seed) per seed), the gradient of its own mean loss and its own Adam
state. The evaluation runs the CNN once per test image (the 9,673 questions ask about 1,000 images) and
gathers the image features per question. tests/research/test_easy_vqa_reference.py checks the stacked run
against per-seed models trained alone.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from mindvl_ms.recipes.demo.vqa_data import VQA_TYPES as TYPES, answer_type  # noqa: E402  (the demo's question types)

HERE = os.path.dirname(os.path.abspath(__file__))
EVERY = 20000
VIEWS = 600000
SMOKE_VIEWS = 20000


def load(split, answers):
    """(questions, answer ids, image rows, images float32[n, 3, 64, 64] in [-0.5, 0.5])."""
    import easy_vqa
    from PIL import Image

    qs, ans, ids = getattr(easy_vqa, f"get_{split}_questions")()
    paths = getattr(easy_vqa, f"get_{split}_image_paths")()
    keys = sorted(paths)
    row = {k: i for i, k in enumerate(keys)}
    imgs = np.stack([np.asarray(Image.open(paths[k]).convert("RGB"), np.float32) / 255 - 0.5 for k in keys])
    return qs, np.array([answers.index(a) for a in ans]), np.array([row[i] for i in ids]), imgs.transpose(0, 3, 1, 2)


def bag_of_words(qs, vocab):
    x = np.zeros((len(qs), len(vocab)), np.float32)
    for r, q in enumerate(qs):
        for w in q.rstrip("?").split():
            x[r, vocab[w]] = 1.0
    return x


def seed_model(seed, n_words, n_ans):
    """Seed `seed`'s model as torch modules (cnn, bow, head): torch.manual_seed(seed), then built and
    Glorot-initialised in this order, so its initial weights depend on the seed alone, not on the models
    built before it."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(16 * 16 * 16, 32), nn.Tanh())  # [B, 32]
    bow = nn.Sequential(nn.Linear(n_words, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())  # [B, 32]
    head = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, n_ans))
    for m in nn.ModuleList([cnn, bow, head]).modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    return cnn, bow, head


def seed_logits(model, im, b):
    """A `seed_model`'s logits [B, answers] for images [B, 3, 64, 64] and bags of words [B, words]."""
    cnn, bow, head = model
    return head(cnn(im) * bow(b))


# The layers the ensemble stacks: name -> where `seed_model` keeps it ((cnn, bow, head) index, Sequential index)
LAYERS = {"conv1": (0, 0), "conv2": (0, 3), "image": (0, 7), "bow1": (1, 0), "bow2": (1, 2), "mix": (2, 0),
          "out": (2, 2)}
DENSE = ("image", "bow1", "bow2", "mix", "out")


class Ensemble:
    """The `seed_model`s of S seeds as one model whose every layer is one op over all the seeds: each
    layer's weights stacked over the seeds (`p`; `seed_weights(i)` gives seed i's back).

    - The convolutions are grouped, one group per seed: the input holds seed i's images in channels
      3i..3i+2 (`stack_images`), and conv1's weight is the seeds' [8, 3, 3, 3] weights one after the other
      (conv2's likewise). Channels-last: oneDNN's fast layout for so few channels.
    - Each max-pool comes before its ReLU. Max and ReLU commute, and the pool's first maximum is the one it
      picks after the ReLU whenever that maximum is positive (otherwise the ReLU's gradient is 0 either
      way), so values and gradients are those of conv, ReLU, pool, with the ReLU on a quarter of the values.
    - The dense layers are batched matmuls, weights [S, in, out] and biases [S, 1, out]. The image's dense
      layer reads its 4,096 inputs in channels-last order (row, column, channel), its weight permuted to it.
    Adam is elementwise, so Adam on the stacked tensors is every seed's own Adam.
    """

    def __init__(self, models):
        import torch

        self.n = len(models)
        self.p = {}
        for name, (i, j) in LAYERS.items():
            ws = [m[i][j].weight.detach() for m in models]
            bs = [m[i][j].bias.detach() for m in models]
            if name in DENSE:
                if name == "image":  # [32, (c, h, w)] -> [(h, w, c), 32]
                    ws = [w.view(32, 16, 16, 16).permute(2, 3, 1, 0).reshape(4096, 32) for w in ws]
                else:
                    ws = [w.t() for w in ws]
                w, b = torch.stack(ws).contiguous(), torch.stack([b[None] for b in bs])
            else:
                w, b = torch.cat(ws).contiguous(memory_format=torch.channels_last), torch.cat(bs)
            self.p[name + ".weight"], self.p[name + ".bias"] = w.requires_grad_(), b.requires_grad_()

    def parameters(self):
        return list(self.p.values())

    def seed_weights(self, i, grads=False):
        """Seed i's weights (or, with grads, their gradients): {layer: (weight, bias)} in `seed_model`'s layouts."""
        out = {}
        for name in LAYERS:
            w, b = (self.p[name + k].grad if grads else self.p[name + k].detach() for k in (".weight", ".bias"))
            if name == "image":
                out[name] = w[i].view(16, 16, 16, 32).permute(3, 2, 0, 1).reshape(32, 4096), b[i, 0]
            elif name in DENSE:
                out[name] = w[i].t(), b[i, 0]
            else:
                k = len(b) // self.n
                out[name] = w[i * k:(i + 1) * k], b[i * k:(i + 1) * k]
        return out

    def images(self, x):
        """Every seed's image features [S, B, 32] from x [B, S * 3, 64, 64] (`stack_images`)."""
        import torch
        from torch.nn import functional as F

        p, b = self.p, x.shape[0]
        for conv in ("conv1", "conv2"):
            x = F.conv2d(x, p[conv + ".weight"], p[conv + ".bias"], padding=1, groups=self.n)
            x = F.relu(F.max_pool2d(x, 2))
        x = x.permute(0, 2, 3, 1).reshape(b, 256, self.n, 16).permute(2, 0, 1, 3).reshape(self.n, b, 4096)
        return torch.tanh(self.dense("image", x))

    def dense(self, name, x):
        import torch

        return torch.baddbmm(self.p[name + ".bias"], x, self.p[name + ".weight"])

    def logits(self, img, bow):
        """Every seed's logits [S, B, answers] from its image features [S, B, 32] and bags of words [S, B, words]."""
        import torch

        q = torch.tanh(self.dense("bow2", torch.tanh(self.dense("bow1", bow))))
        return self.dense("out", torch.tanh(self.dense("mix", img * q)))

    def backward(self, x, bow, y):
        """Every seed's mean cross-entropy on its batch (x [B, S * 3, 64, 64], bow [S, B, words], y [S, B]),
        float[S]; backpropagates their sum, so each seed's weights get the gradient of its own mean loss."""
        from torch.nn import functional as F

        z = self.logits(self.images(x), bow)
        losses = F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none").view(self.n, -1).mean(1)
        losses.sum().backward()
        return losses.detach().numpy()


def stack_images(im, rows, n):
    """The ensemble's input [B, n * 3, 64, 64] (channels-last) from images im [N, 3, 64, 64]: with rows
    [B, n], seed i's image b is im[rows[b, i]]; with rows [B], every seed's image b is im[rows[b]]."""
    import torch

    x = im[rows] if rows.dim() == 2 else im[rows].unsqueeze(1).expand(-1, n, -1, -1, -1)
    return x.reshape(len(rows), n * 3, 64, 64).contiguous(memory_format=torch.channels_last)


def keep_freed_memory():
    """Keep freed memory in the process's heap (glibc's mmap and trim thresholds at 1 GiB): a step's
    activations and gradients, a few MB each, then reuse pages instead of mapping and faulting in fresh
    ones every step. Nothing off glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


def train(seeds, views, data, on_step=None):
    """Train every seed of `seeds` at once, as one `Ensemble` on one thread: each seed's model built as if
    alone (`seed_model`), its batches drawn from its own np.random.default_rng(seed), the loss the sum of the
    seeds' mean cross-entropies (so each seed's gradient is its own), Adam on the stacked weights: seed by
    seed the run of a model trained alone. `on_step(losses)`, if given, gets the seeds' losses (float[S])
    after every step. Returns {seed: held-out accuracy (all, per type) every EVERY question views}."""
    import torch

    torch.set_num_threads(1)
    (b_tr, y_tr, i_tr, im_tr), (b_te, y_te, i_te, im_te), kinds, n_ans = data
    n = len(seeds)
    ens = Ensemble([seed_model(s, b_tr.shape[1], n_ans) for s in seeds])
    opt = torch.optim.Adam(ens.parameters(), lr=5e-4, foreach=True)  # foreach: the same arithmetic, fewer ops
    rngs = [np.random.default_rng(s) for s in seeds]
    b_tr, y_tr, i_tr, im_tr = (torch.from_numpy(np.ascontiguousarray(a)) for a in (b_tr, y_tr, i_tr, im_tr))
    # The CNN reads the image alone: each test image once, its features then gathered per question
    images, per_question = np.unique(i_te, return_inverse=True)
    im_te = torch.from_numpy(np.ascontiguousarray(im_te[images]))
    per_question = torch.from_numpy(per_question.reshape(-1))
    b_te = torch.from_numpy(np.ascontiguousarray(b_te)).expand(n, -1, -1)
    t0 = time.time()

    def step():
        idx = torch.from_numpy(np.stack([rng.integers(0, len(y_tr), 32) for rng in rngs]))  # [S, 32]
        opt.zero_grad()
        losses = ens.backward(stack_images(im_tr, i_tr[idx.t()], n), b_tr[idx], y_tr[idx])
        opt.step()
        if on_step is not None:
            on_step(losses)

    def evaluate(seen):
        with torch.no_grad():
            img = torch.cat([ens.images(stack_images(im_te, torch.arange(i, min(i + 200, len(im_te))), n))
                             for i in range(0, len(im_te), 200)], 1)  # [S, test images, 32]
            pred = torch.cat([ens.logits(img[:, per_question[i:i + 2000]], b_te[:, i:i + 2000]).argmax(-1)
                              for i in range(0, len(y_te), 2000)], 1).numpy()  # [S, test questions]
        points = []
        for seed, p in zip(seeds, pred):
            ok = p == y_te
            points.append({"all": float(ok.mean()), **{k: float(ok[kinds == k].mean()) for k in TYPES}})
            print(f"seed {seed} views {seen:7d} " + " ".join(f"{k} {v:.3f}" for k, v in points[-1].items())
                  + f" ({time.time() - t0:.0f}s)", flush=True)
        return {"seeds": points}

    curve = common.train_views(step, evaluate, views, EVERY)
    return {seed: [{"views": c["views"], **c["seeds"][i]} for c in curve] for i, seed in enumerate(seeds)}


def plot(curves):
    """views.png: held-out exact match per question type against question views, one line per seed."""
    plt = common.plt()
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2), sharey=True)
    for ax, key in zip(axes, ("all",) + TYPES):
        for s, c in curves.items():
            ax.plot([p["views"] / 1000 for p in c], [100 * p[key] for p in c], label=f"seed {s}")
        ax.axhline(90, color="grey", lw=0.5)
        ax.set_title(key)
        ax.set_xlabel("question views (thousands)")
    axes[0].set_ylabel("held-out exact match (%)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(common.results_dir(HERE), "views.png"), dpi=80)


def main():
    import easy_vqa

    keep_freed_memory()
    args = common.parse_args(__doc__, add=lambda ap: ap.add_argument(
        "--views", type=int, default=None, help=f"question views per seed (batches of 32; default {VIEWS}, "
                                                f"--smoke {SMOKE_VIEWS})"))
    views = common.check_views(args.views or (SMOKE_VIEWS if args.smoke else VIEWS), EVERY)
    answers = easy_vqa.get_answers()
    q_tr, y_tr, i_tr, im_tr = load("train", answers)
    q_te, y_te, i_te, im_te = load("test", answers)
    vocab = {w: i for i, w in enumerate(sorted({w for q in q_tr + q_te for w in q.rstrip("?").split()}))}
    kinds = np.array([answer_type(answers[y]) for y in y_te])
    data = ((bag_of_words(q_tr, vocab), y_tr, i_tr, im_tr), (bag_of_words(q_te, vocab), y_te, i_te, im_te),
            kinds, len(answers))
    n = len(args.seeds)
    curves = train(args.seeds, views, data)

    keys = (("colour", "colour >= 90% at"), ("yes/no", "yes/no >= 90% at"), ("all", "all >= 90% at"))
    rows = []
    for s, c in curves.items():
        last = c[-1]
        rows.append([s, f"{last['views']:,}", common.pct(last["all"]), common.pct(last["yes/no"]),
                     common.pct(last["colour"]), common.pct(last["shape"]),
                     *(f"{v:,}" if v else "never" for v in (common.first_at(c, k, 0.9) for k, _ in keys))])
    final = {k: [c[-1][k] for c in curves.values()] for k in ("all", "yes/no", "colour", "shape")}
    reached = {k: [common.first_at(c, k, 0.9) for c in curves.values()] for k, _ in keys}
    rows.append(["mean ± sd", "", *(common.fmt(final[k]) for k in ("all", "yes/no", "colour", "shape")),
                 *(common.fmt(v, 1, 0) if all(v) else f"{sum(map(bool, v))}/{n} seeds reach 90%"
                   for v in reached.values())])
    table = common.md_table(["seed", "views", "all", "yes/no", "colour", "shape", *(h for _, h in keys)], rows)
    table += (f"\n\nheld-out exact match (%) on all 9,673 easy-VQA test questions after {views:,} question views, "
              f"seeds {args.seeds}; 'at' = the first evaluation (every {EVERY:,} views) at or above 90%.\n")
    plot(curves)
    common.save(HERE, {"views": views, "seeds": args.seeds, "every": EVERY, "curves": curves}, table)


if __name__ == "__main__":
    main()
