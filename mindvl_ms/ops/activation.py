"""Gated FFN activations: SwiGLU silu(gate) * up, and act(gate) * up for other activations.

Ascend: the fused `Swiglu` kernel on concat([gate, up], -1) (it splits the last dim in halves and applies
Swish to the first); only run on Ascend hardware. The fused path concatenates on the FFN dim, which a
tensor-parallel strategy splits; `mindvl_ms.parallel.parallelize` therefore switches a SwiGLU whose FFN dim
is sharded to the unfused path (`fused = False`, same values), see parallel/strategies.py.
Ops are primitive instances held by the cell so that they can carry shard strategies.
"""
from mindspore import nn
from mindspore import ops
from mindspore.ops.auto_generate import SiLU, Swiglu

from mindvl_ms.ops.dispatch import is_ascend


class SwiGLU(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fused = is_ascend()
        self.concat = ops.Concat(-1)   # Ascend: [gate, up] -> [..., 2I]
        self.swiglu = Swiglu()         # Ascend fused kernel
        self.silu = SiLU()
        self.mul = ops.Mul()

    def construct(self, gate, up):
        if self.fused:
            return self.swiglu(self.concat((gate, up)), -1)
        return self.mul(self.silu(gate), up)


def activation(name: str) -> nn.Cell:
    """The HF ACT2FN activation `name` as a cell (gelu is the exact erf form, as torch)."""
    if name == "gelu":
        return nn.GELU(approximate=False)
    if name == "gelu_pytorch_tanh":
        return nn.GELU(approximate=True)
    if name == "quick_gelu":
        return QuickGELU()
    if name == "silu":
        return nn.SiLU()
    raise ValueError(f"activation '{name}': expected silu, gelu, gelu_pytorch_tanh or quick_gelu")


class QuickGELU(nn.Cell):
    def construct(self, x):
        return x * ops.sigmoid(1.702 * x)


class GatedAct(nn.Cell):
    """act(gate) * up for a non-SiLU activation (HF `down(act_fn(gate(x)) * up(x))`)."""

    def __init__(self, name: str):
        super().__init__()
        self.act = activation(name)
        self.mul = ops.Mul()

    def construct(self, gate, up):
        return self.mul(self.act(gate), up)
