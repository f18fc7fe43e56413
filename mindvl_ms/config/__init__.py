"""Typed configuration (dataclasses loaded from YAML with validation); see base.py for the rules."""
from mindvl_ms.config.base import ConfigError, F, load, read_yaml, set_dotted, deep_merge
from mindvl_ms.config.model import MindVLConfig, MoEConfig, TextConfig, VisionConfig, from_hf_dict, to_hf_dict

__all__ = ["ConfigError", "F", "load", "read_yaml", "set_dotted", "deep_merge", "MindVLConfig",
           "MoEConfig", "TextConfig", "VisionConfig", "from_hf_dict", "to_hf_dict", "load_model_config"]


def load_model_config(path: str) -> MindVLConfig:
    """Read a model YAML (configs/model/*.yaml: top-level `vision`, `text` ... keys) into MindVLConfig."""
    data = read_yaml(path)
    if "model" in data and isinstance(data["model"], dict) and "vision" not in data:
        data = data["model"]
    return load(MindVLConfig, data, source=path)
