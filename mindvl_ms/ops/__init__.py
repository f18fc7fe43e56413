"""Kernel dispatch: Ascend fused operators vs pure-MindSpore CPU code with the same semantics.

Every op here is a small Cell that decides, once at construction time, whether to call the Ascend fused
kernel (`is_ascend()`), so `construct` holds a constant branch and graphs stay static. The CPU branches are
what the test-suite proves against numpy / transformers; the Ascend branches call the fused primitives with
the same inputs and layouts and are exercised only on Ascend hardware (noted in each docstring).
"""
from .dispatch import is_ascend
from .norm import RMSNorm
from .rotary import ApplyRotary, rotate_half
from .activation import SwiGLU
from .attention import CoreAttention, segment_bias
from .linear import Linear

__all__ = ["is_ascend", "RMSNorm", "ApplyRotary", "rotate_half", "SwiGLU", "CoreAttention", "segment_bias", "Linear"]
