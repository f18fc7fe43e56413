"""Peak memory and time of `mindvl merge` vs a load-everything merge, measured in the same run.

    python bench/bench_merge.py [--mb 300] [--n 3] [--dtype F32|BF16]

Writes N random checkpoints of about `--mb` MB each (many 16 MB tensors plus one embedding-sized tensor),
then merges them twice, each in a fresh subprocess so VmHWM (peak RSS) is that merge's own peak:
- streaming: `mindvl_ms.checkpoint.merge.merge` (positional chunked reads, streamed writer)
- safe_open: tensor-by-tensor `safetensors.safe_open` reads (all handles open: the memory-mapped pages
  of every input stay resident), results collected and written with `save_file` (F32 only)
- reference: `safetensors.torch.load_file` of every input, fp32 average, `save_file`
Prints peak RSS growth in MB, as a multiple of one checkpoint, and the ratios reference / streaming.

    python bench/bench_merge.py --ab OLD_MERGE_PY --ckpt DIR [--rounds 3]

A/B of two versions of mindvl_ms/checkpoint/merge.py (e.g. `git show HEAD~1:mindvl_ms/checkpoint/merge.py >
/tmp/old_merge.py`): `mindvl merge DIR DIR` run as a CLI process under GNU time, alternating old and this
tree's, each printing its wall, MB/s of output, peak RSS and the load average; at the end, whether the two
outputs hold the same safetensors bytes.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HWM = """def hwm():  # peak RSS (KiB) of this address space; unlike ru_maxrss it does not inherit the parent's
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
"""

STREAM = HWM + """
import sys, time
from mindvl_ms.checkpoint.merge import merge
before = hwm()
t = time.perf_counter()
merge(sys.argv[2:], sys.argv[1], progress=False)
print(before, hwm(), time.perf_counter() - t)
"""

SAFE_OPEN = HWM + """
import sys, time, os, numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
before = hwm()
t = time.perf_counter()
hs = [safe_open(os.path.join(p, "model.safetensors"), "np") for p in sys.argv[2:]]
out = {k: (sum(h.get_tensor(k).astype(np.float32) for h in hs) / len(hs)) for k in hs[0].keys()}
os.makedirs(sys.argv[1], exist_ok=True)
save_file(out, os.path.join(sys.argv[1], "model.safetensors"), metadata={"format": "pt"})
print(before, hwm(), time.perf_counter() - t)
"""

NAIVE = HWM + """
import sys, time, os, torch
from safetensors.torch import load_file, save_file
before = hwm()
t = time.perf_counter()
states = [load_file(os.path.join(p, "model.safetensors")) for p in sys.argv[2:]]
out = {k: (sum(s[k].float() for s in states) / len(states)).to(states[0][k].dtype) for k in states[0]}
os.makedirs(sys.argv[1], exist_ok=True)
save_file(out, os.path.join(sys.argv[1], "model.safetensors"), metadata={"format": "pt"})
print(before, hwm(), time.perf_counter() - t)
"""


def make_checkpoints(root: str, n: int, mb: int, dtype: str) -> list:
    import torch
    from safetensors.torch import save_file

    tdt = {"F32": torch.float32, "BF16": torch.bfloat16}[dtype]
    item = 4 if dtype == "F32" else 2
    emb_rows = (mb << 20) // 4 // item // 1024  # a quarter of the bytes in one embedding-like tensor
    n_small = max(1, ((mb << 20) - emb_rows * 1024 * item) // ((4 << 20) * item))
    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        t = {"model.embed_tokens.weight": torch.randn(emb_rows, 1024, generator=g).to(tdt)}
        for j in range(n_small):
            t[f"model.layers.{j}.mlp.weight"] = torch.randn(2048, 2048, generator=g).to(tdt)
        p = os.path.join(root, f"in{i}")
        os.makedirs(p)
        save_file(t, os.path.join(p, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(p, "config.json"), "w") as f:
            json.dump({"model_type": "bench"}, f)
        paths.append(p)
    return paths


def run(code: str, out: str, paths: list) -> tuple:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code, out] + paths, capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(res.stderr)
    before, peak, secs = res.stdout.split()[-3:]
    return (int(peak) - int(before)) / 1024.0, float(secs)  # MB grown, seconds


CLI_WITH = """import importlib.util, sys
spec = importlib.util.spec_from_file_location("mindvl_ms.checkpoint.merge", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
from mindvl_ms.cli import main
sys.exit(main(sys.argv[2:]))
"""


def ab(old: str, ckpt: str, rounds: int) -> None:
    """`mindvl merge CKPT CKPT` with merge.py `old` vs this tree's, alternating (outputs next to CKPT)."""
    variants = {"old": os.path.abspath(old), "new": os.path.join(ROOT, "mindvl_ms", "checkpoint", "merge.py")}
    outs = {k: os.path.join(os.path.dirname(os.path.abspath(ckpt)), f"merged_{k}") for k in variants}
    for r in range(rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            load = os.getloadavg()[0]
            t = time.perf_counter()
            p = subprocess.run(["/usr/bin/time", "-f", "MAXRSS %M", sys.executable, "-c", CLI_WITH, variants[name],
                                "merge", ckpt, ckpt, "--out", outs[name], "--overwrite", "--quiet"],
                               capture_output=True, text=True, cwd=ROOT)
            wall = time.perf_counter() - t
            if p.returncode:
                raise SystemExit(p.stderr[-3000:])
            rss = [int(x.split()[1]) for x in p.stderr.splitlines() if x.startswith("MAXRSS ")][-1] / 1e6
            size = sum(os.path.getsize(os.path.join(outs[name], f)) for f in os.listdir(outs[name])
                       if f.endswith(".safetensors"))
            print(f"round {r} {name}: {wall:.1f} s, {size / 1e6 / wall:.0f} MB/s, peak RSS {rss:.2f} GB, "
                  f"load {load:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    files = sorted(f for f in os.listdir(outs["old"]) if f.endswith(".safetensors"))
    same = files == sorted(f for f in os.listdir(outs["new"]) if f.endswith(".safetensors")) and all(
        filecmp.cmp(os.path.join(outs["old"], f), os.path.join(outs["new"], f), shallow=False) for f in files)
    print(f"outputs {'identical' if same else 'DIFFER'}: {', '.join(files)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=300, help="size of each input checkpoint in MB")
    ap.add_argument("--n", type=int, default=3, help="number of checkpoints")
    ap.add_argument("--dtype", choices=["F32", "BF16"], default="F32")
    ap.add_argument("--ab", metavar="OLD_MERGE_PY", help="A/B this merge.py against the tree's on --ckpt")
    ap.add_argument("--ckpt", help="--ab: the checkpoint merged with itself")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: runs of each version")
    args = ap.parse_args()
    if args.ab:
        if not args.ckpt:
            ap.error("--ab needs --ckpt")
        ab(args.ab, args.ckpt, args.rounds)
        return
    root = tempfile.mkdtemp(prefix="bench_merge_")
    try:
        t = time.perf_counter()
        paths = make_checkpoints(root, args.n, args.mb, args.dtype)
        size = os.path.getsize(os.path.join(paths[0], "model.safetensors")) / 2**20
        print(f"{args.n} x {size:.0f} MB {args.dtype} checkpoints written in {time.perf_counter() - t:.1f}s")
        s_mb, s_t = run(STREAM, os.path.join(root, "stream"), paths)
        n_mb, n_t = run(NAIVE, os.path.join(root, "naive"), paths)
        print(f"{'merge':<28}{'peak RSS growth MB':>20}{'x one ckpt':>12}{'seconds':>10}")
        print(f"{'streaming (mindvl merge)':<28}{s_mb:>20.0f}{s_mb / size:>12.2f}{s_t:>10.2f}")
        if args.dtype == "F32":  # the numpy frontend of safetensors cannot read bf16
            o_mb, o_t = run(SAFE_OPEN, os.path.join(root, "safe_open"), paths)
            print(f"{'safe_open, collect, save':<28}{o_mb:>20.0f}{o_mb / size:>12.2f}{o_t:>10.2f}")
        print(f"{'reference (load all)':<28}{n_mb:>20.0f}{n_mb / size:>12.2f}{n_t:>10.2f}")
        print(f"ratio reference/streaming: memory {n_mb / max(s_mb, 1):.1f}x, time {n_t / s_t:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
