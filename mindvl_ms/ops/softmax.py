"""log-softmax as x - logsumexp(x): max, exp, sum and log kernels instead of MindSpore's LogSoftmax.

MindSpore 2.9's CPU LogSoftmax kernel can return stale values: inside the LM head's chunk loop and in the
train steps' cross-entropies, results changed from call to call once the process ran on another malloc
(tbbmalloc or jemalloc: glibc's happened to hand the kernel back buffers that still held the right values;
tests/train/test_loss_head.py, tests/train/test_resume.py). The composite below gives float32 log-softmax
values on every backend, at the cost of [N, V] temporaries the fused kernel does not hold.
"""
from mindspore import ops


def log_softmax(x, axis: int = -1):
    """log-softmax of float `x` along `axis` (same shape), computed as x - logsumexp(x) (max-shifted)."""
    return x - ops.logsumexp(x, axis, True)
