"""(g) How many image views the demo's ViT needs to name easy-VQA's shape when the shape is its only task:
a reference for the demo's shape target (docs/DEMO.md, "Shape needs many image views").

    python research/shape_views/run.py [--seeds 0 1 2] [--views 30000] [--smoke]

The demo scores shape naming at 45-53% after ~19,100 shape-question views (docs/DEMO.md). This asks whether
the vision tower's size is the limit: a torch ViT with the demo ViT's dimensions (configs/model/tiny.yaml
`vision`: 2 pre-norm blocks, hidden 64, 4 heads, gated SiLU MLP of 128; one learned position per patch in
place of the demo's row/column table and 2D RoPE) reads each easy-VQA image as the demo does (the
project's `data.image.patchify` at the demo's 12,544 pixels: 64 patches of 1,176 values), averages its
output over the patches and names the shape (circle, rectangle, triangle) through one linear layer. No LLM,
no question: the shape's cross entropy reaches the ViT directly. AdamW (weight decay 0.1), batches of 32
images drawn with replacement from the 3,542 train images whose questions name both colour and shape
(`recipes/demo/vqa_data.image_attributes`, the images the demo's `vqa_describe` uses), at the demo ViT's
LR (4e-3: multitask 2e-3 x `lr_coefficients: {vision: 2.0}`) and at 1e-3. Every 2,000 views: accuracy on
the 880 test images with both attributes. torch on one CPU thread per process, two processes at once.
Writes results.json and results.md here.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from mindvl_ms.config.data import ImageConfig  # noqa: E402
from mindvl_ms.data.image import patchify  # noqa: E402
from mindvl_ms.recipes.demo.vqa_data import VQA_SHAPES, image_attributes  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EVERY = 2000
VIEWS = 30000
SMOKE_VIEWS = 2000
LRS = (4e-3, 1e-3)
DEMO_PIXELS = 12544  # configs/demo/full.yaml data.image: every image at 112x112


def load(split):
    """(patches float32[n, 64, 1176], shape ids int64[n]) of the split's images with both attributes named."""
    import easy_vqa
    from PIL import Image

    qs, ans, ids = getattr(easy_vqa, f"get_{split}_questions")()
    attrs = image_attributes(qs, ans, ids)
    paths = getattr(easy_vqa, f"get_{split}_image_paths")()
    cfg = ImageConfig(min_pixels=DEMO_PIXELS, max_pixels=DEMO_PIXELS)
    keys = sorted(attrs)
    x = np.stack([patchify(Image.open(paths[k]), cfg)[0] for k in keys])
    return x, np.array([VQA_SHAPES.index(attrs[k][1]) for k in keys], np.int64)


def vit(n_patches, patch_dim, hidden=64, heads=4, ffn=128, depth=2):
    """The probe's model: patch embedding + learned positions, `depth` pre-norm blocks, mean pool, 3 logits."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=1e-6), nn.RMSNorm(hidden, eps=1e-6)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.gate, self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

        def forward(self, x):  # [B, N, E]
            b, n, e = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, heads, e // heads).permute(2, 0, 3, 1, 4)
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, e))
            y = self.norm2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(patch_dim, hidden)
            self.pos = nn.Parameter(torch.randn(n_patches, hidden) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(depth))
            self.head = nn.Linear(hidden, len(VQA_SHAPES))

        def forward(self, x):  # [B, N, 1176] -> [B, 3]
            h = self.embed(x) + self.pos
            for block in self.blocks:
                h = block(h)
            return self.head(h.mean(1))

    return ViT()


def train(seed, lr, views, data):
    """Test accuracy every EVERY image views: [{"views", "acc"}]."""
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    (x_tr, y_tr), (x_te, y_te) = [(torch.tensor(x), torch.tensor(y)) for x, y in data]
    model = vit(x_tr.shape[1], x_tr.shape[2])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    curve, seen, t0 = [], 0, time.time()
    while seen < views:
        idx = torch.tensor(rng.integers(0, len(y_tr), 32))
        loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen += 32
        if seen // EVERY != (seen - 32) // EVERY:
            with torch.no_grad():
                acc = float((model(x_te).argmax(-1) == y_te).float().mean())
            curve.append({"views": seen, "acc": acc})
            print(f"lr {lr:g} seed {seed} views {seen:6d} shape {acc:.3f} ({time.time() - t0:.0f}s)", flush=True)
    return curve


def first(curve, level):
    return next((p["views"] for p in curve if p["acc"] >= level), None)


def at(curve, views):
    """Accuracy at the first evaluation at or after `views`."""
    return next((p["acc"] for p in curve if p["views"] >= views), curve[-1]["acc"])


def table(runs, seeds, views, prior):
    """Per LR: accuracy at 6,000 / 10,000 / 20,000 views and at the end, views to 75% and 90% (mean ± sd)."""
    marks = [m for m in (6000, 10000, 20000) if m < views]
    rows = []
    for lr in LRS:
        curves = [runs[(lr, s)] for s in seeds]
        reach = [[first(c, level) for c in curves] for level in (0.75, 0.9)]
        rows.append([f"{lr:g}", *(common.fmt([at(c, m) for c in curves]) for m in marks),
                     common.fmt([c[-1]["acc"] for c in curves]),
                     *(common.fmt(r, 1, 0) if all(r) else f"{sum(map(bool, r))} of {len(r)} seeds" for r in reach)])
    head = ["ViT LR", *(f"at {m:,} views" for m in marks), f"at {views:,}", "views to 75%", "views to 90%"]
    return (common.md_table(head, rows)
            + f"\n\nshape accuracy (%) on easy-VQA's 880 test images with both attributes named (most frequent "
              f"shape: {100 * prior:.1f}%), mean ± sd over seeds {list(seeds)}; 'views to' = the first evaluation "
              f"(every {EVERY:,} views) at or above the level.\n")


def main():
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    args = common.parse_args(__doc__, add=lambda ap: ap.add_argument(
        "--views", type=int, default=None, help=f"image views per run (batches of 32; default {VIEWS}, "
                                                f"--smoke {SMOKE_VIEWS})"))
    views = args.views or (SMOKE_VIEWS if args.smoke else VIEWS)
    data = (load("train"), load("test"))
    prior = float(np.bincount(data[1][1]).max() / len(data[1][1]))
    jobs = [(lr, s) for lr in LRS for s in args.seeds]
    with ProcessPoolExecutor(min(len(jobs), 2), mp_context=get_context("spawn")) as pool:
        curves = list(pool.map(train, [s for _, s in jobs], [lr for lr, _ in jobs], [views] * len(jobs),
                               [data] * len(jobs)))
    runs = dict(zip(jobs, curves))
    common.save(HERE, {"views": views, "seeds": args.seeds, "every": EVERY, "prior": prior,
                       "curves": {f"lr {lr:g} seed {s}": c for (lr, s), c in runs.items()}},
                table(runs, args.seeds, views, prior))


if __name__ == "__main__":
    main()
