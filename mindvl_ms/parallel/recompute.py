"""Activation recomputation from `recompute_config`, through MindSpore's own recompute APIs.

- `recompute`: full recompute of every decoder layer and vision block (`Cell.recompute`), with
  `mp_comm_recompute` (MindSpore marks the cell's primitives `recompute_comm_op`, so the model-parallel
  communication the compiler inserts for them is recomputed too, or kept when false) and
  `recompute_slice_activation` (primitives marked `slice_activation`: the activations a recomputed
  layer keeps are sliced over the model-parallel group). Both only act together with `recompute`.
- `select_recompute` (when full recompute is off): only the attention-core, rotary and gated-activation
  primitives of each layer/block are recomputed (`Primitive.recompute()`), as MindFormers' select
  recompute does for the cheap-to-recompute, large-activation ops; the matmuls' outputs stay saved.
Layers/blocks are the items of the model's `layers` / `blocks` cell lists (LLM decoder layers, ViT blocks).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from mindspore import nn
from mindspore.ops import Primitive

from mindvl_ms.ops import ApplyRotary, CoreAttention, SwiGLU
from mindvl_ms.ops.activation import GatedAct

SELECT_CELLS = (CoreAttention, ApplyRotary, SwiGLU, GatedAct)


def layer_cells(model: nn.Cell) -> List[Tuple[str, nn.Cell]]:
    """(name, cell) of every `...layers.<i>` / `...blocks.<i>` cell."""
    out = []
    for name, cell in model.cells_and_names():
        parts = name.rsplit(".", 2)
        if len(parts) >= 2 and parts[-2] in ("layers", "blocks") and parts[-1].isdigit():
            out.append((name, cell))
    return out


def cell_primitives(cell: nn.Cell):
    """Primitive instances held by `cell` and its sub-cells."""
    for _, sub in cell.cells_and_names():
        for prim in sub._primitives.values():  # pylint: disable=protected-access
            if isinstance(prim, Primitive):
                yield prim


def apply_recompute(model: nn.Cell, rc) -> Dict[str, int]:
    """Apply `recompute_config` `rc` to the model; returns counts {"full_cells", "select_primitives"}."""
    counts = {"full_cells": 0, "select_primitives": 0}
    layers = layer_cells(model)
    if rc.recompute:
        for _, cell in layers:
            cell.recompute(mp_comm_recompute=bool(rc.mp_comm_recompute),
                           recompute_slice_activation=bool(rc.recompute_slice_activation))
            counts["full_cells"] += 1
    elif rc.select_recompute:
        for _, layer in layers:
            for _, cell in layer.cells_and_names():
                if isinstance(cell, SELECT_CELLS):
                    for prim in cell_primitives(cell):
                        prim.recompute()
                        counts["select_primitives"] += 1
    return counts
