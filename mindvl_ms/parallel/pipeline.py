"""Pipeline stages: which stage runs each decoder layer, and the assignment of `cell.pipeline_stage`.

MindFormers semantics of `parallel_config.offset`: stage i runs `layers // pp + offset[i]` consecutive
decoder layers (an empty offset means an even split, which needs layers % pp == 0). The embedding, the
vision tower and the projector run on stage 0; the final norm, the LM head and multi-token-prediction
layers on the last stage. The trainer wraps the step for `micro_batch_num` micro-batches; this module only
places cells.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from mindvl_ms.config.base import ConfigError


def layer_stages(num_layers: int, pp: int, offset: Sequence[int] = ()) -> List[int]:
    """Stage index of each decoder layer, e.g. layer_stages(61, 4, [1, 0, 0, 0]) -> 16 x 0, 15 x 1, ..."""
    if pp < 1:
        raise ConfigError(f"pipeline_stage must be >= 1, got {pp}")
    offset = list(offset) or [0] * pp
    if len(offset) != pp:
        raise ConfigError(f"parallel_config.offset {offset}: needs {pp} entries (one per pipeline stage)")
    if not any(offset) and num_layers % pp:
        raise ConfigError(f"{num_layers} layers do not split evenly over {pp} stages: set parallel_config.offset")
    per = [num_layers // pp + o for o in offset]
    if sum(per) != num_layers or min(per) < 1:
        raise ConfigError(f"parallel_config.offset {offset}: stages would get {per} layers (sum {sum(per)}), "
                          f"need every stage >= 1 and a sum of {num_layers}")
    return [s for s, n in enumerate(per) for _ in range(n)]


def _language_model(model):
    for cell in (getattr(model, "model", None), model):
        if cell is not None and hasattr(cell, "layers") and hasattr(cell, "embed_tokens"):
            return cell
    raise ValueError(f"{type(model).__name__}: no language model with `layers` and `embed_tokens` found")


def assign_pipeline_stages(model, pp: int, offset: Sequence[int] = ()) -> Dict[str, int]:
    """Set `pipeline_stage` on the model's cells; returns {cell name: stage} for what was set."""
    lm = _language_model(model)
    stages = layer_stages(len(lm.layers), pp, offset)
    last = pp - 1
    if pp > 1 and getattr(model, "tied", False):
        raise ConfigError("tie_word_embeddings with pipeline_stage > 1: the embedding (stage 0) and the LM head "
                          "(last stage) would share one table across stages; untie them or use one stage")
    placed: Dict[str, int] = {}

    def put(name: str, cell, stage: int) -> None:
        if cell is not None:
            cell.pipeline_stage = stage
            placed[name] = stage

    put("embed_tokens", lm.embed_tokens, 0)
    put("rotary_emb", getattr(lm, "rotary_emb", None), 0)
    put("visual", getattr(model, "visual", None), 0)
    for i, layer in enumerate(lm.layers):
        put(f"layers.{i}", layer, stages[i])
    put("norm", lm.norm, last)
    for k, layer in enumerate(getattr(lm, "mtp", [])):
        put(f"mtp.{k}", layer, last)
    put("lm_head", getattr(model, "lm_head", None), last)
    put("tied_head", getattr(model, "tied_head", None), last)
    return placed
