"""docs/CONFIG.md is generated from the config dataclasses and every field carries a doc line."""
import dataclasses
import os
import typing

from mindvl_ms.config.data import DataConfig
from mindvl_ms.config.model import MindVLConfig
from mindvl_ms.config.reference import reference
from mindvl_ms.config.train import RunConfig
from tests.support.paths import ROOT


def _fields(cls, seen=None):
    seen = seen if seen is not None else set()
    if cls in seen:
        return
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield cls, f
        tp = hints[f.name]
        for t in (tp, *typing.get_args(tp)):
            if dataclasses.is_dataclass(t):
                yield from _fields(t, seen)


def test_every_config_field_has_a_doc():
    missing = [f"{c.__name__}.{f.name}" for root in (RunConfig, MindVLConfig, DataConfig)
               for c, f in _fields(root) if not f.metadata.get("doc", "").strip()]
    assert missing == []


def test_docs_config_md_is_up_to_date():
    path = os.path.join(ROOT, "docs", "CONFIG.md")
    with open(path, encoding="utf-8") as f:
        assert f.read() == reference(), "regenerate: python -m mindvl_ms.config.reference > docs/CONFIG.md"
    assert "`stages[].max_lr`" in reference() and "`model.text.mrope_section`" in reference()
