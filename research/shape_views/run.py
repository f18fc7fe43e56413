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
accuracy on the 880 test images with both attributes. Writes results.json and results.md here.

It runs as one torch process on one CPU thread, so that it can run beside other work: the arms one after
another, each arm's seeds trained together as a stacked ensemble (`train`). Seed i's parameters are slice i
of stacked tensors (`stack`), each linear layer one batched matmul over the seeds (`forward`), the step
minimises the sum of the seeds' mean losses (`seed_losses`) and AdamW updates each element alone, so every
seed keeps the init, the batches (its own np.random.default_rng(seed)), the gradient and the optimizer state
of its model trained alone: the same runs up to float32 rounding (tests/research/test_shape_views.py checks
this against `model` trained alone). Two things cut the work without changing the function: `patchify`
repeats the still image as 2 frames, so the patch embedding reads one frame against the sum of the two
frames' weights (`one_frame`), and the last decoder block computes only the last position, the one the head
reads.
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
CHANNELS, FRAMES = 3, ImageConfig().temporal_patch_size  # a patch: RGB x the still image's T frames x 14 x 14
EVAL_BATCH = 64  # test images per forward


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
      the demo LLM's size (width 128, 4 heads, MLP 384; configs/demo/full.yaml), the last position.
    One seed's model: `stack` builds the run's seeds from it, and `forward` computes it for all of them."""
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


def one_frame(x):
    """Patches float32[n, N, C*T*P*P] (`load`) -> float32[n, N, C*P*P]: their first frame. `patchify` repeats a
    still image as T = temporal_patch_size equal frames, so a patch's product with the embedding's weight is
    its first frame's with the sum of the T frames' weights (`forward`): the same function on 1/T of the data.
    Raises ValueError if the frames differ."""
    v = x.reshape(*x.shape[:2], CHANNELS, FRAMES, -1)  # cut_patches: each patch's values in [C, T, P, P] order
    for i in range(0, len(x), 256):
        if any(not np.array_equal(v[i:i + 256, :, :, 0], v[i:i + 256, :, :, t]) for t in range(1, FRAMES)):
            raise ValueError("the patches' frames differ: not still images")
    return np.ascontiguousarray(v[:, :, :, 0]).reshape(*x.shape[:2], -1)


def stack(arm, seeds, n_patches, patch_dim):
    """{parameter name: the seeds' `model(arm, n_patches, patch_dim)` parameters stacked on a new first axis}:
    each seed's built after torch.manual_seed(seed), as a model of its own, so slice i is seed i's model."""
    import torch

    nets = []
    for seed in seeds:
        torch.manual_seed(seed)
        nets.append(dict(model(arm, n_patches, patch_dim).named_parameters()))
    return {n: torch.stack([net[n].detach() for net in nets]).requires_grad_() for n in nets[0]}


def forward(arm, p, x):
    """`model(arm, ...)`'s forward for S seeds at once on their stacked parameters `p` (`stack`), on patches of
    one frame (`one_frame`): x float32[S, B, N, C*P*P] (seed i's batch in x[i]) or [B, N, C*P*P] (one batch
    for every seed) -> logits [S, B, 3]. Each linear layer is one batched matmul over the seeds (torch.baddbmm)
    and attention batches seeds x images, so S seeds take the kernel launches of one model. The last decoder
    block computes its last position alone: the head reads nothing else."""
    import torch
    from torch.nn import functional as F

    spec = ARMS[arm]
    s = p["pos"].shape[0]

    def linear(name, h):  # [S, ..., in] -> [S, ..., out]
        out = torch.baddbmm(p[name + ".bias"].unsqueeze(1), h.reshape(s, -1, h.shape[-1]),
                            p[name + ".weight"].transpose(1, 2))
        return out.view(*h.shape[:-1], -1)

    def norm(name, h):  # RMSNorm, each seed's weight
        return F.rms_norm(h, (h.shape[-1],), eps=1e-6) * p[name + ".weight"].view(s, *[1] * (h.dim() - 2), -1)

    def block(name, h, heads, causal, last=False):  # block(): h [S, B, N, E]; `last`: the last position's output only
        _, b, n, e = h.shape
        qkv = linear(name + ".qkv", norm(name + ".norm1", h)).view(s * b, n, 3, heads, e // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        if last:  # the last query sees every key, causal or not
            q, h, n, causal = q[:, :, -1:], h[:, :, -1:], 1, False
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        h = h + linear(name + ".proj", out.transpose(1, 2).reshape(s, b, n, e))
        y = norm(name + ".norm2", h)
        return h + linear(name + ".down", F.silu(linear(name + ".gate", y)) * linear(name + ".up", y))

    w = p["embed.weight"]  # [S, 64, C*T*P*P] -> [S, 64, C*P*P]: the T frames' weights summed
    w = w.view(s, w.shape[1], CHANNELS, FRAMES, -1).sum(3).view(s, w.shape[1], -1)
    if x.dim() == 3:  # one batch for every seed: one matmul against the seeds' weights side by side
        b, n, d = x.shape
        h = F.linear(x.reshape(b * n, d), w.reshape(-1, d), p["embed.bias"].reshape(-1))
        h = h.view(b, n, s, -1).permute(2, 0, 1, 3)
    else:  # W @ x^T: the weight's gradient is then grad^T @ x, the faster layout for these wide inputs
        h = torch.baddbmm(p["embed.bias"].unsqueeze(2), w, x.reshape(s, -1, x.shape[-1]).transpose(1, 2))
        h = h.transpose(1, 2).reshape(*x.shape[:-1], -1)
    h = h + p["pos"].unsqueeze(1)
    for i in range(2):
        h = block(f"blocks.{i}", h, 4, False)
    if spec["path"] == "mean":
        return linear("head", h.mean(2))
    h = norm("merge_norm", h)
    img = linear("merger.2", F.gelu(linear("merger.0", h.reshape(s, h.shape[1], -1, 256))))  # [S, B, N/4, 128]
    if spec["path"] == "merger":
        return linear("head", img.mean(2))
    t = torch.cat([img, p["question"].expand(s, img.shape[1], 1, 128)], 2) + p["text_pos"].unsqueeze(1)
    for i in range(spec["layers"]):
        t = block(f"layers.{i}", t, 4, True, last=i == spec["layers"] - 1)
    return linear("head", norm("norm", t[:, :, -1]))


def seed_losses(arm, p, x, y):
    """Each seed's mean cross-entropy on its own batch (x [S, B, N, C*P*P], y [S, B]): float[S]. A seed's
    parameters reach its loss alone, so the gradient of their sum is, seed by seed, the seed's own."""
    from torch.nn import functional as F

    return F.cross_entropy(forward(arm, p, x).flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)


def train(arm, seeds, views, data, every=EVERY, on_step=None):
    """Train `arm` for every seed of `seeds` at once, on one thread, as a stacked ensemble (`stack`,
    `forward`) that is seed by seed the model trained alone: each seed's init (`stack`), its own batches
    (32 images with replacement per step from np.random.default_rng(seed)), its mean loss (the step minimises
    the sum of the seeds' mean losses, so each seed's gradient is its own) and its AdamW state (AdamW is
    elementwise). data: ((x, y) train, (x, y) test), x the patches of one frame (`one_frame`).
    `on_step(losses)`, if given, gets the seeds' losses (float[S]) after every step.
    Returns {seed: test accuracy every `every` image views, [{"views", "acc"}]}."""
    import torch

    torch.set_num_threads(1)
    rngs = [np.random.default_rng(seed) for seed in seeds]
    (x_tr, y_tr), (x_te, y_te) = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in data]
    p = stack(arm, seeds, x_tr.shape[1], x_tr.shape[2] * FRAMES)
    vision = [t for n, t in p.items() if n.split(".")[0] in ("embed", "pos", "blocks")]
    rest = [t for n, t in p.items() if n.split(".")[0] not in ("embed", "pos", "blocks")]
    opt = torch.optim.AdamW([{"params": vision, "lr": ARMS[arm]["lr"]}, {"params": rest, "lr": ARMS[arm]["rest_lr"]}],
                            weight_decay=0.1, fused=True)  # one kernel per tensor: the same update, fewer passes
    t0 = time.time()

    def step():
        idx = torch.from_numpy(np.concatenate([rng.integers(0, len(y_tr), 32) for rng in rngs]))  # seed by seed
        x = torch.index_select(x_tr, 0, idx).view(len(seeds), 32, *x_tr.shape[1:])
        losses = seed_losses(arm, p, x, y_tr[idx].view(len(seeds), 32))
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        if on_step is not None:
            on_step(losses.detach().numpy())

    def evaluate(seen):
        with torch.no_grad():
            right = torch.cat([forward(arm, p, x_te[i:i + EVAL_BATCH]).argmax(-1) == y_te[i:i + EVAL_BATCH]
                               for i in range(0, len(y_te), EVAL_BATCH)], 1)
        accs = [float(a) for a in right.float().mean(1)]
        print(f"{arm} views {seen:6d} shape " + " ".join(f"{a:.3f}" for a in accs)
              + f" (seeds {list(seeds)}, {time.time() - t0:.0f}s)", flush=True)
        return {"acc": accs}

    curve = common.train_views(step, evaluate, views, every)
    return {seed: [{"views": c["views"], "acc": c["acc"][i]} for c in curve] for i, seed in enumerate(seeds)}


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
    import torch

    torch.set_num_threads(1)
    args = common.parse_args(__doc__, add=lambda ap: ap.add_argument(
        "--views", type=int, default=None, help=f"image views per run (batches of 32; default {VIEWS}, "
                                                f"--smoke {SMOKE_VIEWS})"))
    views = common.check_views(args.views or (SMOKE_VIEWS if args.smoke else VIEWS), EVERY)
    data = [(one_frame(x), y) for x, y in (load("train"), load("test"))]
    prior = float(np.bincount(data[1][1]).max() / len(data[1][1]))
    runs = {}
    for arm in ARMS:
        for s, curve in train(arm, args.seeds, views, data).items():
            runs[(arm, s)] = curve
    common.save(HERE, {"views": views, "seeds": args.seeds, "every": EVERY, "prior": prior, "arms": ARMS,
                       "curves": {f"{arm}, seed {s}": c for (arm, s), c in runs.items()}},
                table(runs, args.seeds, views, prior))


if __name__ == "__main__":
    main()
