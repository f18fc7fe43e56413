"""Kernel dispatch: Ascend fused operators vs pure-MindSpore CPU code with the same semantics.

Every op here is a small Cell that decides, once at construction time, whether to call the Ascend fused
kernel (`is_ascend()`), so `construct` holds a constant branch and graphs stay static. The CPU branches are
what the test-suite proves against numpy / transformers; the Ascend branches call the fused primitives with
the same inputs and layouts and are exercised only on Ascend hardware (noted in each docstring).
"""
from mindvl_ms.ops.dispatch import is_ascend
from mindvl_ms.ops.norm import AddRMSNorm, RMSNorm
from mindvl_ms.ops.rotary import ApplyRotary, rotate_half
from mindvl_ms.ops.activation import SwiGLU
from mindvl_ms.ops.attention import CoreAttention, segment_bias
from mindvl_ms.ops.linear import Linear

__all__ = ["is_ascend", "RMSNorm", "AddRMSNorm", "ApplyRotary", "rotate_half", "SwiGLU", "CoreAttention",
           "segment_bias", "Linear"]
