"""RMSNorm: y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32 (as HF Qwen2RMSNorm).

Ascend: the fused `RmsNorm` kernel; not available on CPU, so only run on Ascend hardware.
Every op is a primitive instance held by the cell (the CPU path's square, mean, add, rsqrt and the two
multiplies, and the fused `RmsNorm`), so `mindvl_ms.parallel.parallelize` can give each a shard strategy
(batch or sequence split) without the model knowing about parallelism. The values are those of the
functional form `ops.mean(x*x)`, `ops.rsqrt`, ...: the same kernels are called.
CPU path under dynamic shapes (the train step): the [..., 1] statistic and the [D] weight are broadcast to
x's shape before the two multiplies: MindSpore's CPU arithmetic kernels keep two 8-byte index tables per
output element for a broadcasting operation, and run it up to 10x slower (`ops/broadcast.py`).
"""
import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import initializer
from mindspore.ops.auto_generate import RmsNorm as _RmsNormPrim

from .broadcast import expand_as
from .dispatch import is_ascend


class RMSNorm(nn.Cell):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = Parameter(initializer("ones", (dim,), ms.float32), name="weight")
        self.eps = eps
        self.fused = is_ascend()
        self.rms_norm = _RmsNormPrim(eps)           # Ascend fused kernel: (x, gamma) -> (y, rstd)
        self.square = ops.Mul()                     # x * x
        self.mean = ops.ReduceMean(keep_dims=True)  # mean over the last dim
        self.add_eps = ops.Add()
        self.rsqrt = ops.Rsqrt()
        self.mul = ops.Mul()                        # x * rsqrt(var + eps)
        self.mul_weight = ops.Mul()                 # weight * normalised x

    def construct(self, x):  # [..., D]
        if self.fused:
            return self.rms_norm(x, self.weight.astype(x.dtype))[0]
        dtype = x.dtype
        x32 = x.astype(ms.float32)
        var = self.mean(self.square(x32, x32), -1)  # [..., 1]
        x32 = self.mul(x32, expand_as(self.rsqrt(self.add_eps(var, self.eps)), x32))
        return self.mul_weight(expand_as(self.weight.astype(dtype), x32), x32.astype(dtype))
