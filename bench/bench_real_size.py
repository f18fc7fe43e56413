"""A Qwen2.5-VL-3B-shaped checkpoint through every step a user takes, each step its own process.

    python bench/bench_real_size.py --dir /tmp/real3b                 # the full 3B shapes (~7.5 GB bf16)
    python bench/bench_real_size.py --dir /tmp/real_s --scale 0.125   # 1/8 of the layers: develops in ~1 GB
    python bench/bench_real_size.py --dir /tmp/real3b --steps convert load   # some steps only

Shapes (Qwen2.5-VL-3B): text hidden 2048, 36 layers, 16 heads, 2 KV heads, head dim 128, FFN 11008,
vocab 151,936, tied embedding, q/k/v biases (Qwen2); ViT depth 32, hidden 1280, FFN 3420, full attention
at blocks 7/15/23/31; 3,754,622,976 parameters. `--scale` keeps every width and scales the two depths
(at least 2 LLM layers and 4 ViT blocks, the last one full attention). `make` writes random bf16 values
as a Hugging Face directory (config.json, 2 GB shards + index, checksums.json); the other steps run in
a child process each, and its peak RSS is read from GNU time (`-f %M`), so each figure is that step alone:

- convert:    `mindvl convert hf2ms HF MS` (streamed; MB/s = checkpoint bytes / wall)
- merge:      `mindvl merge MS MS --out MERGED` (a linear merge of two inputs; MB/s over the output)
- load:       `MindVLForConditionalGeneration.from_pretrained(MS)` into float32, nothing else
- forward:    load, then a graph-mode forward of one 448x448 image + 480 text tokens (first call, with the
              compile, and a second one)
- generate:   load, then `generate` of 16 tokens (greedy) on the same inputs; its own process, so its peak
              is what a user who only generates needs (each compiled graph keeps its own working memory)
- hf_forward: the reference in the same run: transformers' `from_pretrained(HF, float32)` and its forward
              of the same inputs (eager attention, as a CPU user gets it)
- export:     `mindvl export --ckpt MS --out EXPORT --fp16`; its weight bytes against the bf16 checkpoint

The table printed at the end is what docs/PERFORMANCE.md (## checkpoint) records. A step that fails
(e.g. killed for memory) shows its exit status in the table; the later steps still run.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = ("make", "convert", "merge", "load", "forward", "generate", "hf_forward", "export")
IMAGE_TOKENS = 256  # one 448x448 image: 32x32 patches of 14 px, merged 2x2
TEXT_TOKENS = 480


def config(scale: float):
    """The MindVLConfig of Qwen2.5-VL-3B, its two depths scaled by `scale`."""
    from mindvl_ms.config import MindVLConfig, TextConfig
    from mindvl_ms.config.model import VisionConfig

    layers, depth = max(2, round(36 * scale)), max(4, round(32 * scale))
    full = [i for i in (7, 15, 23, 31) if i < depth - 1] + [depth - 1] if depth < 32 else [7, 15, 23, 31]
    vision = VisionConfig(depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                          fullatt_block_indexes=sorted(set(full)))
    text = TextConfig(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=2, head_dim=128, attention_bias=True,
                      use_qk_norm=False, tie_word_embeddings=True, max_position_embeddings=32768)
    return MindVLConfig(vision=vision, text=text)


def hf_shapes(cfg) -> Dict[str, Tuple[int, ...]]:
    """HF tensor names and shapes of a Qwen2.5-VL checkpoint of `cfg` (tied embedding: no lm_head)."""
    v, t = cfg.vision, cfg.text
    m = v.hidden_size * v.spatial_merge_size ** 2
    shapes = {"visual.patch_embed.proj.weight": (v.hidden_size, 3, 2, 14, 14),
              "visual.merger.ln_q.weight": (v.hidden_size,),
              "visual.merger.mlp.0.weight": (m, m), "visual.merger.mlp.0.bias": (m,),
              "visual.merger.mlp.2.weight": (t.hidden_size, m), "visual.merger.mlp.2.bias": (t.hidden_size,),
              "model.embed_tokens.weight": (t.vocab_size, t.hidden_size), "model.norm.weight": (t.hidden_size,)}
    h, f = v.hidden_size, v.intermediate_size
    for i in range(v.depth):
        b = f"visual.blocks.{i}."
        shapes.update({b + "norm1.weight": (h,), b + "norm2.weight": (h,), b + "attn.qkv.weight": (3 * h, h),
                       b + "attn.qkv.bias": (3 * h,), b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,)})
        for name, (o, n) in {"gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}.items():
            shapes.update({b + f"mlp.{name}.weight": (o, n), b + f"mlp.{name}.bias": (o,)})
    d, kv = t.hidden_size, t.num_key_value_heads * t.head_dim
    for i in range(t.num_hidden_layers):
        b = f"model.layers.{i}."
        shapes.update({b + "input_layernorm.weight": (d,), b + "post_attention_layernorm.weight": (d,),
                       b + "self_attn.o_proj.weight": (d, d), b + "mlp.gate_proj.weight": (t.intermediate_size, d),
                       b + "mlp.up_proj.weight": (t.intermediate_size, d),
                       b + "mlp.down_proj.weight": (d, t.intermediate_size)})
        for name, o in {"q_proj": d, "k_proj": kv, "v_proj": kv}.items():
            shapes.update({b + f"self_attn.{name}.weight": (o, d), b + f"self_attn.{name}.bias": (o,)})
    return shapes


def make(path: str, scale: float, shard_bytes: int = 2 * 10 ** 9) -> None:
    """Random bf16 values (small, as trained weights are: N(0, 0.02), norms 1) of `hf_shapes`, HF layout."""
    from mindvl_ms.checkpoint.integrity import atomic_dir
    from mindvl_ms.checkpoint.io import TensorSpec, to_bf16_bits, write_sharded
    from mindvl_ms.config import to_hf_dict

    cfg = config(scale)
    shapes = hf_shapes(cfg)
    rng = np.random.default_rng(0)

    def fetch(name: str) -> np.ndarray:
        if name.endswith("norm.weight") or ".norm" in name or "ln_q" in name or "layernorm" in name:
            return to_bf16_bits(np.ones(shapes[name], np.float32))
        return to_bf16_bits(rng.standard_normal(shapes[name], dtype=np.float32) * np.float32(0.02))

    with atomic_dir(path) as tmp:
        hf = to_hf_dict(cfg)
        hf["torch_dtype"] = "bfloat16"
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        write_sharded(tmp, [TensorSpec(n, "BF16", s) for n, s in shapes.items()], fetch, shard_bytes)
    n = sum(int(np.prod(s)) for s in shapes.values())
    print(json.dumps({"parameters": n, "bytes": weight_bytes(path)}))


def weight_bytes(path: str) -> int:
    """Bytes of a checkpoint's safetensors files, or of an export's graphs and weights (export.json)."""
    if os.path.isfile(os.path.join(path, "export.json")):
        with open(os.path.join(path, "export.json")) as f:
            return json.load(f)["total_bytes"]
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs
               if f.endswith(".safetensors"))


def inputs(cfg) -> Dict[str, np.ndarray]:
    """One 448x448 image (random patches) inside 480 text tokens: input_ids [1, 736], pixel_values
    [1024, 1176], image_grid_thw [[1, 32, 32]]."""
    rng = np.random.default_rng(1)
    text = rng.integers(100, 150000, TEXT_TOKENS)
    ids = np.concatenate([text[:20], [cfg.vision_start_token_id], np.full(IMAGE_TOKENS, cfg.image_token_id),
                          [cfg.vision_end_token_id], text[20:TEXT_TOKENS - 2]]).astype(np.int64)[None]
    pixels = rng.standard_normal((4 * IMAGE_TOKENS, 3 * 2 * 14 * 14)).astype(np.float32)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "pixel_values": pixels,
            "image_grid_thw": np.array([[1, 32, 32]], np.int64)}


def step_load(ms_dir: str) -> dict:
    from mindvl_ms import MindVLForConditionalGeneration

    t = time.perf_counter()
    model = MindVLForConditionalGeneration.from_pretrained(ms_dir)
    n = sum(int(np.prod(p.shape)) for p in model.get_parameters())
    return {"load_s": time.perf_counter() - t, "fp32_bytes": 4 * n}


def step_forward(ms_dir: str) -> dict:
    import mindspore as ms
    from mindvl_ms import MindVLForConditionalGeneration

    ms.set_context(mode=ms.GRAPH_MODE)
    t = time.perf_counter()
    model = MindVLForConditionalGeneration.from_pretrained(ms_dir)
    out = {"load_s": time.perf_counter() - t, "logits_finite": True}
    x = inputs(model.config)
    for key in ("forward_first_s", "forward_s"):
        t = time.perf_counter()
        logits = model(**x).logits
        out["logits_finite"] &= bool(np.isfinite(logits.asnumpy()).all())
        out[key] = time.perf_counter() - t
        del logits  # [1, 736, V] float32: not held while the next call runs
    return out


def step_generate(ms_dir: str) -> dict:
    import mindspore as ms
    from mindvl_ms import MindVLForConditionalGeneration

    ms.set_context(mode=ms.GRAPH_MODE)
    t = time.perf_counter()
    model = MindVLForConditionalGeneration.from_pretrained(ms_dir)
    out = {"load_s": time.perf_counter() - t}
    x = inputs(model.config)
    t = time.perf_counter()
    ids = model.generate(**x, max_new_tokens=16, do_sample=False)
    out["generate_s"] = time.perf_counter() - t
    out["generated"] = int(ids.shape[1] - x["input_ids"].shape[1])
    return out


def step_hf_forward(hf_dir: str) -> dict:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    t = time.perf_counter()
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, torch_dtype=torch.float32,
                                                               attn_implementation="eager")
    out = {"load_s": time.perf_counter() - t}
    x = {k: torch.from_numpy(v) for k, v in inputs(_cfg_of(hf_dir)).items()}
    with torch.no_grad():
        t = time.perf_counter()
        model(**x)
        out["forward_s"] = time.perf_counter() - t
    return out


def _cfg_of(path: str):
    from mindvl_ms.checkpoint.hf import config_from_dir

    return config_from_dir(path)


def child(step: str, a) -> None:
    """Run one step in this process and print its figures as the last line (JSON)."""
    fn = {"load": lambda: step_load(a.ms), "forward": lambda: step_forward(a.ms),
          "generate": lambda: step_generate(a.ms), "hf_forward": lambda: step_hf_forward(a.hf)}[step]
    print(json.dumps(fn()))


def run(cmd: List[str], env=None) -> Tuple[dict, float, float, int]:
    """(last-line JSON or {}, wall seconds, peak RSS GB, exit status) of `cmd` under GNU time."""
    t = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-f", "MAXRSS %M"] + cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t
    rss = [int(line.split()[1]) for line in p.stderr.splitlines() if line.startswith("MAXRSS ")]
    if p.returncode:
        sys.stderr.write(p.stderr[-3000:])
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else {}), wall, (rss[-1] / 1e6 if rss else float("nan")), p.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="work directory (hf/, ms/, merged/, export/ inside)")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 3B model's depths (default 1)")
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="steps to run (default all)")
    ap.add_argument("--child", choices=("load", "forward", "generate", "hf_forward"), help=argparse.SUPPRESS)
    ap.add_argument("--ms", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a)
        return
    d = os.path.abspath(a.dir)
    hf, ms_dir, merged, export = (os.path.join(d, x) for x in ("hf", "ms", "merged", "export"))
    py, cli = sys.executable, [sys.executable, "-m", "mindvl_ms"]
    me = [py, os.path.abspath(__file__), "--dir", d]
    rows = []
    for step in a.steps:
        if step == "make":
            info, wall, rss, rc = run([py, "-c", f"import sys; sys.path.insert(0, {HERE!r}); "
                                              f"import bench_real_size as b; b.make({hf!r}, {a.scale})"])
            rows.append((f"make the HF checkpoint (bf16, 2 GB shards), scale {a.scale}", wall, rss, rc,
                         f"{info.get('parameters', 0):,} parameters, {info.get('bytes', 0) / 1e9:.2f} GB"))
        elif step == "convert":
            info, wall, rss, rc = run(cli + ["convert", "hf2ms", hf, ms_dir])
            rows.append(_io_row("`mindvl convert hf2ms hf ms`", ms_dir, wall, rss, rc))
        elif step == "merge":
            info, wall, rss, rc = run(cli + ["merge", ms_dir, ms_dir, "--out", merged, "--overwrite", "--quiet"])
            rows.append(_io_row("`mindvl merge ms ms --out merged`", merged, wall, rss, rc))
        elif step == "export":
            info, wall, rss, rc = run(cli + ["export", "--ckpt", ms_dir, "--out", export, "--fp16"])
            size = weight_bytes(export) if rc == 0 and os.path.isdir(export) else 0
            ck = weight_bytes(ms_dir)
            rows.append(("`mindvl export --ckpt ms --out export --fp16`", wall, rss, rc,
                         f"{size / 1e9:.2f} GB written (4 graphs + shared weights), {size / max(ck, 1):.3f}x the "
                         f"{ck / 1e9:.2f} GB bf16 checkpoint"))
        else:
            info, wall, rss, rc = run(me + ["--child", step, "--ms", ms_dir, "--hf", hf])
            rows.append(_model_row(step, info, wall, rss, rc))
        _print(rows[-1:])
    print()
    _print(rows)


def _io_row(name: str, out: str, wall: float, rss: float, rc: int):
    files = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".safetensors")] if os.path.isdir(out) else []
    largest = max((os.path.getsize(f) for f in files), default=0)
    total = sum(os.path.getsize(f) for f in files)
    return (name, wall, rss, rc, f"{len(files)} shard(s), largest {largest / 1e9:.2f} GB, {total / 1e6 / wall:.0f} "
                                 f"MB/s, peak {rss - largest / 1e9:+.2f} GB over the largest shard")


def _model_row(step: str, info: dict, wall: float, rss: float, rc: int):
    if step == "load":
        fp32 = info.get("fp32_bytes", 0) / 1e9
        return ("`MindVLForConditionalGeneration.from_pretrained(ms)` (fp32)", wall, rss, rc,
                f"load {info.get('load_s', 0):.1f} s; fp32 model {fp32:.2f} GB, peak {rss / max(fp32, 1e-9):.2f}x it")
    if step == "forward":
        return ("from_pretrained(ms) + graph forward (448x448 image + 480 tokens)", wall, rss, rc,
                f"load {info.get('load_s', 0):.1f} s, forward {info.get('forward_first_s', 0):.1f} s with the compile, "
                f"{info.get('forward_s', 0):.1f} s after; logits finite: {info.get('logits_finite')}")
    if step == "generate":
        return ("from_pretrained(ms) + `generate` 16 tokens (same inputs, greedy)", wall, rss, rc,
                f"load {info.get('load_s', 0):.1f} s; {info.get('generated', 0)} tokens in "
                f"{info.get('generate_s', 0):.1f} s (prefill and decode compiles included)")
    return ("transformers `from_pretrained(hf, float32)` + forward (same inputs)", wall, rss, rc,
            f"load {info.get('load_s', 0):.1f} s, forward {info.get('forward_s', 0):.1f} s")


def _print(rows) -> None:
    print("| step | wall | peak RSS | result |")
    print("| --- | --- | --- | --- |")
    for name, wall, rss, rc, result in rows:
        status = "" if rc == 0 else f" (exit {rc})"
        print(f"| {name} | {wall:.1f} s | {rss:.2f} GB | {result}{status} |", flush=True)


if __name__ == "__main__":
    main()
