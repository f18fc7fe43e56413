"""(d) Offline packing vs online packing vs padding: samples/s, packing efficiency, train tokens/s; offline
packing at dp=2 through msrun with its cross-rank balance; and the packer's metadata pass against decoding
every image (MindVL section 3 "Online Packing"; openPangu-VL section 6.1 "Offline Mixing and Packing",
Figure 7).

    python research/packing/run.py [--seeds 0 1 2] [--smoke]

1. Demo data (`mindvl_ms.recipes.demo.datasets.write_demo_data`, seed 0, the research scale's train sizes),
   the three train files concatenated into one mix JSONL.
2. Token counts from metadata (what `mindvl data pack` does: image headers, never decoding) against
   decoding every sample with the processor (images resized and patchified, text tokenized): both must give
   the same token count per sample (asserted); the time of each, REPEATS times, and the speed-up.
3. Per seed (the run's seed: row order and init), with the same model, stage and row length (256, every row
   padded to it), STEPS steps of 2 rows:
   offline:  `mindvl data pack MIX OUT/packed --config train.yaml --seq-length 256`, then
             `mindvl train --config train.yaml --set data.packed_dir=OUT/packed`
   online:   `mindvl train --config train.yaml --set data.packing=online` (buffer packer, default buffer)
   padding:  `python research/packing/padded.py` (same trainer, one sample per row)
   dp=2:     `mindvl data pack ... --dp-size 2`, then `scripts/msrun_train.sh 2 mindvl train ...`
             (2 CPU workers, one row per rank per step)
4. From each run's metrics.jsonl (steps after the first two: graph compile and warm caches): rows/s, real
   tokens/s, supervised tokens per step, the per-step fill (real tokens / (rows x 256)); samples/s = rows/s
   x the mode's mean samples per row over an epoch. Cross-rank imbalance at dp=2: per step, max/min real
   tokens of the two ranks' packs (the shards in step order, from the manifest) and the ranks' token totals.
Writes results.json, results.md and packing.png (mean ± sd over seeds).
"""
import json
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from mindvl_ms.config.base import load, read_yaml  # noqa: E402
from mindvl_ms.config.data import DataConfig  # noqa: E402
from mindvl_ms.data.dataset import OnlinePackSource  # noqa: E402
from mindvl_ms.data.offline import sample_meta  # noqa: E402
from mindvl_ms.data.packing import OnlinePacker, efficiency  # noqa: E402
from mindvl_ms.data.processor import MindVLProcessor  # noqa: E402
from mindvl_ms.data.schema import SampleError, iter_jsonl  # noqa: E402
from mindvl_ms.recipes.demo.datasets import write_demo_data  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "train.yaml")
SIZES = {"vqa": (240, 48), "ocr": (120, 24), "grounding": (120, 24)}
SMOKE_SIZES = {"vqa": (24, 4), "ocr": (12, 4), "grounding": (12, 4)}
SKIP = 2
STEPS = 16
SMOKE_STEPS = 4
REPEATS = 3
MODES = ("offline packing", "online packing", "padding", "offline packing, dp=2 (msrun)")


def online_rows(mix):
    """Packs of epoch 0 from the trainer's online source (metadata only, no training)."""

    raw = read_yaml(CONFIG)
    d = dict(raw["data"], packing="online", sources=[{"path": mix}], seq_length=256)
    cfg = load(DataConfig, d, source="online")
    src = OnlinePackSource(cfg, MindVLProcessor(config=cfg))  # its packer over its epoch-0 item stream
    packs = list(OnlinePacker(cfg.seq_length, cfg.max_image_tokens, cfg.online_buffer).pack_stream(src._items(0)))
    return {"packs": len(packs), "samples": sum(len(p.items) for p in packs), "efficiency": efficiency(packs, 256)}


def metadata_vs_decode(mix, repeats=REPEATS):
    """Seconds to count every sample's tokens from metadata (the packer's `sample_meta`) and by decoding it
    (`process_sample`), `repeats` times each; the counts must agree."""

    cfg = load(DataConfig, dict(read_yaml(CONFIG)["data"], sources=[{"path": mix}], seq_length=256), source="meta")
    proc = MindVLProcessor(config=cfg)
    samples = [s for _, s in iter_jsonl(mix) if not isinstance(s, SampleError)]
    t_meta, t_dec = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        meta = [sample_meta(proc, s)[0] for s in samples]
        t_meta.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dec = [len(proc.process_sample(s)["input_ids"]) for s in samples]
        t_dec.append(time.perf_counter() - t0)
        if meta != dec:
            bad = next(i for i, (a, b) in enumerate(zip(meta, dec)) if a != b)
            raise AssertionError(f"sample {bad}: metadata says {meta[bad]} tokens, decoding gives {dec[bad]}")
    return {"samples": len(samples), "metadata_s": t_meta, "decode_s": t_dec,
            "speedup": [d / m for d, m in zip(t_dec, t_meta)]}


def rank_balance(manifest):
    """Per-step max/min real tokens across ranks (packs in shard order) and the ranks' token totals."""
    per_rank = {}
    for p in manifest["packs"]:
        per_rank.setdefault(p["rank"], []).append(p["tokens"])
    steps = np.array([per_rank[r] for r in sorted(per_rank)], dtype=np.float64)  # [ranks, steps]
    ratio = steps.max(0) / np.maximum(steps.min(0), 1)
    return {"step_max_min_mean": float(ratio.mean()), "step_max_min_worst": float(ratio.max()),
            "rank_tokens": manifest["rank_tokens"], "rank_token_ratio": manifest["rank_token_ratio"]}


def msrun_cmd(workers, cmd):
    return ["bash", os.path.join(common.REPO, "scripts", "msrun_train.sh"), str(workers), *cmd]


def measure(path, rows_per_step, per_row):
    """Throughput of one run from its metrics.jsonl (steps after SKIP)."""
    with open(path, encoding="utf-8") as f:
        recs = [json.loads(ln) for ln in f][SKIP:]
    t = float(np.mean([r["step_time"] for r in recs]))
    toks = float(np.mean([r["tokens"] for r in recs]))
    return {"step_time_s": t, "rows_per_s": rows_per_step / t, "samples_per_s": rows_per_step * per_row / t,
            "tokens_per_step": toks, "tokens_per_s": toks / t, "step_fill": toks / (rows_per_step * 256),
            "supervised_per_step": float(np.mean([r["supervised"] for r in recs])), "steps_measured": len(recs)}


def train_seed(seed, out, mix, packed, packed2, steps, per_row):
    """The four modes' runs for one seed: {mode: measure(...)} plus wall times."""
    base = ["--set", f"seed={seed}", "--set", f"stages.0.max_steps={steps}", "--no-progress"]
    train = common.mindvl("train", "--config", CONFIG)
    d = os.path.join(out, f"seed{seed}")
    shutil.rmtree(d, ignore_errors=True)  # fresh runs: an existing OUT would be resumed, not measured
    cmds = {
        "offline packing": train + ["--out", f"{d}/offline", "--set", f"data.packed_dir={packed}", *base],
        "online packing": train + ["--out", f"{d}/online", "--set", "data.packing=online",
                                   "--set", f"data.sources=[{{path: {mix}}}]", *base],
        "padding": [sys.executable, os.path.join(HERE, "padded.py"), "--config", CONFIG, "--data", mix,
                    "--out", f"{d}/padding", "--set", f"seed={seed}", "--set", f"stages.0.max_steps={steps}"],
        "offline packing, dp=2 (msrun)": msrun_cmd(2, ["mindvl", "train", "--config", CONFIG,
                                                       "--out", f"{d}/dp2", "--set", f"data.packed_dir={packed2}",
                                                       "--set", "stages.0.micro_batch_size=1", *base]),
    }
    res = {}
    for mode, cmd in cmds.items():
        key = cmd[cmd.index("--out") + 1]
        os.environ.update(LOG_DIR=os.path.join(d, "msrun_logs"), GLOG_v="3")
        wall = common.run(cmd, os.path.join(d, "logs", os.path.basename(key) + ".log"))
        # dp=2: each rank trains one of the step's 2 rows; metrics are rank 0's, tokens its own row's
        rows = 1 if mode.endswith("(msrun)") else 2
        res[mode] = dict(measure(os.path.join(key, "metrics.jsonl"), rows, per_row[mode]), wall_s=wall)
        if rows == 1:  # the step's 2 rows over both ranks: rates of the whole job (rank 0's tokens x 2)
            for k in ("rows_per_s", "samples_per_s", "tokens_per_s"):
                res[mode][k] *= 2
    return res


def main():
    args = common.parse_args(__doc__)
    sizes, steps = (SMOKE_SIZES, SMOKE_STEPS) if common.S.smoke else (SIZES, STEPS)
    out = os.path.join(common.OUT, "smoke" if common.S.smoke else "", "packing")
    data = os.path.join(out, "data")
    info = write_demo_data(data, seed=0, sizes=sizes, progress=False)
    mix = os.path.join(data, "train_mix.jsonl")
    with open(mix, "w", encoding="utf-8") as f:
        for t in ("vqa", "ocr", "grounding"):
            with open(info["files"]["train"][t], encoding="utf-8") as g:
                f.write(g.read())
    pack = common.mindvl("data", "pack", mix, "", "--config", CONFIG, "--seq-length", "256", "--max-image-tokens",
                         "256", "--workers", "1", "--quiet")
    packed, packed2 = os.path.join(out, "packed"), os.path.join(out, "packed_dp2")
    t_pack = common.run([packed if a == "" else a for a in pack], os.path.join(out, "logs", "pack.log"))
    common.run([packed2 if a == "" else a for a in pack] + ["--dp-size", "2"], os.path.join(out, "logs", "pack2.log"))
    manifest = common.load(os.path.join(packed, "manifest.json"))
    manifest2 = common.load(os.path.join(packed2, "manifest.json"))
    online = online_rows(mix)
    speed = metadata_vs_decode(mix)
    per_row = {"offline packing": manifest["num_samples"] / manifest["num_packs"],
               "online packing": online["samples"] / online["packs"], "padding": 1.0,
               "offline packing, dp=2 (msrun)": manifest2["num_samples"] / manifest2["num_packs"]}
    eff = {"offline packing": manifest["efficiency"], "online packing": online["efficiency"],
           "padding": manifest["efficiency"] * manifest["num_packs"] / manifest["num_lines"],  # same tokens, n rows
           "offline packing, dp=2 (msrun)": manifest2["efficiency"]}
    per_seed = [train_seed(s, out, mix, packed, packed2, steps, per_row) for s in args.seeds]
    arms = {m: {k: [r[m][k] for r in per_seed] for k in per_seed[0][m]} for m in MODES}
    balance = rank_balance(manifest2)
    rows = [[m, f"{per_row[m]:.2f}", f"{100 * eff[m]:.1f}%", common.fmt(arms[m]["step_fill"]),
             common.fmt(arms[m]["step_time_s"], 1, 2), common.fmt(arms[m]["samples_per_s"], 1, 2),
             common.fmt(arms[m]["tokens_per_s"], 1, 0),
             "-" if m == "padding" else common.verdict(arms[m]["samples_per_s"], arms["padding"]["samples_per_s"])]
            for m in MODES]
    table = common.md_table(["mode", "samples / row", "packing efficiency (epoch)", "fill of measured steps %",
                             "step time s", "samples/s", "train tokens/s (real)", "samples/s: vs padding"], rows)
    n = manifest["num_lines"]
    table += (f"\n\nmean ± sample sd over seeds {args.seeds} (seed of the run: row order and init). {n} training "
              f"samples (demo data seed 0: " + ", ".join(f"{t} {v[0]}" for t, v in sizes.items())
              + f"), rows of 256 tokens, 2 rows per step (dp=2: one per rank; its tokens/s is rank 0's x 2), steps {SKIP}..{steps - 1} measured; "
              f"offline vs online samples/s: {common.verdict(arms['offline packing']['samples_per_s'], arms['online packing']['samples_per_s'])}. "
              f"Cross-rank balance at dp=2 (packer's shards, {manifest2['num_packs']} packs): per-step max/min tokens "
              f"{balance['step_max_min_mean']:.3f} on average, {balance['step_max_min_worst']:.3f} at worst; rank "
              f"totals {balance['rank_tokens']} (max/min {balance['rank_token_ratio']:.4f}). "
              f"Token counts of {speed['samples']} samples from metadata in {common.fmt(speed['metadata_s'], 1, 3)} s, "
              f"by decoding in {common.fmt(speed['decode_s'], 1, 3)} s ({REPEATS} repeats, counts identical): "
              f"metadata is {common.fmt(speed['speedup'], 1, 1)}x faster. `mindvl data pack` (1 worker, incl. "
              f"process start) {t_pack:.1f}s.\n")
    pyplot = common.plt()
    fig, axes = pyplot.subplots(1, 3, figsize=(12, 3.4))
    for ax, (k, label) in zip(axes, (("samples_per_s", "samples / s"), ("tokens_per_s", "real train tokens / s"),
                                      ("step_time_s", "step time (s)"))):
        ax.bar(range(len(MODES)), [np.mean(arms[m][k]) for m in MODES],
               yerr=[np.std(arms[m][k], ddof=1) if len(args.seeds) > 1 else 0 for m in MODES], capsize=3,
               color=["#66c2a5", "#8da0cb", "#fc8d62", "#e78ac3"])
        ax.set_xticks(range(len(MODES)), ["offline", "online", "padding", "offline dp=2"], fontsize=8)
        ax.set_title(label + " (mean ± sd over seeds)", fontsize=9)
    fig.suptitle("offline vs online packing vs padding (tiny model, 256-token rows, 2 CPU cores shared)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(common.results_dir(HERE), "packing.png"), dpi=100)
    common.save(HERE, {"seeds": args.seeds, "modes": arms, "samples_per_row": per_row, "epoch_efficiency": eff,
                       "pack_command_s": t_pack, "manifest_timing_s": manifest["timing_s"], "online_epoch0": online,
                       "dp2_balance": balance, "metadata_vs_decode": speed, "samples": n}, table)


if __name__ == "__main__":
    main()
