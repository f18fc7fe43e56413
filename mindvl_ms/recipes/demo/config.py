"""The demo YAML (configs/demo/full.yaml, or quick.yaml for `--quick`): a normal training run config
(`mindvl_ms.config.train.RunConfig`) plus a `demo:` section (data sizes, model YAML, evaluation settings)
that is popped before the rest loads; a top-level `model:` section overrides fields of the model YAML
(deep merge)."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from mindvl_ms.config.base import ConfigError, deep_merge, read_yaml
from mindvl_ms.config.packaged import configs_dir, packaged_path
from mindvl_ms.config.train import load_run_config
from mindvl_ms.data.tokenizer import SUBSET_FILE
from mindvl_ms.data.vocab_subset import follow_vocab_subset


def demo_config_dir() -> str:
    """configs/demo of the packaged configs (an installed wheel or the source checkout)."""
    return os.path.join(configs_dir(), "demo")


def config_path(quick: bool) -> str:
    """The packaged demo YAML: configs/demo/quick.yaml with `quick`, else configs/demo/full.yaml."""
    return packaged_path("demo/quick.yaml" if quick else "demo/full.yaml")


DEMO_KEYS = ("model", "vocab", "data_seed", "data_sizes", "vqa_mix", "vqa_balance_yes_no", "vqa_question_first", "vqa_describe",
             "eval_batch_size", "eval_variants", "max_new_tokens", "resolution_grid",
             "phase_processes")  # the `demo:` section's settings
DEMO_BOOL_KEYS = ("vqa_balance_yes_no", "vqa_question_first", "vqa_describe", "eval_variants",
                  "phase_processes")  # YAML true/false


def data_seed(demo: Dict[str, Any], run_seed: int) -> int:
    """The seed the demo's data is drawn from: `demo.data_seed`, else the run's `seed`. Setting it apart
    keeps the data (and with `vocab: data`, the model's vocabulary) fixed while `seed` varies the rest: a
    research arm trains its SFT stage on its base's data with several seeds."""
    seed = demo.get("data_seed")
    return int(run_seed if seed is None else seed)


def load_demo_config(path: str, data_dir: str, overrides: Optional[List[str]] = None, vocab_subset: bool = True):
    """(RunConfig, demo section) from a demo YAML; data sources are resolved against data_dir. With
    `demo.vocab: data` and vocab_subset, the subset an earlier run wrote in data_dir/tokenizer is applied."""
    raw = read_yaml(path)
    demo = raw.pop("demo", None)
    if not isinstance(demo, dict):
        raise ConfigError(f"{path}: missing the `demo:` section (model, data_sizes, eval settings)")
    unknown = sorted(set(demo) - set(DEMO_KEYS))
    if unknown:
        raise ConfigError(f"{path}: demo.{unknown[0]} is not a demo setting; expected one of {', '.join(DEMO_KEYS)}")
    for key in DEMO_BOOL_KEYS:
        if key in demo and not isinstance(demo[key], bool):
            raise ConfigError(f"{path}: demo.{key} must be true or false, got {demo[key]!r}")
    seed = demo.get("data_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError(f"{path}: demo.data_seed must be an integer >= 0 (or absent: the run's seed), got {seed!r}")
    model_yaml = demo.get("model")
    if model_yaml:  # a `model:` section in the demo YAML overrides fields of demo.model
        # relative to the given YAML, else to configs/demo/ (a YAML that `_include_`s full.yaml from elsewhere)
        tried = [os.path.join(d, model_yaml) for d in (os.path.dirname(os.path.abspath(path)), demo_config_dir())]
        found = [t for t in tried if os.path.isfile(t)]
        if not found:
            raise ConfigError(f"{path}: demo.model {model_yaml!r} not found (looked for {' and '.join(tried)})")
        raw["model"] = deep_merge(read_yaml(found[0]), raw.get("model") or {})

    def resolve(d: Dict[str, Any]) -> None:
        for s in d.get("sources", []) or []:
            if "path" in s and not os.path.isabs(s["path"]):
                s["path"] = os.path.join(data_dir, s["path"])

    resolve(raw.get("data", {}))
    for st in raw.get("stages", []):
        resolve(st.get("data", {}))
    subset = os.path.join(data_dir, "tokenizer")
    if vocab_subset and demo.get("vocab", "full") == "data" and os.path.isfile(os.path.join(subset, SUBSET_FILE)):
        raw.setdefault("data", {})["tokenizer"] = subset  # an earlier `restrict_vocab`'s; the model follows it
    cfg = load_run_config(data=raw, overrides=overrides)
    follow_vocab_subset(cfg)  # the model's vocab size and special ids as the subset numbers them
    return cfg, demo
