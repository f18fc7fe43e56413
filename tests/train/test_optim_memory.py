"""The fp32 accumulators and the AdamW moments are clones of the parameters, never host arrays: on an
abstract 1 GiB parameter set (Parameters from `initializer('zeros', ...)`, never materialised) building
them adds under 50 MB of resident memory, and each one carries its parameter's clone identity (the link
MindSpore's tensor- and optimizer-parallel layout follows). Measured in a fresh subprocess so the
figure is not blurred by what other tests allocated.

    python -m pytest -q tests/train/test_optim_memory.py
"""
import gc
import json
import subprocess
import sys
import weakref

import mindspore as ms
import numpy as np
from mindspore import Parameter
from mindspore.common.initializer import initializer

from mindvl_ms.train.optim import AdamWUpdate, zeros_like_params
from tests.support import allocator

PROBE = r"""
import json
import mindspore as ms
from mindspore import Parameter
from mindspore.common.initializer import initializer
from mindvl_ms.train.optim import AdamWUpdate, zeros_like_params

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0

params = [Parameter(initializer("zeros", (4096, 8192), ms.float32), name=f"layers.{i}.w") for i in range(8)]
before = rss_mb()
accum = zeros_like_params(params, "accum")
after_accum = rss_mb()
upd = AdamWUpdate(params, accum, {}, 0.1, 0.9, 0.95, 1e-8)
after_optim = rss_mb()
print(json.dumps({"param_mb": sum(4 * p.shape[0] * p.shape[1] for p in params) / 2 ** 20,
                  "accum_mb": after_accum - before, "optim_mb": after_optim - after_accum,
                  "dtypes": sorted({str(x.dtype) for x in list(accum) + list(upd.m) + list(upd.v)})}))
"""


def test_accumulators_and_moments_add_no_host_memory_on_an_abstract_1gb_parameter_set():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600, check=True,
                         env=allocator.system_env())  # glibc's malloc, as a user runs it
    fig = json.loads(out.stdout.strip().splitlines()[-1])
    assert fig["param_mb"] == 1024.0
    assert fig["dtypes"] == ["Float32"]
    assert fig["accum_mb"] + fig["optim_mb"] < 50.0, fig


def test_accumulators_are_zero_float32_clones_named_by_their_parameter():
    w = Parameter(ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)), name="model.w")
    h = Parameter(initializer("ones", (5,), ms.float16), name="model.h")  # not float32: a float32 zero tensor
    acc = zeros_like_params([w, h], "accum")
    assert [a.name for a in acc] == ["accum.model.w", "accum.model.h"]
    assert [a.dtype for a in acc] == [ms.float32, ms.float32]
    assert [a.shape for a in acc] == [(3, 4), (5,)]
    assert not any(a.requires_grad for a in acc)
    assert all(not a.asnumpy().any() for a in acc)
    assert any(c is acc[0] for c in w.param_info.cloned_obj)  # a clone of its parameter (the layout follows it)
    upd = AdamWUpdate([w], acc[:1], {}, 0.1, 0.9, 0.95, 1e-8)
    clones = w.param_info.cloned_obj
    assert any(c is upd.m[0] for c in clones) and any(c is upd.v[0] for c in clones)
    assert any(c is acc[0] for c in clones)
    np.testing.assert_array_equal(w.asnumpy(), np.arange(12, dtype=np.float32).reshape(3, 4))  # untouched


def test_a_new_step_replaces_the_previous_steps_clones():
    """The parameter's clone list (which MindSpore's parallel layout reads) holds its clones alive: the next
    stage's accumulators and moments take the place of the previous stage's, which are then freed."""
    w = Parameter(initializer("zeros", (3, 4), ms.float32), name="model.w")
    acc = zeros_like_params([w], "accum")
    upd = AdamWUpdate([w], acc, {}, 0.1, 0.9, 0.95, 1e-8)
    old = [weakref.ref(x) for x in (acc[0], upd.m[0], upd.v[0])]
    del acc, upd
    acc = zeros_like_params([w], "accum")
    upd = AdamWUpdate([w], acc, {}, 0.1, 0.9, 0.95, 1e-8)
    gc.collect()
    assert all(r() is None for r in old)
    assert sorted(c.name for c in w.param_info.cloned_obj) == ["accum.model.w", "adam_m.model.w", "adam_v.model.w"]
