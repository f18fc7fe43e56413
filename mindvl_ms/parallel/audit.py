"""Read declared strategies back from a model (semi-auto graphs cannot compile on CPU, so this is how the
strategies are checked here): counts of primitives with and without a strategy, and per-parameter shard
shapes derived from the strategies.

- `strategy_of(prim)`: the in_strategy tuple (or the `in_layout` attribute for Layout-based shards), or None;
  `split_of(prim)` gives Layout-based shards as integer splits too (`layout_splits`).
- `primitive_census(model)`: per primitive type, how many instances carry a strategy and how many do not.
  Reshape / Shape-like primitives take no strategy and are left out (`NO_STRATEGY`).
- `parameter_shards(model)`: for every parameter consumed by a sharded primitive we know the operand of
  (nn.Dense weight/bias, embedding table, RMSNorm weight, MoE expert stacks via `PARAM_OPERANDS`), the split
  per dim and the local shard shape.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Dict, Optional, Tuple

from mindspore import nn
from mindspore.ops import Primitive

from mindvl_ms.ops import RMSNorm

NO_STRATEGY = {"Reshape", "Shape", "TensorShape", "Cast", "Depend", "make_tuple"}
AUDITED = ("MatMul", "BatchMatMul", "Gather", "FlashAttentionScore", "GroupedMatmul")


def strategy_of(prim: Primitive):
    attrs = prim.attrs
    if attrs.get("in_strategy") is not None:
        return attrs["in_strategy"]
    if attrs.get("in_layout") is not None:
        return attrs["in_layout"]
    return None


def layout_splits(layout) -> Tuple[Tuple[int, ...], ...]:
    """A Layout-based strategy (the `in_layout` / `out_layout` attribute: per input a dict with `device_matrix`
    and `tensor_map`) -> the split of each dim, as an integer strategy (MindFormers' `to_tuple_strategy`:
    tensor_map entry -1 is whole, entry i is device_matrix[len - 1 - i])."""
    out = []
    for one in layout:
        dm, tm = one["device_matrix"], one["tensor_map"]
        out.append(tuple(1 if i == -1 else int(dm[len(dm) - 1 - i]) for i in tm))
    return tuple(out)


def split_of(prim: Primitive):
    """The integer in_strategy of `prim`, from its tuple strategy or its Layouts (`layout_splits`); None."""
    if prim.attrs.get("in_strategy") is not None:
        return prim.attrs["in_strategy"]
    layout = prim.attrs.get("in_layout")
    return None if layout is None else layout_splits(layout)


def iter_primitives(model: nn.Cell):
    """(cell name, attribute, primitive) of every primitive instance held by a cell of the model. A cell's
    `_primitives` keeps an entry after its attribute is set to None (MindSpore never removes one: a
    `drop_kernel` that lets go of a C++ op), so an entry counts only while the attribute still holds it."""
    seen = set()
    for name, cell in model.cells_and_names():
        for attr, prim in cell._primitives.items():  # pylint: disable=protected-access
            if isinstance(prim, Primitive) and getattr(cell, attr, None) is prim and id(prim) not in seen:
                seen.add(id(prim))
                yield name, attr, prim


def primitive_census(model: nn.Cell, prefix: str = "", exclude: str = None) -> Dict[str, Counter]:
    """{"with": Counter(type -> n), "without": Counter(type -> n)} over cells whose name starts with prefix
    (and does not match the regex `exclude`)."""
    out = {"with": Counter(), "without": Counter()}
    for name, _, prim in iter_primitives(model):
        if not name.startswith(prefix) or prim.name in NO_STRATEGY or (exclude and re.search(exclude, name)):
            continue
        out["with" if strategy_of(prim) is not None else "without"][prim.name] += 1
    return out


def _dense_shards(cell: nn.Dense) -> Dict[str, Tuple[int, ...]]:
    s = strategy_of(cell.matmul)
    if s is None:
        return {}
    w = tuple(s[1]) if cell.matmul.transpose_b else tuple(reversed(s[1]))
    out = {cell.weight.name: w}
    if cell.has_bias:
        b = strategy_of(cell.bias_add)
        out[cell.bias.name] = tuple(b[1]) if b is not None else (1,)
    return out


def parameter_splits(model: nn.Cell) -> Dict[str, Tuple[int, ...]]:
    """Parameter name -> split per dim, from the strategy of the primitive that consumes it."""
    splits: Dict[str, Tuple[int, ...]] = {}
    for name, cell in model.cells_and_names():
        if isinstance(cell, nn.Dense):
            splits.update(_dense_shards(cell))
        elif isinstance(cell, RMSNorm):
            s = strategy_of(cell.mul_weight)
            if s is not None:
                splits[cell.weight.name] = tuple(s[0])
        elif hasattr(cell, "gather") and name.endswith("embed_tokens"):
            s = strategy_of(cell.gather)
            if s is not None:
                splits[cell.weight.name] = tuple(s[0])
    return splits


def shard_shape(full: Tuple[int, ...], split: Tuple[int, ...]) -> Optional[Tuple[int, ...]]:
    """Local shape of a tensor split `split` ways per dim, or None when a dim does not divide."""
    if len(full) != len(split) or any(d % s for d, s in zip(full, split)):
        return None
    return tuple(d // s for d, s in zip(full, split))


def parameter_shards(model: nn.Cell):
    """name -> (full shape, split, shard shape or None) for every parameter with a known split."""
    params = {p.name: tuple(p.shape) for p in model.get_parameters()}
    return {n: (params[n], s, shard_shape(params[n], s)) for n, s in parameter_splits(model).items() if n in params}
