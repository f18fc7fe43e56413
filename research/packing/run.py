"""(d) Offline packing vs online packing vs padding: samples/s, packing efficiency, train tokens/s
(MindVL section 3 "Online Packing"; openPangu-VL section 6.1 "Offline Mixing and Packing", Figure 7).

    python research/packing/run.py

1. Demo data (`mindvl_ms.recipes.demo.datasets.write_demo_data`, seed 0, the research scale's train sizes), the
   three train files concatenated into one mix JSONL.
2. offline:  `mindvl data pack MIX OUT/packed --config train.yaml --seq-length 256` (timed), then
             `mindvl train --config train.yaml --set data.packed_dir=OUT/packed`
   online:   `mindvl train --config train.yaml --set data.packing=online` (buffer packer, default buffer)
   padding:  `python research/packing/padded.py` (same trainer, one sample per row)
   Same model, stage, seed and row length (256, every row padded to it); 16 steps of 2 rows each.
3. From each run's metrics.jsonl (steps after the first two: graph compile and warm caches): rows/s,
   real tokens/s (non-padding tokens the model trained on per second), supervised tokens per step, and
   the per-step fill (real tokens / (rows x 256)); samples/s = rows/s x the mode's mean samples per row
   over an epoch (manifest for offline, the online packer's packs of epoch 0, 1 for padding).
Writes results.json, results.md and packing.png here.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "train.yaml")
SIZES = {"vqa": (240, 48), "ocr": (120, 24), "grounding": (120, 24)}
SKIP = 2


def online_rows(mix):
    """Packs of epoch 0 from the trainer's online source (metadata only, no training)."""
    from mindvl_ms.config.base import load, read_yaml
    from mindvl_ms.config.data import DataConfig
    from mindvl_ms.data.dataset import OnlinePackSource
    from mindvl_ms.data.packing import OnlinePacker, efficiency
    from mindvl_ms.data.processor import MindVLProcessor

    raw = read_yaml(CONFIG)
    d = dict(raw["data"], packing="online", sources=[{"path": mix}], seq_length=256)
    cfg = load(DataConfig, d, source="online")
    src = OnlinePackSource(cfg, MindVLProcessor(config=cfg))  # its packer over its epoch-0 item stream
    packs = list(OnlinePacker(cfg.seq_length, cfg.max_image_tokens, cfg.online_buffer).pack_stream(src._items(0)))
    return {"packs": len(packs), "samples": sum(len(p.items) for p in packs), "efficiency": efficiency(packs, 256)}


def steps(path):
    with open(path, encoding="utf-8") as f:
        recs = [json.loads(ln) for ln in f]
    return recs[SKIP:]


def main():
    from mindvl_ms.recipes.demo.datasets import write_demo_data

    out = os.path.join(common.OUT, "packing")
    data = os.path.join(out, "data")
    info = write_demo_data(data, seed=0, sizes=SIZES, progress=False)
    mix = os.path.join(data, "train_mix.jsonl")
    with open(mix, "w", encoding="utf-8") as f:
        for t in ("vqa", "ocr", "grounding"):
            with open(info["files"]["train"][t], encoding="utf-8") as g:
                f.write(g.read())
    packed = os.path.join(out, "packed")
    t_pack = common.run(common.mindvl("data", "pack", mix, packed, "--config", CONFIG, "--seq-length", "256",
                                      "--max-image-tokens", "256", "--workers", "1", "--quiet"),
                        os.path.join(out, "logs", "pack.log"))
    manifest = common.load(os.path.join(packed, "manifest.json"))
    online = online_rows(mix)
    train = common.mindvl("train", "--config", CONFIG, "--no-progress")
    modes = {
        "offline packing": (train + ["--out", os.path.join(out, "offline"), "--set", f"data.packed_dir={packed}"],
                            manifest["num_samples"] / manifest["num_packs"], manifest["efficiency"]),
        "online packing": (train + ["--out", os.path.join(out, "online"), "--set", "data.packing=online",
                                    "--set", f"data.sources=[{{path: {mix}}}]"],
                           online["samples"] / online["packs"], online["efficiency"]),
        "padding": ([sys.executable, os.path.join(HERE, "padded.py"), "--config", CONFIG, "--data", mix, "--out",
                     os.path.join(out, "padding")], 1.0, None),
    }
    res = {}
    for name, (cmd, per_row, eff) in modes.items():
        key = name.split()[0]
        wall = common.run(cmd, os.path.join(out, "logs", f"{key}.log"))
        recs = steps(os.path.join(out, key, "metrics.jsonl"))
        rows_per_step = 2
        t = float(np.mean([r["step_time"] for r in recs]))
        toks = float(np.mean([r["tokens"] for r in recs]))
        res[name] = {"wall_s": wall, "step_time_s": t, "step_time_std_s": float(np.std([r["step_time"] for r in recs])),
                     "rows_per_s": rows_per_step / t, "samples_per_row": per_row,
                     "samples_per_s": rows_per_step * per_row / t, "tokens_per_step": toks, "tokens_per_s": toks / t,
                     "supervised_per_step": float(np.mean([r["supervised"] for r in recs])),
                     "step_fill": toks / (rows_per_step * 256),
                     "epoch_efficiency": eff if eff is not None else None, "steps_measured": len(recs)}
    n = manifest["num_lines"]
    res["padding"]["epoch_efficiency"] = manifest["efficiency"] * manifest["num_packs"] / n  # same tokens, n rows
    rows = [[m, f"{r['samples_per_row']:.2f}", f"{100 * r['epoch_efficiency']:.1f}%", f"{100 * r['step_fill']:.1f}%",
             f"{r['step_time_s']:.2f} ± {r['step_time_std_s']:.2f}", f"{r['samples_per_s']:.2f}",
             f"{r['tokens_per_s']:.0f}", f"{r['supervised_per_step']:.0f}"] for m, r in res.items()]
    table = common.md_table(["mode", "samples / row", "packing efficiency (epoch)", "fill of measured steps",
                             "step time s (mean ± std)", "samples/s", "train tokens/s (real)",
                             "supervised tokens / step"], rows)
    table += (f"\n\n{n} training samples (demo data seed 0: VQA {SIZES['vqa'][0]}, OCR {SIZES['ocr'][0]}, "
              f"grounding {SIZES['grounding'][0]}), rows of 256 tokens, 2 rows per step, steps {SKIP}..15 measured; "
              f"offline packing pass (`mindvl data pack`, 1 worker, incl. process start) {t_pack:.1f}s, of which "
              f"metadata {manifest['timing_s']['metadata']:.2f}s and packing {manifest['timing_s']['packing']:.3f}s; "
              f"online: {online['packs']} packs in epoch 0, offline: {manifest['num_packs']} packs.\n")
    plt = common.plt()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    names = list(res)
    for ax, (k, label) in zip(axes, (("samples_per_s", "samples / s"), ("tokens_per_s", "real train tokens / s"),
                                      ("epoch_efficiency", "packing efficiency"))):
        ax.bar(names, [res[m][k] * (100 if k == "epoch_efficiency" else 1) for m in names],
               color=["#66c2a5", "#8da0cb", "#fc8d62"])
        ax.set_title(label + (" (%)" if k == "epoch_efficiency" else ""))
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("offline vs online packing vs padding (tiny model, 256-token rows, 2 CPU cores shared)")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "packing.png"), dpi=110)
    common.save(HERE, {"seed": 0, "modes": res, "pack_command_s": t_pack, "manifest_timing_s": manifest["timing_s"],
                       "online_epoch0": online, "samples": n}, table)


if __name__ == "__main__":
    main()
