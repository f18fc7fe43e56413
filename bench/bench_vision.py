"""Vision-tower time of mindvl-ms (MindSpore graph mode, CPU) against transformers' Qwen2.5-VL vision
tower (torch, sdpa) on the same weights and the same image, measured in one run.

    python bench/bench_vision.py [--sizes 448x448 1280x720] [--repeats 15] [--rounds 3] [--dense]

The tower: a 4-block Qwen2.5-ViT (hidden 256, 4 heads, MLP 512, 112 px windows, block 3 full attention,
as one in four of Qwen2.5-VL's blocks), patch 14, 2x2 merge. One image per call, resized as the
processor does (1280x720 -> 1288x728 = 4,784 patches, 84 windows; 448x448 -> 1,024 patches, 16 windows).
mindvl-ms runs its per-window / per-image block attention (host-side gathers); `--dense` adds its old
dense N x N mask path for images of at most 2,048 patches (its memory grows with the square of the patch
count: at 1280x720 its forward+backward ran out of memory; docs/PERFORMANCE.md, ## bench). Forward is one
call; forward+backward is d(sum(out * w))/d(params) (ms.grad under jit, torch autograd). Calls of the two
frameworks alternate, so machine-load drift hits both alike; each figure is the median of `--repeats`
calls after a warm-up (compile). The whole measurement runs `--rounds` times. The summary's ratio (torch /
ours, > 1 means mindvl-ms is faster) is the median over every round of the call-by-call ratios, each from
two adjacent calls, so load that drifts over seconds cancels; the spread between the rounds' own medians
shows whether two runs agree. Both frameworks share the process, so its peak memory is theirs together;
at 1280x720 most of mindvl-ms' share is the full-attention layer's [H, N, N] float32 scores, probabilities
and their gradients (the measured peaks: docs/PERFORMANCE.md, ## bench).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("GLOG_v", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

VISION = dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=256,
              fullatt_block_indexes=[3], window_size=112, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, in_channels=3, hidden_act="silu")


def build_pair():
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mindvl_ms.checkpoint.pretrained import load_pretrained
    from mindvl_ms.models.mindvl import MindVLModel

    cfg = Qwen2_5_VLConfig(
        vision_config=VISION,
        text_config=dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}),
        image_token_id=506, video_token_id=509, vision_start_token_id=507, vision_end_token_id=508)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(cfg)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_pretrained(MindVLModel, d)
    return hf.model.visual, ours


def image(width: int, height: int, rng):
    from mindvl_ms.data.image import smart_resize

    h, w = smart_resize(height, width, 28, 56 * 56, 28 * 28 * 1280)
    gh, gw = h // 14, w // 14
    return rng.standard_normal((gh * gw, 3 * 2 * 14 * 14)).astype(np.float32), np.array([[1, gh, gw]], np.int64)


def median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def measure(size: str, hf_visual, model, repeats: int, dense: bool):
    import mindspore as ms
    import torch
    from mindspore import Parameter, Tensor, nn

    from mindvl_ms.data.collate import build_model_inputs

    width, height = (int(x) for x in size.split("x"))
    pv, grid = image(width, height, np.random.default_rng(0))
    n_tok = int(grid.prod()) // 4
    ids = np.array([model.config.image_token_id] * n_tok)
    batch = build_model_inputs([[{"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid}]], model.config)
    meta = ["pixel_values", "vision_pos_ids", "window_index", "reverse_index", "window_segment_ids",
            "full_segment_ids"]
    args_blk = [Tensor(batch[k][0]) for k in meta + ["window_gather", "full_gather"]]  # the one row
    args_dense = [Tensor(batch[k][0]) for k in meta]
    w = np.random.default_rng(1).standard_normal((n_tok, VISION["out_hidden_size"])).astype(np.float32)

    class Probe(nn.Cell):
        def __init__(self, visual):
            super().__init__()
            self.visual, self.w = visual, Parameter(Tensor(w), name="probe_w", requires_grad=False)

        def construct(self, *args):
            return (self.visual(*args) * self.w).sum()

    fwd = model.visual
    grad = ms.jit(ms.grad(Probe(model.visual), None, model.visual.trainable_params()))
    pt, gt, wt = torch.tensor(pv), torch.tensor(grid), torch.tensor(w)

    def t_fwd():
        with torch.no_grad():
            hf_visual(pt, gt).sum().item()

    def t_bwd():
        hf_visual.zero_grad(set_to_none=True)
        (hf_visual(pt, gt) * wt).sum().backward()

    calls = {
        "fwd": (lambda: fwd(*args_blk).asnumpy(), t_fwd, lambda: fwd(*args_dense).asnumpy()),
        "bwd": (lambda: grad(*args_blk)[0].asnumpy(), t_bwd, lambda: grad(*args_dense)[0].asnumpy()),
    }
    dense = dense and len(pv) <= 2048
    out = {"patches": len(pv), "windows": int(batch["window_gather"].shape[1])}
    for kind, (ours, ref, old) in calls.items():
        ours(), ref()  # warm-up: graph compile, torch allocator
        if dense:
            old()
        t_ours, t_ref, t_old = [], [], []
        for _ in range(repeats):  # alternate the frameworks call by call
            t_ours.append(median_ms(ours, 1))
            t_ref.append(median_ms(ref, 1))
            if dense:
                t_old.append(median_ms(old, 1))
        out[kind] = (statistics.median(t_ours), statistics.median(t_ref),
                     statistics.median(t_old) if dense else None)
        out[kind + "_pairs"] = [r / o for o, r in zip(t_ours, t_ref)]  # torch / ours, call by call
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["448x448", "1280x720"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dense", action="store_true", help="also time the dense N x N mask path")
    args = ap.parse_args()

    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    hf_visual, model = build_pair()
    results = {}
    for r in range(args.rounds):
        for size in args.sizes:
            res = measure(size, hf_visual, model, args.repeats, args.dense)
            results.setdefault(size, []).append(res)
            line = f"round {r + 1} {size:>9s} patches={res['patches']} windows={res['windows']}"
            for kind, name in (("fwd", "forward"), ("bwd", "fwd+bwd")):
                o, t, d = res[kind]
                line += f" | {name}: ours {o:7.1f} ms, torch {t:7.1f} ms, ratio {t / o:5.2f}"
                if d is not None:
                    line += f" (dense mask {d:7.1f} ms)"
            print(line, flush=True)
    print("summary: ratio = median over all rounds of the call-by-call ratios torch / ours (adjacent calls "
          "share the machine's load); spread = max / min - 1 of the rounds' own medians of those ratios")
    for size, runs in results.items():
        for kind, name in (("fwd", "forward"), ("bwd", "fwd+bwd")):
            pairs = [q for x in runs for q in x[kind + "_pairs"]]
            per_round = [statistics.median(x[kind + "_pairs"]) for x in runs]
            print(f"{size:>9s} {name:>8s}: ratio {statistics.median(pairs):.2f} over {len(pairs)} call pairs; "
                  f"per round {', '.join(f'{q:.2f}' for q in per_round)}; "
                  f"spread {100 * (max(per_round) / min(per_round) - 1):.1f}%")


if __name__ == "__main__":
    main()
