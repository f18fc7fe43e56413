"""Rotary position embedding in the rotate-half layout: x * cos + rotate_half(x) * sin, in float32.

Three paths, chosen at construction:
- Ascend: the fused `RotaryPositionEmbedding` kernel in rotate-half mode (mode 0); only run on Ascend
  hardware. cos/sin must broadcast against x ([B, N, S, D] with cos [B|1, 1, S, D]).
- CPU, float32 [B, N, S, D] (the default where `ops/cpu_kernels.py` can build its library): one C++ pass
  (`ops/csrc/rotary.cc`) for the forward and one for the backward, equal to the composite ops below bit for
  bit (tests/ops/test_cpu_rotary.py); cos/sin get no gradient (they come from position ids).
- The composite: the cell holds every op as a primitive instance (split, neg, concat, the two multiplies,
  the add) so the parallel layer can shard them (heads over the tensor-parallel group); `drop_kernel`
  switches to it for good (a parallel layout compiles for Ascend). The values are those of the functional
  `rotate_half` below (same kernels). Under dynamic shapes cos/sin are broadcast to x's shape first
  (`ops/broadcast.py`: the CPU kernels' implicit broadcasting is slow and memory-hungry).
"""
import mindspore as ms
from mindspore import nn, ops
from mindspore.ops.auto_generate import RotaryPositionEmbedding as _RopePrim

from mindvl_ms.ops.broadcast import expand_as
from mindvl_ms.ops.cpu_kernels import custom_op
from mindvl_ms.ops.dispatch import is_ascend


def rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


class _RotaryKernel(nn.Cell):
    """The C++ pass with its C++ backward; float32 x [B, N, S, D], cos/sin broadcastable to it."""

    def __init__(self, fwd, bwd):
        super().__init__()
        self.fwd, self.bwd = fwd, bwd

    def construct(self, x, cos, sin):
        return self.fwd(x, cos, sin)

    def bprop(self, x, cos, sin, out, dout):
        return self.bwd(dout, cos, sin), ops.zeros_like(cos), ops.zeros_like(sin)


def _kernel():
    """_RotaryKernel, or None where the C++ library is unavailable (or on Ascend)."""
    if is_ascend():
        return None
    fwd, bwd = custom_op("RotaryHalf", 3), custom_op("RotaryHalfGrad", 3)
    return _RotaryKernel(fwd, bwd) if fwd is not None and bwd is not None else None


class ApplyRotary(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fused = is_ascend()
        self.rope = _RopePrim()             # Ascend fused kernel (x, cos, sin, mode)
        self.cpu_kernel = _kernel()         # CPU float32: the C++ pass (None: composite ops)
        self.kernel = self.cpu_kernel is not None  # read by the graph; only drop_kernel changes it
        self.split = ops.Split(-1, 2)       # x -> (x1, x2) halves of the last dim
        self.neg = ops.Neg()
        self.concat = ops.Concat(-1)        # rotate_half(x) = [-x2, x1]
        self.mul_cos = ops.Mul()
        self.mul_sin = ops.Mul()
        self.add = ops.Add()

    def drop_kernel(self):
        """Composite ops from now on, and no C++ op held (`parallelize`; see the module docstring)."""
        self.kernel = False
        self.cpu_kernel = None

    def construct(self, x, cos, sin):  # x [B, N, S, D], cos/sin broadcastable to x
        dtype = x.dtype
        if self.fused:
            return self.rope(x, cos.astype(dtype), sin.astype(dtype), 0)
        if self.kernel and dtype == ms.float32 and x.ndim == 4 and cos.ndim == 4 and sin.ndim == 4:
            return self.cpu_kernel(x, cos.astype(ms.float32), sin.astype(ms.float32))
        x32 = x.astype(ms.float32)
        x1, x2 = self.split(x32)
        rot = self.concat((self.neg(x2), x1))
        out = self.add(self.mul_cos(x32, expand_as(cos, x32)), self.mul_sin(rot, expand_as(sin, x32)))
        return out.astype(dtype)
