"""Parallelism kept apart from the model (torchtitan's `parallelize`, in MindSpore semi-auto terms).

- `layout.py`: the run's parallel sizes and `rank -> (pp, dp, tp, ep)` coordinates.
- `parallelize.py`: `parallelize(model, layout_or_run_config)` in steps (apply_ep, apply_vision, apply_tp,
  apply_pipeline, apply_gradient_fusion, apply_recompute), each from a plan keyed by module path
  (`paths.py`) whose styles (`styles.py`) declare the strategy tables of `strategies.py`.
- `attention.py`: FlashAttentionScore (TND) and dense attention-core strategies (`shard_core_attention`).
- `moe.py`, `mindformers_moe.py`: expert parallel with MindFormers' router and all-to-all dispatcher.
- `pipeline.py`: pipeline stages; `recompute.py`: full / select / communication recompute.
- `audit.py`: reads strategies back (primitive census, parameter shard shapes) for tests.
"""
from mindvl_ms.parallel.layout import Layout, RankCoords
from mindvl_ms.parallel.parallelize import parallelize
from mindvl_ms.parallel.styles import ParallelReport
from mindvl_ms.parallel.pipeline import assign_pipeline_stages, layer_stages
from mindvl_ms.parallel.recompute import apply_recompute

__all__ = ["Layout", "RankCoords", "parallelize", "ParallelReport", "layer_stages", "assign_pipeline_stages",
           "apply_recompute"]
