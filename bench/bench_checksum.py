"""Throughput of the checksums a checkpoint manifest could use, streamed over ~1 GB the way the verifier reads.

    python bench/bench_checksum.py [--gb 1] [--chunk-mb 8] [--repeat 5]
    python bench/bench_checksum.py --make-3b /tmp/ck3b         # random bf16 Qwen2.5-VL-3B shapes, 2 GB shards
    python bench/bench_checksum.py --dir /tmp/ck3b --repeat 3 [--cold]

Without --dir: one random buffer of --gb GB in memory, fed to each checksum in --chunk-mb chunks of bytes
(as `checkpoint.io` streams a file); prints the median GB/s (1 GB = 1e9 bytes) of --repeat runs for
hashlib.sha256, zlib.crc32, and CRC32C from the `crc32c` and `google-crc32c` packages when installed.
--make-3b writes a checkpoint of Qwen2.5-VL-3B's tensor shapes (random bf16 bits, ~7.5 GB) through
`checkpoint.integrity.atomic_dir` and times its manifest. --dir times `integrity.verify_checkpoint` on a
directory next to a plain streamed read of the same files and the tensor read of a load
(`io.iter_tensors`), wall seconds and GB/s, median of --repeat; --cold evicts the directory's pages from
the page cache (posix_fadvise) before each run so the files come from disk.
The figures are recorded in docs/PERFORMANCE.md, ## checkpoint.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
import zlib
from typing import Dict, List, Tuple

import numpy as np


def _sha256(chunks):
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def _crc32(chunks):
    v = 0
    for c in chunks:
        v = zlib.crc32(c, v)
    return v


def candidates():
    """name -> function(list of memoryview chunks) for every checksum importable here."""
    out = {"hashlib.sha256": _sha256, "zlib.crc32": _crc32}
    try:
        import crc32c

        def _icrar(chunks):
            v = 0
            for c in chunks:
                v = crc32c.crc32c(c, v)
            return v
        out[f"crc32c (package crc32c, hardware {crc32c.hardware_based})"] = _icrar
    except ImportError:
        pass
    try:
        import google_crc32c

        def _google(chunks):
            v = 0
            for c in chunks:
                v = google_crc32c.extend(v, c)
            return v
        out[f"crc32c (package google-crc32c, {google_crc32c.implementation})"] = _google
    except ImportError:
        pass
    return out


def bench_memory(gb: float, chunk_mb: int, repeat: int) -> None:
    n = int(gb * 1e9)
    buf = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes()
    step = chunk_mb << 20
    chunks = [buf[i:i + step] for i in range(0, n, step)]  # bytes, as f.read() returns (google-crc32c needs them)
    del buf
    print(f"{n / 1e9:.2f} GB in {len(chunks)} chunks of {chunk_mb} MiB, median of {repeat}")
    for name, fn in candidates().items():
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn(chunks)
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        print(f"  {name:50s} {n / med / 1e9:6.2f} GB/s  ({med:.3f} s)")


def qwen2_5_vl_3b_shapes() -> Dict[str, Tuple[int, ...]]:
    """HF tensor names and shapes of Qwen2.5-VL-3B (32-block ViT, 36-layer LLM, tied embedding)."""
    shapes = {"visual.patch_embed.proj.weight": (1280, 3, 2, 14, 14), "visual.merger.ln_q.weight": (1280,),
              "visual.merger.mlp.0.weight": (5120, 5120), "visual.merger.mlp.0.bias": (5120,),
              "visual.merger.mlp.2.weight": (2048, 5120), "visual.merger.mlp.2.bias": (2048,),
              "model.embed_tokens.weight": (151936, 2048), "model.norm.weight": (2048,)}
    for i in range(32):
        b = f"visual.blocks.{i}."
        shapes.update({b + "norm1.weight": (1280,), b + "norm2.weight": (1280,),
                       b + "attn.qkv.weight": (3840, 1280), b + "attn.qkv.bias": (3840,),
                       b + "attn.proj.weight": (1280, 1280), b + "attn.proj.bias": (1280,)})
        for m, (o, n) in {"gate_proj": (3420, 1280), "up_proj": (3420, 1280), "down_proj": (1280, 3420)}.items():
            shapes.update({b + f"mlp.{m}.weight": (o, n), b + f"mlp.{m}.bias": (o,)})
    for i in range(36):
        b = f"model.layers.{i}."
        shapes.update({b + "input_layernorm.weight": (2048,), b + "post_attention_layernorm.weight": (2048,),
                       b + "self_attn.o_proj.weight": (2048, 2048), b + "mlp.gate_proj.weight": (11008, 2048),
                       b + "mlp.up_proj.weight": (11008, 2048), b + "mlp.down_proj.weight": (2048, 11008)})
        for m, o in {"q_proj": 2048, "k_proj": 256, "v_proj": 256}.items():
            shapes.update({b + f"self_attn.{m}.weight": (o, 2048), b + f"self_attn.{m}.bias": (o,)})
    return shapes


def make_3b(path: str, shard_bytes: int = 2 * 10 ** 9) -> None:
    """Random bf16 tensors of Qwen2.5-VL-3B's shapes in shards of at most `shard_bytes` + index (HF layout),
    written one shard in memory at a time through integrity.atomic_dir (so with its checksums.json)."""
    from mindvl_ms.checkpoint.integrity import atomic_dir, file_entry
    from mindvl_ms.checkpoint.io import INDEX, RawTensor, write_file

    shapes, rng = qwen2_5_vl_3b_shapes(), np.random.default_rng(0)
    shards, cur, size = [], [], 0
    for name in sorted(shapes):
        nb = int(np.prod(shapes[name])) * 2
        if cur and size + nb > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nb
    shards.append(cur)
    t0 = time.perf_counter()
    with atomic_dir(path) as tmp:
        weight_map = {}
        for i, group in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_file(os.path.join(tmp, fn), {n: RawTensor(rng.integers(0, 1 << 16, shapes[n], dtype=np.uint16),
                                                            "BF16") for n in group}, {"format": "pt"})
            weight_map.update({n: fn for n in group})
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": sum(int(np.prod(v)) * 2 for v in shapes.values())},
                       "weight_map": weight_map}, f, indent=2)
    total = _dir_bytes(path)
    print(f"wrote {path}: {sum(int(np.prod(v)) for v in shapes.values()) / 1e9:.3f}B parameters, "
          f"{total / 1e9:.2f} GB in {len(shards)} shards, {time.perf_counter() - t0:.1f} s with the manifest")
    t = time.perf_counter()
    for r, _, fs in os.walk(path):
        for fn in fs:
            file_entry(os.path.join(r, fn))
    dt = time.perf_counter() - t
    print(f"manifest entries alone (file + per-tensor CRC32C, page cache warm): {dt:.2f} s "
          f"({total / dt / 1e9:.2f} GB/s)")


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _evict(path: str) -> None:
    """Drop this directory's files from the page cache (their pages only), so the next read is from disk."""
    for r, _, fs in os.walk(path):
        for fn in fs:
            fd = os.open(os.path.join(r, fn), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn, path: str, repeat: int, cold: bool) -> List[float]:
    times = []
    for _ in range(repeat):
        if cold:
            _evict(path)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def bench_dir(path: str, repeat: int, cold: bool) -> None:
    """verify_checkpoint against a plain streamed read and a tensor read (io.iter_tensors) of the same files."""
    from mindvl_ms.checkpoint.integrity import _stream, verify_checkpoint
    from mindvl_ms.checkpoint.io import iter_tensors

    total = _dir_bytes(path)
    files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    runs = {"verify_checkpoint": lambda: verify_checkpoint(path, model_only=False),
            "streamed read, no checksum": lambda: [None for fn in files for _ in _stream(fn)],
            "io.iter_tensors (the load's read)": lambda: [None for _ in iter_tensors(path)]}
    print(f"{path}: {total / 1e9:.2f} GB in {len(files)} files; page cache {'evicted before each run' if cold else 'warm'}"
          f", median of {repeat}")
    for name, fn in runs.items():
        times = _timed(fn, path, repeat, cold)
        med = statistics.median(times)
        print(f"  {name:36s} {med:6.2f} s  {total / med / 1e9:5.2f} GB/s  (runs: {', '.join(f'{t:.2f}' for t in times)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="bytes hashed per run, in GB (default 1)")
    ap.add_argument("--chunk-mb", type=int, default=8, help="streaming chunk in MiB (default 8)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per checksum; the median is printed (default 5)")
    ap.add_argument("--dir", help="time verify_checkpoint on this checkpoint directory instead")
    ap.add_argument("--cold", action="store_true", help="with --dir: evict the directory's files from the page "
                                                        "cache before each run")
    ap.add_argument("--make-3b", metavar="DIR", help="write a random bf16 Qwen2.5-VL-3B-shaped checkpoint to DIR "
                                                      "(2 GB shards, HF layout, with checksums.json) and exit")
    a = ap.parse_args()
    if a.make_3b:
        make_3b(a.make_3b)
    elif a.dir:
        bench_dir(a.dir, a.repeat, a.cold)
    else:
        bench_memory(a.gb, a.chunk_mb, a.repeat)


if __name__ == "__main__":
    main()
