"""RMSNorm: y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32 (as HF Qwen2RMSNorm).

Three paths, chosen at construction:
- Ascend: the fused `RmsNorm` kernel; not available on CPU, so only run on Ascend hardware.
- CPU, float32 (the default where `ops/cpu_kernels.py` can build its library): one C++ pass per row
  (`ops/csrc/rms_norm.cc`) with a hand-written backward (two passes: d(x) and d(weight)). Its forward
  equals the composite ops below bit for bit; its backward is the analytic gradient, equal to autodiff's
  to float32 rounding (tests/ops/test_cpu_norm.py). It replaces six kernels per norm forward (eight with
  dynamic shapes) and autodiff's ~12 backward kernels, broadcasts and reductions included.
- The composite: every op a primitive instance held by the cell (square, mean, add, rsqrt and the two
  multiplies), so `mindvl_ms.parallel.parallelize` can give each a shard strategy (batch or sequence split)
  without the model knowing about parallelism; `drop_kernel` switches a norm to it for good (a parallel
  layout compiles for Ascend, where the C++ kernel never runs). Also the path of other dtypes and of
  machines without a C++ compiler. Under dynamic shapes (the train step) the [..., 1] statistic and the [D]
  weight are broadcast to x's shape before the two multiplies: MindSpore's CPU arithmetic kernels keep two
  8-byte index tables per output element for a broadcasting operation, and run it far slower
  (`ops/broadcast.py`).
"""
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer
from mindspore.ops.auto_generate import RmsNorm as _RmsNormPrim

from mindvl_ms.ops.broadcast import expand_as
from mindvl_ms.ops.cpu_kernels import custom_op
from mindvl_ms.ops.dispatch import is_ascend


class _RmsNormKernel(nn.Cell):
    """The C++ pass with its hand-written backward; float32 x [..., D], weight [D], eps [1]."""

    def __init__(self, fwd, grad_x, grad_w):
        super().__init__()
        self.fwd, self.grad_x, self.grad_w = fwd, grad_x, grad_w

    def construct(self, x, weight, eps):
        return self.fwd(x, weight, eps)

    def bprop(self, x, weight, eps, out, dout):
        return self.grad_x(dout, x, weight, eps), self.grad_w(dout, x, eps), ops.zeros_like(eps)


def _kernel():
    """_RmsNormKernel, or None where the C++ library is unavailable (or on Ascend)."""
    if is_ascend():
        return None
    ops_ = (custom_op("RmsNorm", 3), custom_op("RmsNormGradX", 4), custom_op("RmsNormGradW", 3))
    return _RmsNormKernel(*ops_) if all(o is not None for o in ops_) else None


class RMSNorm(nn.Cell):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = Parameter(initializer("ones", (dim,), ms.float32), name="weight")
        self.eps = eps
        self.fused = is_ascend()
        self.rms_norm = _RmsNormPrim(eps)           # Ascend fused kernel: (x, gamma) -> (y, rstd)
        self.cpu_kernel = _kernel()                 # CPU float32: the C++ pass (None: composite ops)
        self.kernel = self.cpu_kernel is not None   # read by the graph; only drop_kernel changes it
        self.eps_t = Tensor([eps], ms.float32)
        self.square = ops.Mul()                     # x * x
        self.mean = ops.ReduceMean(keep_dims=True)  # mean over the last dim
        self.add_eps = ops.Add()
        self.rsqrt = ops.Rsqrt()
        self.mul = ops.Mul()                        # x * rsqrt(var + eps)
        self.mul_weight = ops.Mul()                 # weight * normalised x

    def drop_kernel(self):
        """Composite ops from now on, and no C++ op held (`parallelize`; see the module docstring)."""
        self.kernel = False
        self.cpu_kernel = None

    def construct(self, x):  # [..., D]
        if self.fused:
            return self.rms_norm(x, self.weight.astype(x.dtype))[0]
        dtype = x.dtype
        if self.kernel and dtype == ms.float32:
            return self.cpu_kernel(x, self.weight, self.eps_t)
        x32 = x.astype(ms.float32)
        var = self.mean(self.square(x32, x32), -1)  # [..., 1]
        x32 = self.mul(x32, expand_as(self.rsqrt(self.add_eps(var, self.eps)), x32))
        return self.mul_weight(expand_as(self.weight.astype(dtype), x32), x32.astype(dtype))
