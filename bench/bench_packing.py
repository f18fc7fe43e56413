"""Offline packing benchmark: metadata throughput vs decoding images, packing efficiency and rank balance.

  python bench/bench_packing.py [--samples 1000000] [--workers 2] [--decode-samples 200] [--out DIR]

1. Throughput. A metadata JSONL of `--samples` lines (captions, documents, multi-image, text-only;
   `image_sizes` given) is packed with `pack_file` (metadata pass + best-fit-decreasing + rank
   assignment, `--workers` processes). The baseline counts tokens the way an online loader does:
   decode every image and run the image processor (resize + normalise + patchify) plus the
   tokenizer. Decoding 1M images is not practical here, so the baseline runs on `--decode-samples`
   lines that point at real JPEG/PNG files of realistic sizes (scikit-image photos resized) and its
   per-sample rate is extrapolated. Both are also measured single-process on that same subset, so
   the printed ratio compares like with like.
2. Efficiency and balance on length mixes (short captions, long documents, multi-image, a blend),
   real tokens / (rows x seq_length) and max/min tokens per data-parallel rank, with and without a
   visual-token budget below seq_length (with it, visual tokens bound the rows), for: naive padding
   to the batch max (rows in arrival order, batches dealt round-robin to ranks), greedy first-fit
   in arrival order (packs dealt round-robin, the online style) and ours (BFD + balanced ranks).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mindvl_ms.config.data import DataConfig  # noqa: E402
from mindvl_ms.data.offline import pack_file  # noqa: E402
from mindvl_ms.data.packing import (Item, assign_ranks, efficiency, pack_bfd, pack_first_fit,  # noqa: E402
                                    split_oversized)
from mindvl_ms.data.image import image_tokens  # noqa: E402
from mindvl_ms.data.processor import MindVLProcessor  # noqa: E402
from mindvl_ms.data.schema import parse_sample  # noqa: E402

SIZES = {"photo": [(640, 480), (1024, 768), (800, 600), (1280, 960)], "screen": [(1280, 720), (1920, 1080)],
         "doc": [(1700, 2200), (1240, 1754)], "small": [(224, 224), (336, 252), (160, 120)]}
WORDS = ("the a of image shows person car street sign red blue text table chart value total year page "
         "left right top bottom number answer because which").split()


def write_images(d):
    """Real image files at each realistic size (photos are JPEG, documents PNG)."""
    from PIL import Image
    from skimage import data as sk

    os.makedirs(d, exist_ok=True)
    srcs = [sk.astronaut(), sk.coffee(), sk.chelsea(), sk.rocket()]
    paths = {}
    for kind, sizes in SIZES.items():
        for k, (w, h) in enumerate(sizes):
            name = f"{kind}_{w}x{h}." + ("png" if kind == "doc" else "jpg")
            if kind == "doc":
                img = Image.fromarray(sk.text()).convert("RGB").resize((w, h))
            else:
                img = Image.fromarray(srcs[k % len(srcs)]).resize((w, h))
            img.save(os.path.join(d, name))
            paths[(kind, w, h)] = f"img/{name}"
    return paths


def sample_line(rng, paths, kind):
    words = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    keys = list(paths)
    if kind == "caption":
        imgs = [keys[rng.integers(len(keys))]]
        q, a = words(int(rng.integers(4, 15))), words(int(rng.integers(10, 80)))
    elif kind == "document":
        imgs = [k for k in keys if k[0] == "doc"][int(rng.integers(2)):][:1]
        q, a = words(int(rng.integers(10, 40))), words(int(rng.integers(200, 1000)))
    elif kind == "multi":
        imgs = [keys[rng.integers(len(keys))] for _ in range(int(rng.integers(2, 5)))]
        q, a = words(int(rng.integers(10, 30))), words(int(rng.integers(20, 200)))
    else:  # text-only
        imgs, q, a = [], words(int(rng.integers(20, 200))), words(int(rng.integers(50, 600)))
    obj = {"messages": [{"role": "user", "content": "<image>" * len(imgs) + q},
                        {"role": "assistant", "content": a}]}
    if imgs:
        obj["images"] = [paths[k] for k in imgs]
        obj["image_sizes"] = [[k[1], k[2]] for k in imgs]
    return json.dumps(obj)


def write_metadata(path, n, paths, mix, seed=0, chunk=50000):
    rng = np.random.default_rng(seed)
    kinds, probs = zip(*mix.items())
    with open(path, "w") as f:
        for s in range(0, n, chunk):
            ks = rng.choice(kinds, min(chunk, n - s), p=np.array(probs) / sum(probs))
            f.write("\n".join(sample_line(rng, paths, k) for k in ks) + "\n")


def throughput(args, tmp):
    paths = write_images(os.path.join(tmp, "img"))
    mix = {"caption": 0.6, "multi": 0.2, "document": 0.05, "text": 0.15}  # caption/VQA-heavy, like SFT mixes
    big = os.path.join(tmp, "meta.jsonl")
    t = time.perf_counter()
    write_metadata(big, args.samples, paths, mix)
    print(f"generated {args.samples} metadata lines in {time.perf_counter() - t:.1f}s")
    cfg = DataConfig(seq_length=8192, max_image_tokens=4096, dp_size=8)
    t = time.perf_counter()
    man = pack_file(big, os.path.join(tmp, "packed"), cfg, workers=args.workers, progress=True)
    dt_pack = time.perf_counter() - t
    print(f"offline pack ({args.workers} workers): {args.samples / dt_pack:,.0f} samples/s end to end "
          f"({dt_pack:.1f}s: metadata {man['timing_s']['metadata']}s, packing {man['timing_s']['packing']}s), "
          f"efficiency {man['efficiency']:.4f}, rank max/min {man['rank_token_ratio']:.5f}, "
          f"dropped {len(man['dropped'])}")
    # like-for-like, single process, on a subset whose images exist on disk
    small = os.path.join(tmp, "subset.jsonl")
    write_metadata(small, args.decode_samples, paths, mix, seed=1)
    proc = MindVLProcessor(config=cfg)
    with open(small) as f:
        samples = [parse_sample(json.loads(x), small, n) for n, x in enumerate(f, 1)]
    t = time.perf_counter()
    meta = [proc.count_tokens(s.messages, [image_tokens(w, h, cfg.image) for w, h in (s.image_sizes or [])])
            for s in samples]
    r_meta = len(samples) / (time.perf_counter() - t)
    t = time.perf_counter()
    decoded = [len(proc.process_sample(s)["input_ids"]) for s in samples]
    r_dec = len(samples) / (time.perf_counter() - t)
    assert meta == decoded, "metadata token counts must equal the decoded ones"
    from PIL import Image

    t = time.perf_counter()
    for s in samples:
        for p in s.images:
            with Image.open(p) as im:
                im.load()
    r_load = len(samples) / (time.perf_counter() - t)
    print(f"single process, {len(samples)} samples: metadata {r_meta:,.0f} samples/s | decode+process baseline "
          f"{r_dec:,.1f} samples/s (decode only {r_load:,.1f}/s) | ratio {r_meta / r_dec:,.1f}x "
          f"(vs decode only {r_meta / r_load:,.1f}x)")
    print(f"extrapolated baseline for {args.samples:,} samples: {args.samples / r_dec / 3600:.2f} h single process "
          f"vs {dt_pack / 60:.1f} min measured for offline packing with {args.workers} workers")


MIXES = {
    "short captions": {"caption": 1.0},
    "long documents": {"document": 0.7, "text": 0.3},
    "multi-image": {"multi": 1.0},
    "blend": {"caption": 0.5, "document": 0.1, "multi": 0.15, "text": 0.25},
}


def mix_items(mix, n, seed, cfg):
    """Token counts for a mix straight from the generator (text ~1.3 tokens/word + image tokens)."""
    rng = np.random.default_rng(seed)
    paths = {(k, w, h): "" for k, ss in SIZES.items() for w, h in ss}
    kinds, probs = zip(*mix.items())
    items = []
    for i, k in enumerate(rng.choice(kinds, n, p=np.array(probs) / sum(probs))):
        obj = json.loads(sample_line(rng, paths, k))
        text = sum(len(m["content"].split()) for m in obj["messages"]) + 30
        img = sum(image_tokens(w, h, cfg.image) for w, h in obj.get("image_sizes", []))
        items.append(Item(i, text + img, img))
    return items


def balance(row_tokens_per_rank):
    t = np.array(row_tokens_per_rank, dtype=np.float64)
    return t.max() / max(t.min(), 1)


def efficiency_table(args, seq_length=8192, max_image_tokens=8192):
    dp, bs = args.dp, 4
    cfg = DataConfig(seq_length=seq_length, max_image_tokens=max_image_tokens)
    print(f"\nseq_length {seq_length}, max_image_tokens {max_image_tokens}, dp {dp}, {args.mix_samples} samples "
          f"per mix; 'bound' = the least rows any packer needs, max(sum tokens / seq, sum visual / visual budget)")
    print(f"{'mix':16s} {'method':24s} {'efficiency':>10s} {'rows':>7s} {'rank max/min':>13s}")
    for name, mix in MIXES.items():
        items, _ = split_oversized(mix_items(mix, args.mix_samples, 7, cfg), seq_length, max_image_tokens)
        # naive: batches of bs samples in arrival order, each padded to its longest, dealt round-robin
        toks = np.array([it.tokens for it in items])
        nb = len(toks) // bs
        b = toks[:nb * bs].reshape(nb, bs)
        eff_naive = b.sum() / (bs * b.max(1)).sum()
        ranks_naive = [b[r::dp].sum() for r in range(dp)]
        ff = pack_first_fit(items, seq_length, max_image_tokens)
        ranks_ff = [sum(p.tokens for p in ff[r::dp]) for r in range(dp)]
        t = time.perf_counter()
        bfd = pack_bfd(items, seq_length, max_image_tokens)
        ranks, stats = assign_ranks(bfd, dp)
        dt = time.perf_counter() - t
        ours = [p for r in ranks for p in r]
        bound = max(toks.sum() / seq_length, sum(it.image_tokens for it in items) / max_image_tokens)
        print(f"{name:16s} {'naive pad to batch max':24s} {eff_naive:10.4f} {nb * bs:7d} {balance(ranks_naive):13.4f}")
        print(f"{'':16s} {'greedy first-fit':24s} {efficiency(ff, seq_length):10.4f} {len(ff):7d} "
              f"{balance(ranks_ff):13.4f}")
        print(f"{'':16s} {'BFD + balanced ranks':24s} {efficiency(ours, seq_length):10.4f} {len(ours):7d} "
              f"{stats['rank_token_ratio']:13.4f}   bound {int(np.ceil(bound))} rows, {len(items) / dt:,.0f} "
              f"items/s, ViT step max/min {stats['vit_step_max_min_ratio_mean']:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000, help="lines in the generated metadata file")
    ap.add_argument("--workers", type=int, default=2, help="processes for the metadata pass")
    ap.add_argument("--decode-samples", type=int, default=200, help="subset for the decode baseline")
    ap.add_argument("--mix-samples", type=int, default=20000, help="samples per length mix")
    ap.add_argument("--dp", type=int, default=8, help="data-parallel ranks for the balance figures")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # still remove the temporary files when stopped
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_throughput:
            throughput(args, tmp)
    efficiency_table(args, 8192, 8192)
    efficiency_table(args, 8192, 4096)


if __name__ == "__main__":
    main()
