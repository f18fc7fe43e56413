"""Hand-written CPU kernels (`ops/csrc/*.cc`) run as MindSpore `ops.Custom(func_type="aot")` ops.

MindSpore's CPU backend runs every elementwise op as its own kernel, each one a pass over memory; where a
chain of them costs more than the MatMul it follows, one C++ pass replaces it. Most kernels round every
float op as the unfused chain does, so results are bit-identical to the composite path (tests/
test_cpu_kernels.py); the exceptions say so in their header (sum_squares.cc sums in double, head_ce.cc
has its own exp and summation order) and are tested against float64 references. The composite path stays
as the fallback.

The shared library is compiled on first use with the C++ compiler in `$CXX` (default `g++`), into
`$XDG_CACHE_HOME/mindvl_ms/kernels/` (default `~/.cache/...`), named by a hash of the sources, the
build command and the host (`-march=native`), so an edited source, another compiler or another machine
sharing the home directory gets its own build. Builds are atomic (written under a temporary name, then
renamed), so concurrent processes (msrun ranks, several runs on one machine) can race safely. Without a
compiler, or if the build or the load fails, the callers keep their composite ops after one warning.
CPU only: on Ascend the fused CANN kernels are used.
"""
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

from mindspore import ops
from mindspore.ops import CustomRegOp, DataType

logger = logging.getLogger(__name__)

SOURCES = ("attention_mask.cc", "fused_adamw.cc", "head_ce.cc", "qkv_rope.cc", "rms_norm.cc", "rotary.cc",
           "sum_squares.cc")
# -ffp-contract=off: no fused multiply-add, every product and sum is rounded as MindSpore's kernels round it
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c++14")


def cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "mindvl_ms", "kernels")


def _source_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


@functools.lru_cache(maxsize=None)
def library():
    """Path of the compiled kernel library, building it if needed; None (with one warning) if it cannot be
    built here."""
    cxx = os.environ.get("CXX", "g++")
    sources = [os.path.join(_source_dir(), s) for s in SOURCES]
    digest = hashlib.sha256()
    for path in sources:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join((cxx,) + FLAGS + (platform.machine(), platform.node())).encode())
    out = os.path.join(cache_dir(), f"libmindvl_cpu_{digest.hexdigest()[:16]}.so")
    if os.path.exists(out):
        return out
    if shutil.which(cxx) is None:
        logger.warning("mindvl_ms CPU kernels: C++ compiler %r not found (set CXX); using the composite "
                       "MindSpore ops (same values, slower)", cxx)
        return None
    tmp = None
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=os.path.dirname(out))
        os.close(fd)
        cmd = [cxx, *FLAGS, *sources, "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        logger.warning("mindvl_ms CPU kernels: build failed (%s); using the composite MindSpore ops (same "
                       "values, slower)", e)
        return None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
    return out


_WARNED = set()  # kernels whose load failure was already reported


def custom_op(name: str, n_inputs: int):
    """ops.Custom for kernel `name` of the library: `n_inputs` float32 tensors in, one float32 tensor out;
    None when the library is not available. Output shape and dtype come from the library's
    `<name>InferShape` / `<name>InferType` (MindSpore's C++ inference, which dynamic shapes need; it also
    needs the registration info with the inputs' names)."""
    lib = library()
    if lib is None:
        return None
    reg = CustomRegOp(name)
    for i in range(n_inputs):
        reg = reg.input(i, f"x{i}")
    reg = reg.output(0, "y").dtype_format(*[DataType.F32_Default] * (n_inputs + 1)).target("CPU").get_op_info()
    try:
        return ops.Custom(f"{lib}:{name}", out_shape=None, out_dtype=None, func_type="aot", reg_info=reg)
    except (TypeError, ValueError, RuntimeError) as e:  # e.g. the library outside MS_CUSTOM_AOT_WHITE_LIST
        if name not in _WARNED:  # once per kernel, not once per layer
            _WARNED.add(name)
            logger.warning("mindvl_ms CPU kernel %s not loaded (%s); using the composite MindSpore ops", name, e)
        return None


def drop_kernels(model) -> int:
    """Switch every cell of `model` that holds one of these kernels (its `drop_kernel`) to its composite
    MindSpore ops; returns how many. For graphs that leave this machine: an exported MindIR must not name a
    library built in this machine's cache. The model's forward values stay the same (its kernels' forwards are
    bitwise equal to their composite ops; the training loss head's kernels agree with theirs to float32
    rounding)."""
    n = 0
    for _, cell in model.cells_and_names():
        if getattr(cell, "kernel", False) and callable(getattr(cell, "drop_kernel", None)):
            cell.drop_kernel()
            n += 1
    return n
