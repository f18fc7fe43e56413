"""(f) How many question views easy-VQA needs: the easy-VQA package's own model, as a reference for the
demo's VQA target (docs/DEMO.md, "How many views easy-VQA needs").

    python research/easy_vqa_reference/run.py [--seeds 0 1 2] [--views 600000] [--smoke]

The model of easy-VQA's write-up: a 2-layer CNN on the 64x64 image (conv 8, pool, conv 16, pool, dense
32 tanh), a bag-of-words question branch (dense 32 tanh, dense 32 tanh), the two multiplied
(the comparison of the question's word with the image is built in), dense 32 tanh, softmax over the 13
answers. Glorot-uniform init as in Keras (torch's default init stayed at the wording prior in a 400k-view
run), Adam 5e-4, batches of 32 questions drawn with replacement from easy-VQA's 38,575 train questions
(its own mix, 73% yes/no). Every 20,000 question views: exact match on all 9,673 test questions, per
question type. torch, one process per seed (all at once: three seeds share 2 cores instead of the third running
alone after the first two) on one CPU thread each; ~0.9 s per 1,000 views on an idle core.
Writes results.json, results.md and views.png here.
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


def train(seed, views, data):
    """Held-out accuracy (all, per type) every EVERY question views."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    (b_tr, y_tr, i_tr, im_tr), (b_te, y_te, i_te, im_te), kinds, n_ans = data

    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(16 * 16 * 16, 32), nn.Tanh())  # [B, 32]
    bow = nn.Sequential(nn.Linear(b_tr.shape[1], 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())  # [B, 32]
    head = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, n_ans))
    mods = nn.ModuleList([cnn, bow, head])
    for m in mods.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    opt = torch.optim.Adam(mods.parameters(), lr=5e-4)
    im_tr, im_te = torch.tensor(im_tr), torch.tensor(im_te)

    def logits(im, b):
        return head(cnn(im) * bow(b))

    t0 = time.time()

    def step():
        idx = rng.integers(0, len(y_tr), 32)
        loss = nn.functional.cross_entropy(logits(im_tr[i_tr[idx]], torch.tensor(b_tr[idx])), torch.tensor(y_tr[idx]))
        opt.zero_grad()
        loss.backward()
        opt.step()

    def evaluate(seen):
        with torch.no_grad():
            pred = torch.cat([logits(im_te[i_te[i:i + 1000]], torch.tensor(b_te[i:i + 1000])).argmax(-1)
                              for i in range(0, len(y_te), 1000)]).numpy()
        ok = pred == y_te
        point = {"all": float(ok.mean()), **{k: float(ok[kinds == k].mean()) for k in TYPES}}
        print(f"seed {seed} views {seen:7d} " + " ".join(f"{k} {v:.3f}" for k, v in point.items())
              + f" ({time.time() - t0:.0f}s)", flush=True)
        return point

    return common.train_views(step, evaluate, views, EVERY)


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
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    import easy_vqa

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
    n = len(args.seeds)  # one process per seed, all at once, one thread each (a seed's curve is the same)
    with ProcessPoolExecutor(n, mp_context=get_context("spawn")) as pool:
        curves = dict(zip(args.seeds, pool.map(train, args.seeds, [views] * n, [data] * n)))

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
