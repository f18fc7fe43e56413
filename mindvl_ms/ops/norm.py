"""RMSNorm: y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32 (as HF Qwen2RMSNorm).

Ascend: the fused `RmsNorm` kernel (ops.rms_norm); not available on CPU, so only run on Ascend hardware.
"""
import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import initializer

from .dispatch import is_ascend


class RMSNorm(nn.Cell):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = Parameter(initializer("ones", (dim,), ms.float32), name="weight")
        self.eps = eps
        self.fused = is_ascend()

    def construct(self, x):  # [..., D]
        if self.fused:
            return ops.rms_norm(x, self.weight.astype(x.dtype), self.eps)[0]
        dtype = x.dtype
        x32 = x.astype(ms.float32)
        var = ops.mean(x32 * x32, -1, keep_dims=True)
        x32 = x32 * ops.rsqrt(var + self.eps)
        return self.weight.astype(dtype) * x32.astype(dtype)
