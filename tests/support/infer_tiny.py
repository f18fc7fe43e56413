"""One tiny random Qwen2.5-VL checkpoint + its MindSpore model for all tests/infer/test_*.py modules and the
parity tests of tests/models (test_video_parity.py, test_mindvl_parity.py: the same hf_tiny checkpoint).

Built once per pytest process (the compiled generation cells are cached on the model, and the full forward
graph on the model itself, so every module reuses the same graphs instead of compiling its own).
"""
import functools
import shutil
import tempfile
import atexit
import pathlib

import numpy as np

from tests.support import hf_tiny as hf_tiny

SIZES = [[], [(28, 56)], [(56, 84), (28, 28)]]  # 0, 1 and 2 images: prompts of different lengths


@functools.lru_cache(maxsize=None)
def setup():
    """(checkpoint dir, transformers model, MindSpore model, samples) with float pixel_values samples."""
    from mindvl_ms import MindVLForConditionalGeneration

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="mindvl_infer_"))
    atexit.register(shutil.rmtree, tmp, True)
    path, hf = hf_tiny.tiny_qwen2_5_vl(tmp)
    hf.generation_config.eos_token_id = None  # the tiny vocabulary has no eos: always max_new_tokens
    model = MindVLForConditionalGeneration.from_pretrained(path).set_dynamic_inputs()  # full forward: one compile
    rng = np.random.default_rng(3)
    samples = []
    for k, sizes in enumerate(SIZES):
        ids, pv, grid = hf_tiny.image_sample(rng, sizes, text_len=3 + 2 * k)
        samples.append({"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid})
    return path, hf, model, samples


def image_prompt(grid, text=(5, 6), tail=(7, 8)):
    """Token ids around one image block whose size matches `grid` (t, h, w)."""
    n = int(np.prod(grid)) // 4
    return np.array(list(text) + [hf_tiny.VSTART] + [hf_tiny.IMAGE] * n + [hf_tiny.VEND] + list(tail), np.int64)
