"""Parallelism kept apart from the model (torchtitan's `parallelize`, in MindSpore semi-auto terms).

- `layout.py`: the run's parallel sizes and `rank -> (pp, dp, tp, ep)` coordinates.
- `attention.py`: FlashAttentionScore (TND) and dense attention-core strategies (`shard_core_attention`).
- `parallelize.py`: `parallelize(model, run_config_or_layout)` sets shard strategies on the model's
  primitives (tables in `strategies.py`), pipeline stages (`pipeline.py`) and gradient fusion groups.
- `recompute.py`: `apply_recompute(model, recompute_config)` (full / select / communication recompute).
- `audit.py`: reads strategies back (primitive census, parameter shard shapes) for tests.
"""
from mindvl_ms.parallel.layout import Layout, RankCoords
from mindvl_ms.parallel.parallelize import ParallelReport, parallelize
from mindvl_ms.parallel.pipeline import assign_pipeline_stages, layer_stages
from mindvl_ms.parallel.recompute import apply_recompute

__all__ = ["Layout", "RankCoords", "parallelize", "ParallelReport", "layer_stages", "assign_pipeline_stages",
           "apply_recompute"]
