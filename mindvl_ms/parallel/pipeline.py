"""Pipeline stages: which stage runs each decoder layer, and the assignment of `cell.pipeline_stage`.

MindFormers semantics of `parallel_config.offset`: stage i runs `layers // pp + offset[i]` consecutive
decoder layers (an empty offset means an even split, which needs layers % pp == 0). The embedding, the
vision tower and the projector run on stage 0; the final norm, the LM head and multi-token-prediction
layers on the last stage (`STAGE_PLAN`, keyed by module path as the other plans of `parallel/`). The
train step runs the rank's micro-batches through MindFormers' pipeline cell (`train/mf_step.py`); this
module only places cells.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from mindspore import nn

from mindvl_ms.config.base import ConfigError
from mindvl_ms.parallel.paths import match_plan

# module path (from the model root; `model` is the language model) -> "first" | "last" | "layer"
# ("layer": the decoder layer's own stage, from `layer_stages`)
STAGE_PLAN: Dict[str, str] = {
    "model.embed_tokens": "first",
    "model.rotary_emb": "first",
    "visual": "first",
    "merge": "first",
    "model.layers.*": "layer",
    "model.norm": "last",
    "model.mtp.*": "last",
    "lm_head": "last",
    "tied_head": "last",
}
LANGUAGE_MODEL = "model"  # where the plans of parallel/ expect the language model


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


def language_model(model: nn.Cell) -> nn.Cell:
    """The decoder stack `model.model` (a cell with `layers` and `embed_tokens`) of a causal LM or MindVL model."""
    lm = getattr(model, LANGUAGE_MODEL, None)
    if lm is None or not (hasattr(lm, "layers") and hasattr(lm, "embed_tokens")):
        raise ValueError(f"{type(model).__name__}: no language model `{LANGUAGE_MODEL}` with `layers` and "
                         f"`embed_tokens` found")
    return lm


def assign_pipeline_stages(model: nn.Cell, pp: int, offset: Sequence[int] = ()) -> Dict[str, int]:
    """Set `pipeline_stage` on the cells of `STAGE_PLAN`; returns {cell name: stage} for what was set
    (names inside the language model without its `model.` prefix, e.g. `layers.10`)."""
    stages = layer_stages(len(language_model(model).layers), pp, offset)
    if pp > 1 and getattr(model, "tied", False):
        raise ConfigError("tie_word_embeddings with pipeline_stage > 1: the embedding (stage 0) and the LM head "
                          "(last stage) would share one table across stages; untie them or use one stage")
    prefix = LANGUAGE_MODEL + "."
    placed: Dict[str, int] = {}
    for name, cell, where in match_plan(model, STAGE_PLAN):
        if where is not None:
            key = name[len(prefix):] if name.startswith(prefix) else name
            fixed = {"first": 0, "last": pp - 1}.get(where)
            cell.pipeline_stage = stages[int(name.rsplit(".", 1)[1])] if fixed is None else fixed
            placed[key] = cell.pipeline_stage
    return placed
