"""(g) How many image views the demo's ViT needs to name easy-VQA's shape: trained on the shape alone, and
through the path the demo's answer takes. A reference for the demo's shape target (docs/DEMO.md, "Shape
needs many image views").

    python research/shape_views/run.py [--seeds 0 1 2] [--views 24000] [--smoke]

The demo names the shape 45-53% right after ~19,100 shape-question views (docs/DEMO.md). Is the vision
tower's size the limit, or the way its signal reaches it? Every arm reads each easy-VQA image as the demo
does (the project's `data.image.patchify` at the demo's 12,544 pixels: 64 patches of 1,176 values) into a
torch ViT of the demo ViT's dimensions (configs/model/tiny.yaml `vision`: 2 pre-norm blocks, hidden 64, 4
heads, gated SiLU MLP of 128; one learned position per patch in place of the demo's row/column table and
2D RoPE), and names the shape (circle, rectangle, triangle) with a 3-way linear layer. The arms (`ARMS`)
differ in what sits between the two (`model`) and in the LRs:
- mean pool: the ViT's output averaged over the patches, so the shape's loss reaches the ViT directly; at
  the demo ViT's LR (4e-3: multitask 2e-3 x `lr_coefficients: {vision: 2.0}`) and at 1e-3;
- merger: the demo's 2x2 patch merger to the LLM width (16 tokens), averaged;
- decoder: the demo's path without the words: the merger's 16 tokens, one learned question token after
  them, 1 or 4 causal blocks of the demo LLM's size (width 128, 4 heads, MLP 384), the last position.
  Beyond the ViT, 2e-3 (the demo's) or 4e-3.
Linear layers start from torch's default init, or (last three arms) from the project's: N(0, std) weights
with std = `initializer_range` (0.02, the Hugging Face default; 0.1; 0.2), zero biases.
AdamW (weight decay 0.1), batches of 32 images drawn with replacement from the 3,542 train images whose
questions name both colour and shape (`recipes/demo/vqa_data.image_attributes`). Every 2,000 views:
accuracy on the 880 test images with both attributes. torch, one CPU thread per process, two at once.
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
VIEWS = 24000
SMOKE_VIEWS = 2000
# arm -> the answer's path (`model`), the ViT's LR and the rest's (the demo's multitask stage: 2e-3, the ViT at
# 4e-3 through `lr_coefficients: {vision: 2.0}`), and the std of the project's init where it replaces torch's
ARMS = {
    "mean pool, LR 4e-3": {"path": "mean", "lr": 4e-3, "rest_lr": 4e-3},
    "mean pool, LR 1e-3": {"path": "mean", "lr": 1e-3, "rest_lr": 1e-3},
    "merger, mean": {"path": "merger", "lr": 4e-3, "rest_lr": 2e-3},
    "merger, 1-layer decoder": {"path": "decoder", "layers": 1, "lr": 4e-3, "rest_lr": 2e-3},
    "merger, 4-layer decoder": {"path": "decoder", "layers": 4, "lr": 4e-3, "rest_lr": 2e-3},
    "merger, 4-layer decoder, rest at 4e-3": {"path": "decoder", "layers": 4, "lr": 4e-3, "rest_lr": 4e-3},
    "merger, 4-layer decoder, normal(0.02) init": {"path": "decoder", "layers": 4, "lr": 4e-3, "rest_lr": 2e-3,
                                                   "init": 0.02},
    "merger, 4-layer decoder, normal(0.1) init": {"path": "decoder", "layers": 4, "lr": 4e-3, "rest_lr": 2e-3,
                                                  "init": 0.1},
    "merger, 4-layer decoder, normal(0.2) init": {"path": "decoder", "layers": 4, "lr": 4e-3, "rest_lr": 2e-3,
                                                  "init": 0.2},
}
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


def block(hidden, heads, ffn, causal):
    """A pre-norm transformer block (RMSNorm, attention, gated SiLU MLP), as the demo's ViT and LLM blocks."""
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
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            x = x + self.proj(out.transpose(1, 2).reshape(b, n, e))
            y = self.norm2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    return Block()


def model(arm, n_patches, patch_dim):
    """The probe's model for `arm` (ARMS): the demo ViT's dimensions (patch embedding + learned positions,
    2 blocks of hidden 64, 4 heads, MLP 128), then the arm's path to a 3-way linear layer:
    - "mean": the mean over patches;
    - "merger": the 2x2 patch merger to width 128 (RMSNorm, Linear-GELU-Linear: 16 tokens), their mean;
    - "decoder": the merger's 16 tokens, one learned question token after them, `layers` causal blocks of
      the demo LLM's size (width 128, 4 heads, MLP 384; configs/demo/full.yaml), the last position."""
    import torch
    from torch import nn

    spec = ARMS[arm]

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(patch_dim, 64)
            self.pos = nn.Parameter(torch.randn(n_patches, 64) * 0.02)
            self.blocks = nn.ModuleList(block(64, 4, 128, causal=False) for _ in range(2))
            self.path = spec["path"]
            if self.path != "mean":
                self.merge_norm = nn.RMSNorm(64, eps=1e-6)
                self.merger = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 128))
            if self.path == "decoder":
                self.question = nn.Parameter(torch.randn(1, 1, 128) * 0.02)
                self.text_pos = nn.Parameter(torch.randn(n_patches // 4 + 1, 128) * 0.02)
                self.layers = nn.ModuleList(block(128, 4, 384, causal=True) for _ in range(spec["layers"]))
                self.norm = nn.RMSNorm(128, eps=1e-6)
            self.head = nn.Linear(64 if self.path == "mean" else 128, len(VQA_SHAPES))

        def forward(self, x):  # [B, N, 1176] -> [B, 3]
            h = self.embed(x) + self.pos
            for b in self.blocks:
                h = b(h)
            if self.path == "mean":
                return self.head(h.mean(1))
            img = self.merger(self.merge_norm(h).reshape(h.shape[0], -1, 256))  # [B, N/4, 128]: 2x2 units in order
            if self.path == "merger":
                return self.head(img.mean(1))
            t = torch.cat([img, self.question.expand(h.shape[0], 1, 128)], 1) + self.text_pos
            for layer in self.layers:
                t = layer(t)
            return self.head(self.norm(t[:, -1]))

    net = Probe()
    if spec.get("init"):  # the project's init (`initializer_range`): every linear weight N(0, std), biases 0
        for m in net.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=spec["init"])
                nn.init.zeros_(m.bias)
    return net


def train(arm, seed, views, data):
    """Test accuracy every EVERY image views: [{"views", "acc"}]."""
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    (x_tr, y_tr), (x_te, y_te) = [(torch.tensor(x), torch.tensor(y)) for x, y in data]
    net = model(arm, x_tr.shape[1], x_tr.shape[2])
    vision = [p for n, p in net.named_parameters() if n.split(".")[0] in ("embed", "pos", "blocks")]
    rest = [p for n, p in net.named_parameters() if n.split(".")[0] not in ("embed", "pos", "blocks")]
    opt = torch.optim.AdamW([{"params": vision, "lr": ARMS[arm]["lr"]}, {"params": rest, "lr": ARMS[arm]["rest_lr"]}],
                            weight_decay=0.1)
    t0 = time.time()

    def step():
        idx = torch.tensor(rng.integers(0, len(y_tr), 32))
        loss = F.cross_entropy(net(x_tr[idx]), y_tr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()

    def evaluate(seen):
        with torch.no_grad():
            acc = float((net(x_te).argmax(-1) == y_te).float().mean())
        print(f"{arm} seed {seed} views {seen:6d} shape {acc:.3f} ({time.time() - t0:.0f}s)", flush=True)
        return {"acc": acc}

    return common.train_views(step, evaluate, views, EVERY)


def at(curve, views):
    """Accuracy at the first evaluation at or after `views`."""
    return next((p["acc"] for p in curve if p["views"] >= views), curve[-1]["acc"])


def table(runs, seeds, views, prior):
    """Per arm: accuracy at 6,000 / 10,000 / 20,000 views and at the end, views to 75% and 90% (mean ± sd)."""
    marks = [m for m in (6000, 10000, 20000) if m < views]
    rows = []
    for arm in ARMS:
        curves = [runs[(arm, s)] for s in seeds]
        reach = [[common.first_at(c, "acc", level) for c in curves] for level in (0.75, 0.9)]
        rows.append([arm, *(common.fmt([at(c, m) for c in curves]) for m in marks),
                     common.fmt([c[-1]["acc"] for c in curves]),
                     *(common.fmt(r, 1, 0) if all(r) else f"{sum(map(bool, r))} of {len(r)} seeds" for r in reach)])
    head = ["arm", *(f"at {m:,} views" for m in marks), f"at {views:,}", "views to 75%", "views to 90%"]
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
    views = common.check_views(args.views or (SMOKE_VIEWS if args.smoke else VIEWS), EVERY)
    data = (load("train"), load("test"))
    prior = float(np.bincount(data[1][1]).max() / len(data[1][1]))
    jobs = [(arm, s) for arm in ARMS for s in args.seeds]
    with ProcessPoolExecutor(min(len(jobs), 2), mp_context=get_context("spawn")) as pool:
        curves = list(pool.map(train, [a for a, _ in jobs], [s for _, s in jobs], [views] * len(jobs),
                               [data] * len(jobs)))
    runs = dict(zip(jobs, curves))
    common.save(HERE, {"views": views, "seeds": args.seeds, "every": EVERY, "prior": prior, "arms": ARMS,
                       "curves": {f"{arm}, seed {s}": c for (arm, s), c in runs.items()}},
                table(runs, args.seeds, views, prior))


if __name__ == "__main__":
    main()
