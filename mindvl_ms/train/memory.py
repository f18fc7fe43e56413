"""Hand the C heap's free pages back to the operating system after the big one-off allocations.

Graph compilation builds and frees hundreds of MB of small C++ objects (IR, passes, kernel selection),
and loading a checkpoint frees the host copies of the weights. glibc keeps freed small blocks inside the
heap (only a free *top* of the heap is returned automatically), so those pages stay resident for the
whole run. `malloc_trim(0)` releases every free page of every arena (madvise), without moving live data.
`TrainStep` calls it after the model is built and after the micro-step graph is compiled (the resident
memory it gives back: docs/PERFORMANCE.md, ## train). A no-op where the C library has no `malloc_trim`
(not glibc).
"""
from __future__ import annotations

import ctypes
import ctypes.util

_TRIM = None


def release_heap() -> bool:
    """Return free heap pages to the OS (glibc `malloc_trim(0)`). True if the C library has it."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            _TRIM.argtypes, _TRIM.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            _TRIM = False
    if not _TRIM:
        return False
    _TRIM(0)
    return True
