"""Parallelism kept apart from the model (torchtitan's `parallelize`, in MindSpore semi-auto terms).

- `layout.py`: the run's parallel sizes and `rank -> (pp, dp, tp, ep)` coordinates.
- `attention.py`: FlashAttentionScore (TND) and dense attention-core strategies (`shard_core_attention`).
"""
from .layout import Layout, RankCoords

__all__ = ["Layout", "RankCoords"]
