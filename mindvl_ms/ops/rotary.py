"""Rotary position embedding in the rotate-half layout: x * cos + rotate_half(x) * sin, in float32.

Ascend: `ops.rotary_position_embedding(x, cos, sin, mode=0)` (the fused kernel, rotate-half mode); only
run on Ascend hardware. cos/sin must broadcast against x ([B, N, S, D] with cos [B|1, 1, S, D]).
"""
import mindspore as ms
from mindspore import nn, ops

from .dispatch import is_ascend


def rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


class ApplyRotary(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fused = is_ascend()

    def construct(self, x, cos, sin):  # x [B, N, S, D], cos/sin broadcastable to x
        dtype = x.dtype
        if self.fused:
            return ops.rotary_position_embedding(x, cos.astype(dtype), sin.astype(dtype), 0)
        x32 = x.astype(ms.float32)
        out = x32 * cos + rotate_half(x32) * sin
        return out.astype(dtype)
