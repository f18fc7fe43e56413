"""`Linear`: nn.Dense (weight [out, in], as torch Linear) whose bias gradient is a matmul on CPU.

MindSpore's CPU BiasAddGrad reduces [N, out] over N several times slower than the same sum as a ones-row
matmul (timings: docs/PERFORMANCE.md, "## ops"). On CPU the bias add is `BiasAddMatMulGrad`: the same
BiasAdd forward, and a hand-written backward whose bias gradient is ones[1, N] @ dout. On Ascend, where
parallel layouts compile and attach strategies to nn.Dense's own `matmul` / `bias_add` primitives, the
forward is nn.Dense's. Parameter names and layouts are nn.Dense's, so `isinstance(cell, nn.Dense)` holds and weight
conversion is unaffected.
"""
from mindspore import nn, ops

from mindvl_ms.ops.dispatch import is_ascend

_BIAS_ADD = ops.BiasAdd()
_MM = ops.MatMul()


class BiasAddMatMulGrad(nn.Cell):
    """x [N, out] + b [out]; backward: (dout, ones[1, N] @ dout)."""

    def construct(self, x, b):
        return _BIAS_ADD(x, b)

    def bprop(self, x, b, out, dout):
        ones = ops.ones((1, dout.shape[0]), dout.dtype)
        return dout, _MM(ones, dout).reshape(b.shape).astype(b.dtype)


class Linear(nn.Dense):
    """nn.Dense with the CPU bias gradient as a matmul (see the module doc); no activation."""

    def __init__(self, in_channels: int, out_channels: int, weight_init="normal", bias_init="zeros",
                 has_bias: bool = True):
        super().__init__(in_channels, out_channels, weight_init=weight_init, bias_init=bias_init,
                         has_bias=has_bias)
        self.cpu_bias = bool(has_bias) and not is_ascend()
        self.bias_add_cpu = BiasAddMatMulGrad()

    def construct(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                 # [N, in]
        x = self.matmul(x, self.weight)                              # [N, out]
        if self.has_bias:
            x = self.bias_add_cpu(x, self.bias) if self.cpu_bias else self.bias_add(x, self.bias)
        return x.reshape(shape[:-1] + (x.shape[-1],))
