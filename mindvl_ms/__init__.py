"""mindvl-ms: MindSpore-native training, conversion and serving of MindVL-style multimodal LLMs.

`from mindvl_ms import MindVLForConditionalGeneration, MindVLConfig` loads lazily so that the command line
starts fast (`MindVLForConditionalGeneration` is infer/hf_api.py's); see README.md and configs/ for how to run it.
"""
import importlib

__version__ = "0.1.0"

_LAZY = {
    "MindVLForConditionalGeneration": "mindvl_ms.infer.hf_api",
    "MindVLConfig": "mindvl_ms.config",
    "MindVLProcessor": "mindvl_ms.data.processor",
    "build_model_inputs": "mindvl_ms.data.collate",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
