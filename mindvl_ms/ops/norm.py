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

`AddRMSNorm` is the residual add of a pre-norm block followed by this norm, both results returned: the
fused `AddRmsNorm` kernel on Ascend, the add then the RMSNorm above elsewhere (the unfused pair itself).
"""
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer
from mindspore.ops.auto_generate import AddRmsNorm as _AddRmsNormPrim, RmsNorm as _RmsNormPrim

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
        return self.normalize(x)

    def normalize(self, x):  # [..., D]
        if self.fused:
            return self.rms_norm(x, self.weight.astype(x.dtype))[0]
        dtype = x.dtype
        if self.kernel and dtype == ms.float32:
            return self.cpu_kernel(x, self.weight, self.eps_t)
        x32 = x.astype(ms.float32)
        var = self.mean(self.square(x32, x32), -1)  # [..., 1]
        x32 = self.mul(x32, expand_as(self.rsqrt(self.add_eps(var, self.eps)), x32))
        return self.mul_weight(expand_as(self.weight.astype(dtype), x32), x32.astype(dtype))


class _AddRmsNormKernel(nn.Cell):
    """The fused Ascend kernel, held as a cell so `AddRMSNorm.unfuse_add` can drop it."""

    def __init__(self):
        super().__init__()
        self.kernel = _AddRmsNormPrim()

    def construct(self, x1, x2, gamma, eps):  # -> (y, rstd, x1 + x2)
        return self.kernel(x1, x2, gamma, eps)


class AddRMSNorm(RMSNorm):
    """Residual add, then RMSNorm: construct(x, residual) -> (norm(residual + x), residual + x).

    The `h = residual + attn_out; normed = post_attention_layernorm(h)` step of a pre-norm decoder layer,
    the sum returned for the layer's next residual add. The weight is this cell's `weight`, as in RMSNorm,
    so checkpoint names do not change.
    - Ascend: the fused `AddRmsNorm` kernel, (residual, x, weight, eps) -> (y, rstd, residual + x): one pass
      over both inputs instead of an Add kernel and an RmsNorm kernel.
    - Elsewhere: `self.add`, then `RMSNorm.normalize` of the sum (C++ kernel or composite ops): the unfused
      pair itself, so results equal an Add followed by an RMSNorm bit for bit (tests/ops/test_add_rms_norm.py).
    - `unfuse_add()` (`parallelize`): MindSpore's semi-auto parallel has no sharding rule for AddRmsNorm, so a
      parallel layout runs the add and the norm as two primitives, each with its strategy.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)
        self.fused_add = self.fused                 # read by the graph; only unfuse_add changes it
        self.add_rms_norm = _AddRmsNormKernel()     # Ascend: (x1, x2, gamma, eps) -> (y, rstd, x1 + x2)
        self.add = ops.Add()                        # residual + x

    def unfuse_add(self):
        """The add and the norm as separate primitives from now on, and no AddRmsNorm held (see above)."""
        self.fused_add = False
        self.add_rms_norm = None

    def construct(self, x, residual):  # [..., D] x2 -> ([..., D], [..., D])
        if self.fused_add:
            y, _, total = self.add_rms_norm(residual, x, self.weight.astype(x.dtype), self.eps)
            return y, total
        total = self.add(residual, x)
        return self.normalize(total), total
