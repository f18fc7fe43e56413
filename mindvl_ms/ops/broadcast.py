"""Explicit broadcasting for the CPU paths' elementwise operations under dynamic shapes.

MindSpore's CPU arithmetic kernels (Mul, Add, Sub, ... : `ArithmeticCpuKernelMod`) handle operands of
different shapes through two index tables, one 8-byte entry per output element each, built when the
kernel is resized and kept for the kernel's lifetime. With dynamic shapes (the train step compiles once
with `set_inputs`) the broadcasting kernel is also far slower than a BroadcastTo kernel followed by the
same-shape operation, and the tables of the large operands (the attention bias add and the softmax
backward over [B, H, L, S] scores, the norms' statistic and weight, RoPE's cos/sin) hold a large share of
the train step's memory.

So `expand_as` broadcasts explicitly (a BroadcastTo kernel, whose backward is a ReduceSum) when x's
shape is unknown at compile time, and leaves the broadcast to the arithmetic kernel when it is static:
there the extra BroadcastTo kernels cost more than they save. Broadcasting copies values exactly, so
results are the same either way. Timings and memory of both ways: docs/PERFORMANCE.md, "## ops".
"""
from mindspore import ops
from mindspore.ops import functional as F


def expand_as(y, x):
    """y broadcast to x's shape by a BroadcastTo kernel when x's shape is dynamic; y itself otherwise."""
    if F.is_sequence_value_unknown(x.shape):
        return ops.broadcast_to(y, x.shape)
    return y
