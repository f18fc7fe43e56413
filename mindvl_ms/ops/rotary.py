"""Rotary position embedding in the rotate-half layout: x * cos + rotate_half(x) * sin, in float32.

Ascend: the fused `RotaryPositionEmbedding` kernel in rotate-half mode (mode 0); only run on Ascend
hardware. cos/sin must broadcast against x ([B, N, S, D] with cos [B|1, 1, S, D]).
The cell holds every op as a primitive instance (split, neg, concat, the two multiplies, the add, and the
fused kernel) so the parallel layer can shard them (heads over the tensor-parallel group); the values are
those of the functional `rotate_half` below (same kernels). CPU path under dynamic shapes: cos/sin are broadcast
to x's shape first (`ops/broadcast.py`: the CPU kernels' implicit broadcasting is slow and memory-hungry).
"""
import mindspore as ms
from mindspore import nn, ops
from mindspore.ops.auto_generate import RotaryPositionEmbedding as _RopePrim

from .broadcast import expand_as
from .dispatch import is_ascend


def rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


class ApplyRotary(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fused = is_ascend()
        self.rope = _RopePrim()             # Ascend fused kernel (x, cos, sin, mode)
        self.split = ops.Split(-1, 2)       # x -> (x1, x2) halves of the last dim
        self.neg = ops.Neg()
        self.concat = ops.Concat(-1)        # rotate_half(x) = [-x2, x1]
        self.mul_cos = ops.Mul()
        self.mul_sin = ops.Mul()
        self.add = ops.Add()

    def construct(self, x, cos, sin):  # x [B, N, S, D], cos/sin broadcastable to x
        dtype = x.dtype
        if self.fused:
            return self.rope(x, cos.astype(dtype), sin.astype(dtype), 0)
        x32 = x.astype(ms.float32)
        x1, x2 = self.split(x32)
        rot = self.concat((self.neg(x2), x1))
        out = self.add(self.mul_cos(x32, expand_as(cos, x32)), self.mul_sin(rot, expand_as(sin, x32)))
        return out.astype(dtype)
