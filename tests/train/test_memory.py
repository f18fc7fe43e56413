"""bench/profile_memory.py's readers of /proc: an allocation of known size shows up in RSS and as a mapping;
train/memory.py's release_heap gives freed heap blocks back (seen in RSS).
Run: pytest -q tests/train/test_memory.py"""
import ctypes
import importlib.util
import os

import numpy as np

from mindvl_ms.train.memory import release_heap
from tests.support.paths import ROOT

_spec = importlib.util.spec_from_file_location("profile_memory", os.path.join(ROOT, "bench", "profile_memory.py"))
_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_profile)
largest_mappings, rss_mb = _profile.largest_mappings, _profile.rss_mb


def test_rss_and_mappings_see_a_256_mb_array():
    before, _ = rss_mb()
    a = np.ones(64 * 2 ** 20, np.float32)  # 256 MB, touched
    after, peak = rss_mb()
    assert 240 <= after - before <= 300, (before, after)
    assert peak >= after - 4  # the kernel updates the high-water mark lazily
    maps = largest_mappings(200)
    assert all(a[0] >= b[0] for a, b in zip(maps, maps[1:]))  # largest first
    ours = lambda ms: sum(1 for mb, name in ms if 250 <= mb <= 260 and name == "[anonymous]")  # noqa: E731
    assert ours(maps) >= 1, maps[:5]  # numpy's buffer: its own anonymous mmap of 256 MB
    del a
    now, peak_after = rss_mb()
    assert now < after - 200 and peak_after >= after - 4  # freed; the peak stays
    assert ours(largest_mappings(200)) == ours(maps) - 1


def test_release_heap_returns_freed_small_blocks():
    """mindvl_ms.train.memory.release_heap (called by TrainStep after the model build and the graph compile):
    200 MB of 100 KB blocks, below glibc's mmap threshold so they live in the heap, freed while the last
    block stays live (so glibc's automatic trim of the heap top cannot return them): RSS keeps them until
    release_heap(), which gives back nearly all of it."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 100 * 1024, 2000
    release_heap()
    base, _ = rss_mb()
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # touched: resident
    touched, _ = rss_mb()
    assert touched - base >= 180, (base, touched)
    for b in blocks[:-1]:
        libc.free(b)
    kept, _ = rss_mb()
    assert kept - base >= 150, (base, kept)  # freed, but still resident
    assert release_heap()
    released, _ = rss_mb()
    assert kept - released >= 150, (kept, released)
    libc.free(blocks[-1])
