"""Inference latency on a small config: eager MindSpore graphs vs exported MindIR (GraphCell) vs transformers.

    python bench/bench_infer.py [--repeats 3] [--new-tokens 16] [--sizes 448x448,1280x720]

One random Qwen2.5-VL-architecture model (transformers, torch CPU) is saved, converted on load to MindVL and
exported to MindIR. For a 448x448 and a 1280x720 image (smart_resize -> 448x448 and 1288x728: 256 and 1196
image tokens) it measures, median over --repeats after a warm-up (compiles excluded):
  TTFT breakdown  preprocess (resize + uint8 patches on the host; the float path for reference),
                  vision encoder, prefill (LLM over prompt + image tokens up to the first-token logits)
  decode          per-token latency with the KV cache (batch 1)
for eager (the KV-cache cells), exported (the runner's GraphCell backend) and transformers (eager attention,
torch CPU: `model.visual`, then the full forward minus it; decode steps with its DynamicCache), printed with
ratios against transformers measured in the same run. Each (backend, image) runs in its own process so
memory pools do not add up; the exported runner's greedy tokens are checked against the eager model's.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
VOCAB, IMAGE, VSTART, VEND = 8192, 8000, 8001, 8002


def hf_config():
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=256,
                           fullatt_block_indexes=[3], window_size=112, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3, hidden_act="silu"),
        text_config=dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_theta=1e6, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        image_token_id=IMAGE, video_token_id=8003, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    cfg._attn_implementation = "eager"
    return cfg


def timed(fn, repeats):
    fn()  # warm-up (compiles)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def inputs(size):
    """(image, uint8 frames, grid, float patches, prompt ids) for a WxH random image."""
    from PIL import Image

    from mindvl_ms.config.data import ImageConfig
    from mindvl_ms.data.image import patchify
    from mindvl_ms.infer.preprocess import uint8_patches

    rng = np.random.default_rng(0)
    w, h = (int(x) for x in size.split("x"))
    image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    frames, grid = uint8_patches(image, ImageConfig())
    pv, _ = patchify(image, ImageConfig())
    n_img = int(grid.prod()) // 4
    ids = np.array(list(rng.integers(0, 7000, 20)) + [VSTART] + [IMAGE] * n_img + [VEND] +
                   list(rng.integers(0, 7000, 12)), np.int64)
    return image, frames, grid, pv, ids


def child(kind, work, size, n_new, rep):
    """Timings of one backend on one image, as a dict."""
    image, frames, grid, pv, ids = inputs(size)
    if kind == "transformers":
        return torch_child(work, pv, grid, ids, n_new, rep)
    import mindspore as ms

    from mindvl_ms.config.data import ImageConfig
    from mindvl_ms.data.image import patchify
    from mindvl_ms.data.rope_index import vision_metadata
    from mindvl_ms.infer.generate import get_engine, load_model
    from mindvl_ms.infer.preprocess import uint8_patches
    from mindvl_ms.infer.mindir_runner import ExportedRunner
    from mindvl_ms.infer.sampling import SamplingConfig

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    eng = get_engine(load_model(os.path.join(work, "hf"))) if kind == "eager" else \
        ExportedRunner(os.path.join(work, "export"), backend="graphcell").engine
    b = eng.backend
    meta = vision_metadata(grid[None], 112, 14, 2)
    res = {"preprocess": timed(lambda: uint8_patches(image, ImageConfig()), rep),
           "preprocess_float": timed(lambda: patchify(image, ImageConfig()), rep),
           "bytes_uint8": int(frames.nbytes), "bytes_float": int(pv.nbytes), "image_tokens": int(grid.prod()) // 4,
           "prompt_tokens": int(ids.size), "grid": grid.tolist()}
    feats = b.vision(frames, meta, True)
    res["vision"] = timed(lambda: b.vision(frames, meta, True), rep)
    calls = {"prefill": [], "decode": []}

    def wrap(name, real):
        def f(a, c):
            t = time.perf_counter()
            out = real(a, c)
            calls[name].append(time.perf_counter() - t)
            return out
        return f
    b.prefill, b.decode = wrap("prefill", b.prefill), wrap("decode", b.decode)
    sample = {"input_ids": ids, "image_features": [feats], "image_grid_thw": grid[None]}
    eng.generate([sample], SamplingConfig(max_new_tokens=n_new))  # warm-up
    calls = {"prefill": [], "decode": []}
    for _ in range(rep):
        res["tokens"] = eng.generate([sample], SamplingConfig(max_new_tokens=n_new))[0]
    res["prefill"] = statistics.median(calls["prefill"])
    res["decode"] = statistics.median(calls["decode"])
    return res


def torch_child(work, pv, grid, ids, n_new, rep):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(os.path.join(work, "hf"), attn_implementation="eager")
    hf.eval()
    pt, gt, it = torch.tensor(pv), torch.tensor(grid[None]), torch.tensor(ids[None])
    with torch.no_grad():
        t_vis = timed(lambda: hf.model.visual(pt, grid_thw=gt), rep)
        t_full = timed(lambda: hf(input_ids=it, pixel_values=pt, image_grid_thw=gt), rep)
        t_dec = statistics.median(hf_decode(hf, it, pt, gt, n_new) for _ in range(rep))
    return {"vision": t_vis, "prefill": t_full - t_vis, "decode": t_dec}


def hf_decode(hf, ids, pixels, grid, n_new):
    """Per-token decode latency of transformers with its KV cache (prefill excluded, greedy)."""
    import torch

    out = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, use_cache=True)
    pkv, n = out.past_key_values, ids.shape[1]
    tok = out.logits[:, -1:].argmax(-1)
    t = time.perf_counter()
    for i in range(n_new):
        out = hf(input_ids=tok, past_key_values=pkv, use_cache=True, cache_position=torch.tensor([n + i]))
        pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t) / n_new


def prepare(work):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    import mindspore as ms

    from mindvl_ms.infer.export import export

    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(hf_config()).save_pretrained(os.path.join(work, "hf"))
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    meta = export(os.path.join(work, "hf"), os.path.join(work, "export"))
    return meta["total_bytes"]


def report(size, res, n_new):
    ms_ = lambda t: f"{t * 1e3:9.1f} ms"  # noqa: E731
    e = res["eager"]
    print(f"\n== image {size}: grid {e['grid']}, {e['image_tokens']} image tokens, prompt {e['prompt_tokens']} "
          f"tokens ==")
    print(f"preprocess (host): uint8 {ms_(e['preprocess'])}, float path {ms_(e['preprocess_float'])}; image bytes "
          f"to the graph: uint8 {e['bytes_uint8'] / 1e6:.2f} MB vs float32 {e['bytes_float'] / 1e6:.2f} MB "
          f"({e['bytes_float'] / e['bytes_uint8']:.0f}x less)")
    ref = res["transformers"]
    ref["preprocess"] = e["preprocess_float"]  # transformers takes the float patches
    print(f"{'backend':<13}{'vision':>12}{'prefill':>12}{'TTFT':>12}{'decode/tok':>12}   x transformers "
          f"(vision, prefill, TTFT, decode; <1 = faster)")
    ttft = {k: r["preprocess"] + r["vision"] + r["prefill"] for k, r in res.items()}
    for name in ("eager", "exported", "transformers"):
        r = res[name]
        print(f"{name:<13}{ms_(r['vision'])}{ms_(r['prefill'])}{ms_(ttft[name])}{ms_(r['decode'])}   "
              f"{r['vision'] / ref['vision']:.2f}  {r['prefill'] / ref['prefill']:.2f}  "
              f"{ttft[name] / ttft['transformers']:.2f}  {r['decode'] / ref['decode']:.2f}")
    same = res["eager"]["tokens"] == res["exported"]["tokens"]
    print(f"exported greedy tokens == eager: {same} ({n_new} new tokens, batch 1)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats after a warm-up (median)")
    ap.add_argument("--new-tokens", type=int, default=16, help="decode steps per generation")
    ap.add_argument("--sizes", default="448x448,1280x720", help="comma-separated WxH image sizes")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "WORKDIR"), help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.size, args.new_tokens, args.repeats)))
        return
    work = tempfile.mkdtemp(prefix="bench_infer_")
    try:
        run(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work, args):
    total = prepare(work)
    print(f"exported graphs (vision + prefill + decode, fp32): {total / 2 ** 20:.1f} MiB")
    for size in args.sizes.split(","):
        res = {}
        for kind in ("eager", "exported", "transformers"):
            out = subprocess.run([sys.executable, __file__, "--child", kind, work, "--size", size, "--repeats",
                                  str(args.repeats), "--new-tokens", str(args.new_tokens)], capture_output=True,
                                 text=True, env=dict(os.environ, GLOG_v="3"))
            if out.returncode != 0:
                raise SystemExit(f"{kind} {size} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            res[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        report(size, res, args.new_tokens)


if __name__ == "__main__":
    main()
