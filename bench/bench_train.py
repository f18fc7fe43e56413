"""Train-step throughput of mindvl-ms (compiled MindSpore graphs: forward, token-mean loss,
backward, accumulation, clipping, AdamW) against the transformers torch Qwen2.5-VL reference doing the
same packed batch and the same optimizer step on the same machine, in the same run.

    python bench/bench_train.py [--configs tiny small] [--steps 3] [--rows 1]

Each implementation runs in its own child process (so peak memory is its own), loading the same
random Qwen2.5-VL weights from a temporary directory. The batch: `--rows` rows, each packing two
samples (text + two images); mindvl-ms pads rows to one length and uses block-diagonal attention,
torch gets the same tokens (causal attention over the row; same matmul work). Reported: tokens/s
after the first step, the ratio ours/torch (> 1: mindvl-ms is faster), the first step's time
(graph compile for mindvl-ms), and peak resident memory of each process.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("GLOG_v", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def packed_rows(cfg, rows: int):
    from bench_model import make_batch

    rng = np.random.default_rng(0)
    return [[make_batch(cfg, rng, text_len=48) for _ in range(2)] for _ in range(rows)]


def child_ms(path: str, rows: int, steps: int) -> dict:
    import mindspore as ms

    from mindvl_ms.config.base import load
    from mindvl_ms.config.train import StageConfig
    from mindvl_ms.models.inputs import build_model_inputs
    from mindvl_ms.models.mindvl import MindVLForConditionalGeneration
    from mindvl_ms.train.optim import select_trainable
    from mindvl_ms.train.train_step import TrainStep

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    model = MindVLForConditionalGeneration.from_pretrained(path)
    data = packed_rows(model.config, rows)
    length = max(sum(len(s["input_ids"]) for s in r) for r in data)
    batch = build_model_inputs(data, model.config, pad_to=length)
    stage = load(StageConfig, {"name": "bench", "global_batch_size": rows, "micro_batch_size": rows,
                               "seq_length": length, "max_steps": steps, "max_lr": 1e-4})
    params = select_trainable(model, stage.trainable_prefixes())
    eng = TrainStep(model, params, model.INPUT_NAMES, stage.loss, stage)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        res = eng.run([batch], 1e-4)
        times.append(time.perf_counter() - t)
    tokens = int((batch["segment_ids"] > 0).sum())
    return {"first_s": times[0], "step_s": float(np.mean(times[1:])), "tokens": tokens, "loss": res.loss}


def child_torch(path: str, rows: int, steps: int) -> dict:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, torch_dtype=torch.float32,
                                                            attn_implementation="sdpa")
    hf.train()
    data = packed_rows(hf.config, rows)
    length = max(sum(len(s["input_ids"]) for s in r) for r in data)
    ids = np.zeros((rows, length), np.int64)
    labels = np.full((rows, length), -100, np.int64)
    mask = np.zeros((rows, length), np.int64)
    for r, row in enumerate(data):
        cat = np.concatenate([s["input_ids"] for s in row])
        ids[r, :cat.size], labels[r, :cat.size], mask[r, :cat.size] = cat, cat, 1
    kw = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels),
              pixel_values=torch.tensor(np.concatenate([s["pixel_values"] for r in data for s in r])),
              image_grid_thw=torch.tensor(np.concatenate([s["image_grid_thw"] for r in data for s in r])))
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.1)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = hf(**kw).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t)
    return {"first_s": times[0], "step_s": float(np.mean(times[1:])), "tokens": int(mask.sum()),
            "loss": float(loss.item())}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=3, help="train steps per implementation (first one = warm-up)")
    ap.add_argument("--rows", type=int, default=1, help="packed rows per batch")
    ap.add_argument("--child", nargs=2, metavar=("IMPL", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        impl, path = args.child
        out = (child_ms if impl == "ms" else child_torch)(path, args.rows, args.steps)
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("RESULT " + json.dumps(out))
        return
    from bench_model import build_hf

    print(f"{'config':6s} {'tokens':>6s} | {'mindvl-ms tok/s':>15s} {'torch tok/s':>11s} {'ratio':>6s} | "
          f"{'first step ms/torch (s)':>23s} | {'peak RSS ms/torch (MB)':>22s}")
    for size in args.configs:
        with tempfile.TemporaryDirectory() as d:
            build_hf(size, vocab=151936).save_pretrained(d)
            res = {}
            for impl in ("ms", "torch"):
                r = subprocess.run([sys.executable, __file__, "--child", impl, d, "--rows", str(args.rows),
                                    "--steps", str(args.steps)], capture_output=True, text=True)
                line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
                if r.returncode or not line:
                    raise SystemExit(f"{impl} child failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
                res[impl] = json.loads(line[0][7:])
        ms_r, th = res["ms"], res["torch"]
        tps_ms, tps_th = ms_r["tokens"] / ms_r["step_s"], th["tokens"] / th["step_s"]
        print(f"{size:6s} {ms_r['tokens']:6d} | {tps_ms:15.1f} {tps_th:11.1f} {tps_ms / tps_th:6.2f} | "
              f"{ms_r['first_s']:10.1f} / {th['first_s']:10.1f} | {ms_r['peak_rss_mb']:10.0f} / {th['peak_rss_mb']:9.0f}"
              f"   (loss {ms_r['loss']:.4f} / {th['loss']:.4f})")


if __name__ == "__main__":
    main()
