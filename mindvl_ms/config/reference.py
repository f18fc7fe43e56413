"""The YAML reference (docs/CONFIG.md), generated from the config dataclasses' field docs.

    python -m mindvl_ms.config.reference > docs/CONFIG.md

A test keeps docs/CONFIG.md equal to this output and checks that every field has a doc line.
"""
import dataclasses
import typing
from typing import List

from mindvl_ms.config.model import MindVLConfig
from mindvl_ms.config.train import RunConfig


def _rows(cls: type, prefix: str) -> List[str]:
    rows, nested = [], []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = typing.get_args(tp)
        inner = args[0] if typing.get_origin(tp) in (list, List) and args else None
        if dataclasses.is_dataclass(tp):
            nested.append((f"{prefix}{f.name}", tp, f.metadata.get("doc", "")))
            continue
        if inner is not None and dataclasses.is_dataclass(inner):
            nested.append((f"{prefix}{f.name}[]", inner, f.metadata.get("doc", "")))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "required"
        tname = str(tp).replace("typing.", "") if not isinstance(tp, type) else tp.__name__
        doc = f.metadata.get("doc", "").replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | {tname} | `{default!r}` | {doc} |")
    out = []
    if rows:
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"] + rows + [""]
    for name, sub, doc in nested:
        out += [f"### `{name}` ({sub.__name__})", "", doc, ""] + _rows(sub, f"{name}.")
    return out


def reference() -> str:
    lines = ["# Configuration reference", "",
             "Generated from the config dataclasses by `python -m mindvl_ms.config.reference`; every key of a "
             "YAML file is one of these. Unknown keys are an error naming the closest valid key. A file may "
             "start from others with `_include_: [path, ...]` (relative paths, deep-merged, then overridden).",
             "", "## Run config (`mindvl train --config`)", ""]
    lines += _rows(RunConfig, "")
    lines += ["## Model config (`configs/model/*.yaml`)", ""]
    lines += _rows(MindVLConfig, "")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(reference(), end="")
