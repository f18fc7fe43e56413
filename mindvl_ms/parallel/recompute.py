"""Activation recomputation from `recompute_config`, through MindSpore's own recompute APIs.

`RECOMPUTE_PLAN` names the recompute units by module path: the LLM's decoder layers and the ViT's blocks.
- `recompute`: full recompute of every unit (`Cell.recompute`), with `mp_comm_recompute` (MindSpore marks
  the cell's primitives `recompute_comm_op`, so the model-parallel communication the compiler inserts for
  them is recomputed too, or kept when false) and `recompute_slice_activation` (primitives marked
  `slice_activation`: the activations a recomputed layer keeps are sliced over the model-parallel group).
  Both only act together with `recompute`.
- `select_recompute` (when full recompute is off): inside each unit only the primitives of the attention
  cores, rotary embeddings and gated activations (`SELECT_CELLS`, wherever they sit in the unit: attention,
  dense MLP, shared and routed experts) are recomputed (`Primitive.recompute()`), as MindFormers' select
  recompute does for the cheap-to-recompute, large-activation ops; the matmuls' outputs stay saved.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

from mindspore import nn
from mindspore.ops import Primitive

from mindvl_ms.ops import ApplyRotary, CoreAttention, SwiGLU
from mindvl_ms.ops.activation import GatedAct
from mindvl_ms.parallel.paths import match_plan

RECOMPUTE_PLAN: Dict[str, str] = {  # module path -> unit kind
    "model.layers.*": "decoder layer",
    "visual.blocks.*": "vision block",
}
SELECT_CELLS = (CoreAttention, ApplyRotary, SwiGLU, GatedAct)


def recompute_units(model: nn.Cell) -> List[Tuple[str, nn.Cell]]:
    """(name, cell) of every unit of `RECOMPUTE_PLAN`."""
    return [(name, cell) for name, cell, kind in match_plan(model, RECOMPUTE_PLAN) if kind is not None]


def cell_primitives(cell: nn.Cell) -> Iterator[Primitive]:
    """Primitive instances held by `cell` and its sub-cells."""
    for _, sub in cell.cells_and_names():
        for prim in sub._primitives.values():  # pylint: disable=protected-access
            if isinstance(prim, Primitive):
                yield prim


def apply_recompute(model: nn.Cell, rc) -> Dict[str, int]:
    """Apply `recompute_config` `rc` to the model; returns counts {"full_cells", "select_primitives"}."""
    counts = {"full_cells": 0, "select_primitives": 0}
    units = recompute_units(model)
    if rc.recompute:
        for _, cell in units:
            cell.recompute(mp_comm_recompute=bool(rc.mp_comm_recompute),
                           recompute_slice_activation=bool(rc.recompute_slice_activation))
            counts["full_cells"] += 1
    elif rc.select_recompute:
        for _, unit in units:
            for _, cell in unit.cells_and_names():
                if isinstance(cell, SELECT_CELLS):
                    for prim in cell_primitives(cell):
                        prim.recompute()
                        counts["select_primitives"] += 1
    return counts
