"""Parallelism kept apart from the model (torchtitan's `parallelize`, in MindSpore semi-auto terms).

- `layout.py`: the run's parallel sizes and `rank -> (pp, dp, tp, ep)` coordinates.
"""
from .layout import Layout, RankCoords

__all__ = ["Layout", "RankCoords"]
