"""The tests' malloc: oneTBB's scalable allocator (the `tbb` wheel of requirements-test.txt puts libtbbmalloc
and its malloc-replacing proxy in the environment's lib/), preloaded into the pytest-xdist workers and every
process they start (tests/conftest.py).

Why: most of the suite's time is MindSpore graph compiles, which allocate millions of small objects; under
tbbmalloc they run about a fifth faster than under glibc's malloc (docs/PERFORMANCE.md, ## tests). And
memory that glibc happens to hand back unchanged is reused at once, which exposes reads of stale memory
(tests/train/test_loss_head.py::test_composite_chunk_loop_matches_numpy_on_every_call). The tests that measure
a process's resident memory run it on glibc's malloc (`system_env`), as a user does: tbbmalloc keeps freed
memory for reuse and writes calloc's zeros, which glibc leaves to untouched pages.
"""
import os
import sys
from typing import Optional

LIBS = ("libtbbmalloc.so.2", "libtbbmalloc_proxy.so.2")  # the proxy needs the allocator: loaded first


def preload() -> Optional[str]:
    """The LD_PRELOAD value that puts tbbmalloc under a process, or None where the libraries are not installed
    (another platform, an environment without requirements-test.txt)."""
    paths = [os.path.join(sys.prefix, "lib", name) for name in LIBS]
    return " ".join(paths) if all(os.path.isfile(p) for p in paths) else None


def env_with_preload(env: Optional[dict] = None) -> dict:
    """`env` (default: this process's) with tbbmalloc added in front of its LD_PRELOAD (unchanged if absent)."""
    env = dict(os.environ if env is None else env)
    libs = preload()
    if libs and libs not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(x for x in (libs, env.get("LD_PRELOAD", "")) if x)
    return env


def system_env(env: Optional[dict] = None) -> dict:
    """`env` (default: this process's) without tbbmalloc in its LD_PRELOAD: a child on glibc's malloc."""
    env = dict(os.environ if env is None else env)
    libs = set((preload() or "").split())
    rest = [x for x in env.get("LD_PRELOAD", "").split() if x not in libs]
    if rest:
        env["LD_PRELOAD"] = " ".join(rest)
    else:
        env.pop("LD_PRELOAD", None)
    return env
