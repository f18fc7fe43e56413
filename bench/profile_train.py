"""Where the train step's time goes: MindSpore's profiler over the bench_train step (same model, same
packed batch, same compiled graphs), summarised by operator type and by model part.

    python bench/profile_train.py [--config small] [--steps 5] [--top 12] [--rows 1]
    python bench/profile_train.py --config demo [--data OUT/data] [--steps 10] [--composite-attention]

`--config demo` profiles the demo's multitask step instead (configs/demo/full.yaml as `mindvl demo` trains
it: its model with `vocab: data`, one micro-batch of 8 rows x 256 tokens with 16-token 112x112 images,
the balanced loss, lr_coefficients), through the trainer's own `Trainer.train_step` (row draw, collate,
compiled step), on the demo data in `--data` (a demo run's OUT/data) or, without it, on a small set of
demo data written to a temporary directory (same generators, fewer samples: the vocabulary subset
can be a few ids smaller than the full demo's).

Runs `--warmup` untimed steps (compile), then profiles `--steps` steps with
`mindspore.profiler.profile(activities=[CPU])` and prints:
- wall time per step, split into graph time (the sum of the kernels the profiler recorded, per step) and
  the rest (host batch preparation, graph launch, Python);
- the top operator types by total kernel time (count per step, ms per step, share of kernel time);
- the same time grouped by model part (the first two scopes of each kernel's full name, e.g.
  `model/layers` vs `visual/blocks` vs `head`, `grad: ...` for their gradients, `step: ...` for the
  accumulation, norm and AdamW kernels), so a slow cell shows up even when its time is spread over many
  small kernels.
The profiler's raw output stays under `--out` (default: a temporary directory) for a closer look.
"""
import argparse
import csv
import glob
import os
import sys
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("GLOG_v", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


WRAPPERS = ("Default", "Gradients", "forward-ForwardLoss", "model-MindVLModel")


def part_of(full_name: str) -> str:
    """Model part of a kernel from its scope: 'Default/forward-ForwardLoss/model-MindVLModel/
    model-TextModel/layers-CellList/0-DecoderLayer/.../MatMul-op3' -> 'model/layers'; under 'Gradients/'
    -> 'grad: model/layers'; a kernel of the update graphs outside any cell ('Default/AdamWeightDecay-op4')
    -> 'step: AdamWeightDecay'; an expanded composite ('Expand/_SoftmaxBackward/Sub-op1') -> its composite."""
    scopes = full_name.split("/")
    grad = scopes[0] == "Gradients"
    inner = [s for s in scopes[:-1] if s not in WRAPPERS]
    if not inner:
        label = "step: " + scopes[-1].split("-op")[0]
    elif inner[0] == "Expand":
        label = "expanded: " + (inner[1] if len(inner) > 1 else scopes[-1].split("-op")[0])
    else:
        label = "/".join(s.split("-")[0] for s in inner[:2])
    return ("grad: " if grad else "") + label


DEMO_SIZES = {"vqa": [300, 8], "ocr": [150, 8], "grounding": [300, 8]}  # [train, held-out] without --data


def setup_demo(data_dir, work, composite_attention=False):
    """(step, state, trainer): step() = one `Trainer.train_step` of the demo's multitask stage (row draw, collate,
    compiled step), state its last loss and tokens, trainer the stage's Trainer (an A/B of its parts:
    bench/ab_collate_ahead.py);
    `composite_attention`: the attention's C++ kernels dropped first (ops/attention.py: SegmentBias,
    CoreAttention, SwapHeads run their composite ops, k/v repeated), for an A/B of the same tree."""
    import mindspore as ms

    from mindvl_ms.models.mindvl import MindVLModel
    from mindvl_ms.ops.attention import CoreAttention, SegmentBias, SwapHeads
    from mindvl_ms.recipes.demo.config import config_path, load_demo_config
    from mindvl_ms.recipes.demo.prepare import restrict_vocab, write_data
    from mindvl_ms.recipes.demo.rows import DemoRows
    from mindvl_ms.train.trainer import StageChain, Trainer

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    if data_dir is None:  # a small demo data set, its vocabulary subset as the demo writes it
        data_dir = os.path.join(work, "data")
        cfg, demo = load_demo_config(config_path(False), data_dir, vocab_subset=False)
        info = write_data(dict(demo, data_sizes=DEMO_SIZES), data_dir, cfg.seed, progress=False)
        restrict_vocab(cfg, demo, data_dir, list(info["files"]["heldout"].values()))
    cfg, _ = load_demo_config(config_path(False), data_dir)
    ms.set_seed(cfg.seed)
    rows = DemoRows(progress=False)
    model = MindVLModel(cfg.model)
    if composite_attention:
        for _, cell in model.cells_and_names():
            if isinstance(cell, (SegmentBias, CoreAttention, SwapHeads)):
                cell.drop_kernel()
    chain = StageChain(cfg, os.path.join(work, "run"), model, rows, rows.collate(cfg.model), progress=False)
    si = [s.name for s in chain.stages].index("multitask")
    trainer = Trainer(chain, si)
    state = {}

    def step():
        rec = trainer.train_step()
        trainer.step += 1
        state.update(loss=rec["loss"], tokens=rec["tokens"])
    return step, state, trainer


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small", choices=["tiny", "small", "demo"],
                    help="bench_model.SIZES entry, or demo: the demo's multitask step")
    ap.add_argument("--data", default=None, help="--config demo: a demo run's OUT/data (default: a small set)")
    ap.add_argument("--composite-attention", action="store_true",
                    help="--config demo: drop the attention's C++ kernels first (A/B against them)")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (graph compile)")
    ap.add_argument("--rows", type=int, default=1, help="packed rows per batch (as bench_train)")
    ap.add_argument("--top", type=int, default=12, help="rows printed per table")
    ap.add_argument("--out", default=None, help="keep the profiler output here (default: temporary)")
    args = ap.parse_args()

    import mindspore as ms
    from mindspore.profiler import ProfilerActivity

    from bench_model import build_hf
    from bench_train import setup_ms

    out = args.out or tempfile.mkdtemp(prefix="mindvl_profile_")
    with tempfile.TemporaryDirectory() as d:
        if args.config == "demo":
            step, state, _ = setup_demo(args.data, d, args.composite_attention)
        else:
            build_hf(args.config, vocab=151936).save_pretrained(d)
            step, state, _ = setup_ms(d, args.rows)
        for _ in range(args.warmup):
            step()
        prof = ms.profiler.profile(activities=[ProfilerActivity.CPU],
                                   on_trace_ready=ms.profiler.tensorboard_trace_handler(out))
        prof.start()
        walls = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
        prof.stop()
        wall = sorted(walls)[len(walls) // 2]  # median: the machine is shared
    details = glob.glob(os.path.join(out, "**", "cpu_op_detail_info_*.csv"), recursive=True)
    if not details:
        raise SystemExit(f"the profiler wrote no cpu_op_detail_info_*.csv under {out}")
    by_type, by_part, count = defaultdict(float), defaultdict(float), defaultdict(int)
    with open(max(details, key=os.path.getmtime), newline="") as f:  # this run's, if --out is reused
        for row in csv.DictReader(f):
            ms_total = float(row["op_total_time(ms)"]) / args.steps
            by_type[row["op_type"]] += ms_total
            count[row["op_type"]] += int(row["op_occurrences"])
            by_part[part_of(row["full_op_name"])] += ms_total
    kernels = sum(by_type.values())
    load = os.getloadavg()[0]
    print(f"config {args.config}: {state['tokens']} tokens, loss {state['loss']:.4f}; wall {1e3 * wall:.1f} ms/step "
          f"(median of {args.steps}, load {load:.2f}) = kernels {kernels:.1f} ms + host/launch "
          f"{1e3 * wall - kernels:.1f} ms; {sum(count.values()) / args.steps:.0f} kernels/step   (raw output: {out})")
    for title, table in (("operator type", by_type), ("model part", by_part)):
        print(f"\n{'top ' + title:40s} {'ms/step':>8s} {'share':>6s}" + ("  kernels/step" if table is by_type else ""))
        for name, t in sorted(table.items(), key=lambda kv: -kv[1])[:args.top]:
            extra = f"  {count[name] / args.steps:8.0f}" if table is by_type else ""
            print(f"{name[:40]:40s} {t:8.1f} {100 * t / kernels:5.1f}%{extra}")


if __name__ == "__main__":
    main()
