"""Module path patterns: the keys of the plans in `parallel/` (sharding styles, pipeline stages, recompute).

A pattern is a dot-separated module name as `Cell.cells_and_names` gives it, where `*` stands for exactly
one path component (a layer index): `model.layers.*.mlp.down_proj` matches `model.layers.7.mlp.down_proj`
and not `model.layers.7.mlp.shared_experts.down_proj`. `match_plan` yields every cell with the value of the
first pattern (in the plan's order) that matches its name.
"""
from __future__ import annotations

import re
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

from mindspore import nn


def _pattern(path: str) -> "re.Pattern":
    """The regular expression of one pattern (`*` = one path component)."""
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in path.split(".")))


def compile_plan(plan: Mapping[str, object]) -> List[Tuple[str, "re.Pattern", object]]:
    """(pattern, compiled matcher, value) per plan entry, in the plan's order."""
    return [(path, _pattern(path), value) for path, value in plan.items()]


def match_plan(model: nn.Cell, plan: Mapping[str, object], prefix: str = "",
               skip: Tuple[str, ...] = ()) -> Iterator[Tuple[str, nn.Cell, Optional[object]]]:
    """(name, cell, value of the first matching pattern or None) for every cell of `model` (names start
    with `prefix`), leaving out the cells at or below a name in `skip`."""
    compiled = compile_plan(plan)
    for name, cell in model.cells_and_names(name_prefix=prefix):
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        value = next((v for _, pattern, v in compiled if pattern.fullmatch(name)), None)
        yield name, cell, value


def under(prefix: str, plan: Mapping[str, object]) -> Dict[str, object]:
    """`plan` with every path put below `prefix` ("" in `plan` stands for the prefix itself)."""
    return {f"{prefix}.{path}" if path else prefix: value for path, value in plan.items()}
