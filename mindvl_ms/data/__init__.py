"""The multimodal data pipeline: JSONL samples -> processed samples -> packs -> per-rank batches.

Modules: `tokenizer` (tokenizers-based loading), `schema` (JSONL lines), `processor` (smart_resize,
patches, chat template, labels; `MindVLProcessor`), `grounding` (openPangu-VL coordinate syntax),
`packing` (offline best-fit-decreasing packer with rank balancing; online buffer packer),
`dataset` (per-rank loader with resumable state), `validate` (`mindvl data validate`), `formats`
(LLaVA, ShareGPT and parquet inputs: `mindvl data convert` and `format:` on a data source). Heavy imports
(MindSpore) happen only inside the loader.
"""
from mindvl_ms.data.grounding import box_iou, format_box, format_point, format_quad, parse_grounding
from mindvl_ms.data.image import image_tokens, patchify, smart_resize
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.tokenizer import load_tokenizer
from mindvl_ms.data.tokens import IGNORE_INDEX

__all__ = ["MindVLProcessor", "smart_resize", "patchify", "image_tokens", "IGNORE_INDEX", "load_tokenizer",
           "parse_grounding", "box_iou", "format_box", "format_point", "format_quad"]
