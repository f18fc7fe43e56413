"""Train-step throughput of mindvl-ms (compiled MindSpore graphs: forward, token-mean loss, backward,
accumulation, clipping, AdamW) against the transformers torch Qwen2.5-VL reference doing the same
packed batch and the same optimizer step on the same machine, in the same run, interleaved.

    python bench/bench_train.py [--configs tiny small] [--rounds 24] [--steps 2] [--rows 1]

Configs (bench_model.SIZES, vocabulary 151,936): tiny (2-layer LLM, hidden 64, 3-block ViT) and small
(4-layer LLM, hidden 512, 4-block ViT). The batch: `--rows` rows, each packing two samples; a sample is
text, a 224x224 image, text, a 112x168 image (mixed sizes), then the answer text. As in SFT, only the
answer carries labels (prompt text and image tokens are -100: ~20% of the positions); both
implementations get the same tokens and labels. mindvl-ms pads rows to one length and uses
block-diagonal attention; torch gets the same tokens (causal attention over the row; same matmul work).

mindvl-ms computes the LM head only at the supervised positions (train/loss_head.py). torch runs two
ways on one model, so both are measured in the same run:
- full-head: logits at every position and transformers' own loss, as `Qwen2_5_VLForConditionalGeneration`
  trains;
- equal-head: `logits_to_keep` = the positions whose next token is supervised, cross-entropy on those rows
  only: the head work mindvl-ms does. This is the fair comparison of the rest of the step.

Each implementation runs in its own child process (so peak memory is its own), loading the same random
Qwen2.5-VL weights. Both stay alive and the parent rotates the three (mindvl-ms, torch full-head, torch
equal-head): `--warmup` steps each (compile), then `--rounds` rounds of `--steps` steps of each (which one
goes first rotates), so machine load hits all alike. Reported per config and torch mode: median step time
of each (over rounds x steps steps) -> tokens/s; the ratio ours/torch in tokens/s (> 1: mindvl-ms is
faster; = torch step time / our step time) as the median over rounds of each round's ratio, with the
rounds' min-max (the medians within one round are seconds apart, so load that drifts over a run cancels;
the ratio of whole-run medians mixes quiet and busy minutes and spread more from run to run); peak RSS of
each (torch's per mode: VmHWM is restarted before each mode's steps); and achieved GFLOP/s against the
machine's fp32 matmul peak (the best of a 1024^3 matmul in MindSpore and in torch), with our share of it.
FLOPs counted are the useful ones, the same for all: 6 x (non-embedding LLM parameters x tokens + LM head
parameters x supervised positions + vision parameters x patches); attention score FLOPs are left out.
The last line reads `equal-head ratio: tiny X, small Y` (the equal-head medians).

Where the step's memory goes is measured phase by phase on the same step by `bench/profile_memory.py`,
where its time goes by `bench/profile_train.py`. The ratios and peak memory measured so far, change by
change, and the account of `small`'s memory against torch's are in docs/PERFORMANCE.md, ## bench.
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
    """rows x 2 samples of bench_model.make_batch; labels only on the final text segment (the answer)."""
    from bench_model import make_batch

    rng = np.random.default_rng(0)
    out = []
    for _ in range(rows):
        row = []
        for _ in range(2):
            s = make_batch(cfg, rng, text_len=48)
            s["labels"][:-48] = -100
            row.append(s)
        out.append(row)
    return out


def _peak_matmul_ms(n=1024, repeats=10):
    from mindspore import Tensor, ops

    a = Tensor(np.random.RandomState(0).rand(n, n).astype(np.float32))
    ops.matmul(a, a).asnumpy()
    best = min(_timed(lambda: ops.matmul(a, a).asnumpy()) for _ in range(repeats))
    return 2.0 * n ** 3 / best


def _peak_matmul_torch(n=1024, repeats=10):
    import torch

    a = torch.rand(n, n)
    torch.mm(a, a)
    best = min(_timed(lambda: torch.mm(a, a)) for _ in range(repeats))
    return 2.0 * n ** 3 / best


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ms_engine(path: str, rows: int, report=lambda phase: None):
    """(model, TrainStep, packed rows, row length) of the bench step in graph mode on CPU; `report(phase)` is
    called after the model is loaded and after the TrainStep (its accumulators) is built."""
    import mindspore as ms

    from mindvl_ms.config.base import load
    from mindvl_ms.config.train import StageConfig
    from mindvl_ms.checkpoint.pretrained import load_pretrained
    from mindvl_ms.models.mindvl import MindVLModel
    from mindvl_ms.train.optim import select_trainable
    from mindvl_ms.train.train_step import TrainStep

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    model = load_pretrained(MindVLModel, path)
    report("model loaded")
    data = packed_rows(model.config, rows)
    length = max(sum(len(s["input_ids"]) for s in r) for r in data)
    stage = load(StageConfig, {"name": "bench", "global_batch_size": rows, "micro_batch_size": rows,
                               "seq_length": length, "max_steps": 1, "max_lr": 1e-4})
    eng = TrainStep(model, select_trainable(model, stage.trainable_prefixes()), model.INPUT_NAMES, stage.loss, stage)
    report("TrainStep built (gradient accumulators)")
    return model, eng, data, length


def setup_ms(path: str, rows: int):
    from mindvl_ms.data.collate import build_model_inputs

    model, eng, data, length = ms_engine(path, rows)
    state = {}

    def step():  # host batch prep is part of the step, as in the trainer
        batch = build_model_inputs(data, model.config, pad_to=length)
        state["loss"] = eng.run([batch], 1e-4).loss
        state["tokens"] = int((batch["segment_ids"] > 0).sum())
    return step, state, _peak_matmul_ms


def setup_torch(path: str, rows: int):
    """The transformers step in two modes on one model: 'full' (logits at every position and transformers'
    own loss, as `Qwen2_5_VLForConditionalGeneration` trains) and 'equal' (`logits_to_keep` = the positions
    whose next token is supervised, cross-entropy on those rows only: the head work mindvl-ms does)."""
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
        lab = np.concatenate([s["labels"] for s in row])
        ids[r, :cat.size], labels[r, :cat.size], mask[r, :cat.size] = cat, lab, 1
    kw = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
              pixel_values=torch.tensor(np.concatenate([s["pixel_values"] for r in data for s in r])),
              image_grid_thw=torch.tensor(np.concatenate([s["image_grid_thw"] for r in data for s in r])))
    keep = np.flatnonzero((labels[:, 1:] != -100).any(0))  # positions whose next token is supervised
    keep_t, sup_targets = torch.tensor(keep), torch.tensor(labels[:, keep + 1])  # [n], [B, n]
    full_labels = torch.tensor(labels)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    state = {"tokens": int(mask.sum()), "mode": "full"}

    def loss_of(mode):
        if mode == "full":
            return hf(**kw, labels=full_labels).loss
        logits = hf(**kw, logits_to_keep=keep_t).logits  # [B, n, V]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 sup_targets.reshape(-1), ignore_index=-100)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_of(state["mode"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        state["loss"] = float(loss.item())
    return step, state, _peak_matmul_torch


def _reset_peak_rss() -> bool:
    """Restart this process's VmHWM at its current RSS (/proc/self/clear_refs); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


def child(impl: str, path: str, rows: int) -> None:
    """Serve the parent: 'RUN k [mode]' -> k timed steps (torch: mode 'full' or 'equal'); 'PEAK' -> matmul
    peak; 'DONE' -> peak RSS (per mode: VmHWM restarted before each mode's steps) and exit."""
    step, state, peak = (setup_ms if impl == "ms" else setup_torch)(path, rows)
    print("READY", flush=True)
    peaks = {}
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "RUN":
            mode = cmd[2] if len(cmd) > 2 else "ms"
            state["mode"] = mode
            reset = _reset_peak_rss()
            times = [_timed(step) for _ in range(int(cmd[1]))]
            hwm = _peak_rss_mb() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            peaks[mode] = max(peaks.get(mode, 0.0), hwm)
            print("TIMES " + json.dumps({"times": times, "loss": state["loss"], "tokens": state["tokens"]}),
                  flush=True)
        elif cmd[0] == "PEAK":
            print("PEAK " + json.dumps(peak()), flush=True)
        else:
            print("RESULT " + json.dumps({"peak_rss_mb": peaks}), flush=True)
            return


class Child:
    def __init__(self, impl, path, rows):
        self.p = subprocess.Popen([sys.executable, __file__, "--child", impl, path, "--rows", str(rows)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.impl = impl
        self._expect("READY")

    def _expect(self, tag):
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise SystemExit(f"{self.impl} child failed:\n{self.p.stderr.read()[-4000:]}")
            if line.startswith(tag):
                return json.loads(line[len(tag):]) if line[len(tag):].strip() else None

    def ask(self, cmd, tag):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self._expect(tag)


def useful_flops(path: str, rows: int) -> float:
    """6 x (non-embedding LLM params x tokens + head params x supervised + vision params x patches)."""
    from transformers import AutoConfig

    from bench_model import make_batch  # noqa: F401  (same batch as the children)

    cfg = AutoConfig.from_pretrained(path)
    t, v = cfg.text_config, cfg.vision_config
    d, i, h, kv = t.hidden_size, t.intermediate_size, t.num_attention_heads, t.num_key_value_heads
    hd = d // h
    llm = t.num_hidden_layers * (d * hd * (h + 2 * kv) + h * hd * d + 3 * d * i)
    head = d * t.vocab_size
    vd, vi = v.hidden_size, v.intermediate_size
    vis = v.depth * (4 * vd * vd + 3 * vd * vi) + 1176 * vd + (4 * vd) * (4 * vd) + 4 * vd * v.out_hidden_size
    data = packed_rows(cfg, rows)
    tokens = sum(len(s["input_ids"]) for r in data for s in r)
    sup = sum(int((s["labels"] != -100).sum()) for r in data for s in r)
    patches = sum(len(s["pixel_values"]) for r in data for s in r)
    return 6.0 * (llm * tokens + head * sup + vis * patches)


MODES = {"full": "full-head", "equal": "equal-head"}  # torch's two steps (setup_torch)


def run_config(size: str, args) -> dict:
    """Interleaved rounds of mindvl-ms and both torch modes on one config; per torch mode: the median of
    the rounds' ratios (tokens/s ours over torch's), their min-max, step medians, peak RSS and GFLOP/s."""
    from bench_model import build_hf

    runs = [("ms", "ms"), ("torch", "full"), ("torch", "equal")]
    with tempfile.TemporaryDirectory() as d:
        build_hf(size, vocab=151936).save_pretrained(d)
        kids = {impl: Child(impl, d, args.rows) for impl in ("ms", "torch")}
        for impl, mode in runs:
            kids[impl].ask(f"RUN {args.warmup} {mode}", "TIMES ")
        times = {mode: [] for _, mode in runs}
        per_round = {m: [] for m in MODES}
        info = {}
        for rnd in range(args.rounds):
            med = {}
            for impl, mode in runs[rnd % 3:] + runs[:rnd % 3]:  # who goes first rotates
                r = kids[impl].ask(f"RUN {args.steps} {mode}", "TIMES ")
                times[mode] += r["times"]
                med[mode] = float(np.median(r["times"]))
                info[mode] = r
            for m in MODES:
                per_round[m].append(med[m] / med["ms"])
            print(f"  {size} round {rnd + 1}: step ms {1e3 * med['ms']:.0f} / torch full {1e3 * med['full']:.0f}"
                  f" / torch equal {1e3 * med['equal']:.0f}", file=sys.stderr, flush=True)
        peak = max(c.ask("PEAK", "PEAK ") for c in kids.values())
        rss = {impl: c.ask("DONE", "RESULT ")["peak_rss_mb"] for impl, c in kids.items()}
        flops = useful_flops(d, args.rows)
    step = {k: float(np.median(v)) for k, v in times.items()}
    out = {}
    for m in MODES:
        ratios = [r * info["ms"]["tokens"] / info[m]["tokens"] for r in per_round[m]]  # tokens/s ratios
        out[MODES[m]] = dict(
            tokens=info["ms"]["tokens"], tps_ms=info["ms"]["tokens"] / step["ms"], tps_torch=info[m]["tokens"] / step[m],
            ratio=float(np.median(ratios)), lo=min(ratios), hi=max(ratios), rss_ms=rss["ms"]["ms"],
            rss_torch=rss["torch"][m], gf_ms=flops / step["ms"] / 1e9, gf_torch=flops / step[m] / 1e9,
            peak=peak / 1e9, step_ms=1e3 * step["ms"], step_torch=1e3 * step[m], loss_ms=info["ms"]["loss"],
            loss_torch=info[m]["loss"], steps=len(times["ms"]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["tiny", "small"])
    ap.add_argument("--rounds", type=int, default=24, help="interleaved rounds per config")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per implementation per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (graph compile)")
    ap.add_argument("--rows", type=int, default=1, help="packed rows per batch")
    ap.add_argument("--child", nargs=2, metavar=("IMPL", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.rows)
        return

    print(f"{'config':6s} {'torch head':10s} {'tokens':>6s} | {'ms tok/s':>8s} {'torch tok/s':>11s} {'ratio':>6s} "
          f"{'(rounds min-max)':>16s} | {'peak RSS ms/torch MB':>20s} | {'GFLOP/s ms/torch (peak)':>24s}")
    summary = {}
    for size in args.configs:
        res = run_config(size, args)
        summary[size] = res["equal-head"]["ratio"]
        for mode, r in res.items():
            spread = f"({r['lo']:.2f}-{r['hi']:.2f})"
            print(f"{size:6s} {mode:10s} {r['tokens']:6d} | {r['tps_ms']:8.1f} {r['tps_torch']:11.1f} "
                  f"{r['ratio']:6.2f} {spread:>16s} | "
                  f"{r['rss_ms']:9.0f} / {r['rss_torch']:8.0f} | {r['gf_ms']:7.1f} / {r['gf_torch']:6.1f} "
                  f"({r['peak']:6.1f})   ms at {100 * r['gf_ms'] / r['peak']:.0f}% of peak, step ms "
                  f"{r['step_ms']:.0f} / {r['step_torch']:.0f}, loss {r['loss_ms']:.4f} / {r['loss_torch']:.4f}, "
                  f"{r['steps']} steps each", flush=True)
    print("equal-head ratio: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()), flush=True)


if __name__ == "__main__":
    main()
