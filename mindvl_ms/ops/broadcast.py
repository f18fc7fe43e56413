"""Explicit broadcasting for the CPU paths' elementwise operations under dynamic shapes.

MindSpore's CPU arithmetic kernels (Mul, Add, Sub, ... : `ArithmeticCpuKernelMod`) handle operands of
different shapes through two index tables, one 8-byte entry per output element each, built when the
kernel is resized and kept for the kernel's lifetime. With dynamic shapes (the train step compiles once
with `set_inputs`) the broadcasting kernel is also far slower. Measured on 2 cores, per operation
(`[1, 8, 472, 472] + [1, 1, 472, 472]` / `[1, 472, 512] * [1, 472, 1]`, 16 operations per graph):

  operands                          dynamic shapes        static shapes         RSS of 16 operations
  implicit broadcast                11.5 ms / 1.61 ms     1.86 ms / 0.28 ms     +464 MB / +77 MB
  broadcast_to, then same-shape      0.78 ms / 0.18 ms     0.79 ms / 0.18 ms     +50 MB / +25 MB

So `expand_as` broadcasts explicitly (a BroadcastTo kernel, whose backward is a ReduceSum) when x's
shape is unknown at compile time, and leaves the broadcast to the arithmetic kernel when it is static:
there the extra BroadcastTo kernels cost more than they save (ViT forward at 448x448, static: 22
BroadcastTo kernels took 11.7 ms and the multiplies 1.6 ms less). On the `small` train step
(bench/profile_memory.py) the tables held ~0.5 GB: the attention bias add and the softmax backward over
[B, H, L, S] scores, the norms' statistic and weight, RoPE's cos/sin. Broadcasting copies values
exactly, so results are the same either way.
"""
from mindspore import ops
from mindspore.ops import functional as F


def expand_as(y, x):
    """y broadcast to x's shape by a BroadcastTo kernel when x's shape is dynamic; y itself otherwise."""
    if F.is_sequence_value_unknown(x.shape):
        return ops.broadcast_to(y, x.shape)
    return y
