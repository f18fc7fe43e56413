"""SwiGLU: silu(gate) * up.

Ascend: the fused `Swiglu` kernel on concat([gate, up], -1) (it splits the last dim in halves and applies
Swish to the first); only run on Ascend hardware.
"""
from mindspore import nn, ops

from .dispatch import is_ascend


class SwiGLU(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fused = is_ascend()

    def construct(self, gate, up):
        if self.fused:
            return ops.swiglu(ops.cat((gate, up), -1), -1)
        return ops.silu(gate) * up
