"""Throughput of the checksums a checkpoint manifest could use, streamed over ~1 GB the way the verifier reads.

    python bench/bench_checksum.py [--gb 1] [--chunk-mb 8] [--repeat 5]
    python bench/bench_checksum.py --dir CHECKPOINT_DIR [--repeat 3]

Without --dir: one random buffer of --gb GB in memory, fed to each checksum in --chunk-mb chunks of bytes
(as `checkpoint.io` streams a file); prints the median GB/s (1 GB = 1e9 bytes) of --repeat runs for
hashlib.sha256, zlib.crc32, and CRC32C from the `crc32c` and `google-crc32c` packages when installed.
With --dir: times `checkpoint.io.verify_checkpoint` on a checkpoint directory (wall seconds and GB/s,
median of --repeat, page cache warm after the first run) and prints the first (possibly cold) run too.
The figures are recorded in docs/PERFORMANCE.md, ## checkpoint.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
import zlib

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


def bench_dir(path: str, repeat: int) -> None:
    from mindvl_ms.checkpoint.io import verify_checkpoint

    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        verify_checkpoint(path, model_only=False)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    print(f"verify_checkpoint {path}: {total / 1e9:.2f} GB; first run {times[0]:.2f} s "
          f"({total / times[0] / 1e9:.2f} GB/s); median of {repeat} {med:.2f} s ({total / med / 1e9:.2f} GB/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="bytes hashed per run, in GB (default 1)")
    ap.add_argument("--chunk-mb", type=int, default=8, help="streaming chunk in MiB (default 8)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per checksum; the median is printed (default 5)")
    ap.add_argument("--dir", help="time verify_checkpoint on this checkpoint directory instead")
    a = ap.parse_args()
    if a.dir:
        bench_dir(a.dir, a.repeat)
    else:
        bench_memory(a.gb, a.chunk_mb, a.repeat)


if __name__ == "__main__":
    main()
