"""Forward and forward+backward time of the MindVL model (MindSpore graph mode, CPU) against the
transformers Qwen2.5-VL torch model on the same weights and the same batch, measured in one run.

    python bench/bench_model.py [--configs tiny small] [--iters 5] [--graph-kernel]

tiny: the test-sized model; small: 4-layer LLM with hidden 512 (ViT 4 blocks, hidden 256). The batch is
one row: text + two images (224x224, 112x168). Prints milliseconds per call and the ratio torch/ours
(> 1 means mindvl-ms is faster).
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("GLOG_v", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SIZES = {
    "tiny": dict(vision=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2),
                 text=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, mrope_section=[2, 3, 3])),
    "small": dict(vision=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4),
                  text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, mrope_section=[8, 12, 12])),
}


def build_hf(size: str, vocab: int):
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    s = SIZES[size]
    text = dict(s["text"])
    mrope = text.pop("mrope_section")
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(s["vision"], out_hidden_size=text["hidden_size"], fullatt_block_indexes=[1],
                           window_size=112, hidden_act="silu"),
        text_config=dict(text, vocab_size=vocab, max_position_embeddings=4096, rope_theta=10000.0,
                         rope_scaling={"type": "mrope", "mrope_section": mrope}),
        image_token_id=vocab - 6, video_token_id=vocab - 3, vision_start_token_id=vocab - 5,
        vision_end_token_id=vocab - 4)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(cfg)


def make_batch(cfg, rng, text_len=96):
    ids, pixels, grids = [], [], []
    for h, w in [(224, 224), (112, 168)]:
        gh, gw = h // 14, w // 14
        ids += list(rng.integers(0, 1000, text_len)) + [cfg.vision_start_token_id] + \
            [cfg.image_token_id] * (gh * gw // 4) + [cfg.vision_end_token_id]
        pixels.append(rng.standard_normal((gh * gw, 1176)).astype(np.float32))
        grids.append([1, gh, gw])
    ids += list(rng.integers(0, 1000, text_len))
    ids = np.array(ids, np.int64)
    return {"input_ids": ids, "labels": ids.copy(), "pixel_values": np.concatenate(pixels),
            "image_grid_thw": np.array(grids, np.int64)}


def timeit(fn, iters):
    fn()  # warm-up / compile
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1000


def run(size: str, iters: int, graph_kernel: bool):
    import mindspore as ms
    import torch
    from mindspore import Tensor, nn, ops

    from mindvl_ms.data.collate import build_model_inputs, model_args
    from mindvl_ms.checkpoint.pretrained import load_pretrained
    from mindvl_ms.models.mindvl import MindVLModel

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    if graph_kernel:
        ms.set_context(enable_graph_kernel=True)
    hf = build_hf(size, vocab=151936)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        t0 = time.perf_counter()
        model = load_pretrained(MindVLModel, d).set_dynamic_inputs()
        load_s = time.perf_counter() - t0
    sample = make_batch(model.config, np.random.default_rng(0))
    batch = build_model_inputs([[sample]], model.config)
    args = model_args(batch)
    targets = Tensor(batch["targets"])

    class Loss(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def construct(self, targets, *inputs):
            logits = self.net(*inputs)[0]
            v = logits.shape[-1]
            mask = (targets != -100).astype(ms.float32).reshape(-1)
            ce = ops.cross_entropy(logits.reshape(-1, v), ops.maximum(targets, 0).reshape(-1), reduction="none")
            return (ce * mask).sum() / mask.sum()

    loss_net = Loss(model)
    grad_fn = ms.jit(ms.value_and_grad(loss_net, None, model.trainable_params()))
    t0 = time.perf_counter()
    model(*args)
    compile_fwd = time.perf_counter() - t0
    t0 = time.perf_counter()
    grad_fn(targets, *args)
    compile_bwd = time.perf_counter() - t0
    ms_fwd = timeit(lambda: model(*args)[0].asnumpy(), iters)
    ms_bwd = timeit(lambda: grad_fn(targets, *args)[0].asnumpy(), iters)

    kw = dict(input_ids=torch.tensor(sample["input_ids"][None]), pixel_values=torch.tensor(sample["pixel_values"]),
              image_grid_thw=torch.tensor(sample["image_grid_thw"]))
    hf.eval()

    def hf_fwd():
        with torch.no_grad():
            hf(**kw).logits.sum().item()

    def hf_bwd():
        hf.zero_grad(set_to_none=True)
        out = hf(**kw, labels=torch.tensor(sample["labels"][None]))
        out.loss.backward()

    t_fwd = timeit(hf_fwd, iters)
    t_bwd = timeit(hf_bwd, iters)
    n_tok = len(sample["input_ids"])
    print(f"{size:5s} tokens={n_tok} patches={len(sample['pixel_values'])} | forward: mindvl-ms {ms_fwd:8.1f} ms, "
          f"torch {t_fwd:8.1f} ms, ratio torch/ms {t_fwd / ms_fwd:5.2f} | fwd+bwd: mindvl-ms {ms_bwd:8.1f} ms, "
          f"torch {t_bwd:8.1f} ms, ratio {t_bwd / ms_bwd:5.2f} | compile fwd {compile_fwd:.1f}s "
          f"fwd+bwd {compile_bwd:.1f}s, load {load_s:.2f}s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["tiny", "small"], choices=list(SIZES))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--graph-kernel", action="store_true", help="enable MindSpore graph-kernel fusion")
    args = ap.parse_args()
    for size in args.configs:
        run(size, args.iters, args.graph_kernel)


if __name__ == "__main__":
    main()
