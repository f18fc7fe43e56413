"""uint8 images normalised inside the graph equal the float preprocessing (data processor and transformers'
Qwen2VLImageProcessor), bit for bit against the processor. Run: pytest tests/infer/test_preprocess.py
"""
import numpy as np
import pytest
from PIL import Image

from mindspore import Tensor

from tests.support import infer_tiny as infer_tiny
from mindvl_ms.config.data import ImageConfig
from mindvl_ms.data.image import patchify
from mindvl_ms.infer.generate import generate, get_engine
from mindvl_ms.infer.preprocess import UInt8Normalize, normalize_uint8_numpy, uint8_patches

CFG = ImageConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 16)


def _images():
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (45, 70, 3), dtype=np.uint8))
    tall = Image.fromarray(rng.integers(0, 256, (130, 33, 3), dtype=np.uint8))
    gray = Image.fromarray(rng.integers(0, 256, (60, 61), dtype=np.uint8), mode="L")
    rgba = Image.fromarray(rng.integers(0, 256, (50, 90, 4), dtype=np.uint8), mode="RGBA")
    return [rgb, tall, gray, rgba]


@pytest.fixture(scope="module")
def normalize():
    """One cell for the four images, a dynamic patch count (as the vision graphs run it): one compile."""
    import mindspore as ms

    from mindvl_ms.config import VisionConfig

    cell = UInt8Normalize(VisionConfig(), CFG.image_mean, CFG.image_std)
    cell.set_inputs(Tensor(shape=[None, 3 * 14 * 14], dtype=ms.uint8))
    return cell


@pytest.mark.parametrize("k", range(4))
def test_uint8_in_graph_equals_float_path_exactly(normalize, k):
    image = _images()[k]
    frames, grid = uint8_patches(image, CFG)
    ref, ref_grid = patchify(image, CFG)
    assert frames.dtype == np.uint8 and frames.shape == (ref.shape[0], 3 * 14 * 14)  # 8x fewer bytes
    assert np.array_equal(grid, ref_grid)
    ours = normalize(Tensor(frames)).asnumpy()
    assert ours.dtype == np.float32 and np.array_equal(ours, ref)
    assert np.array_equal(normalize_uint8_numpy(frames, CFG), ref)


def test_matches_transformers_image_processor():
    from transformers import Qwen2VLImageProcessor

    hf = Qwen2VLImageProcessor(min_pixels=CFG.min_pixels, max_pixels=CFG.max_pixels)
    for image in _images()[:2]:
        frames, grid = uint8_patches(image, CFG)
        out = hf(images=[image.convert("RGB")], return_tensors="np")
        assert np.array_equal(out["image_grid_thw"][0], grid)
        np.testing.assert_allclose(normalize_uint8_numpy(frames, CFG), out["pixel_values"], rtol=0, atol=1e-6)


def test_uint8_and_float_samples_generate_the_same():
    _, _, model, _ = infer_tiny.setup()
    image = _images()[0]
    frames, grid = uint8_patches(image, CFG)
    pv, _ = patchify(image, CFG)
    ids = infer_tiny.image_prompt(grid)
    engine = get_engine(model)
    f_u8 = engine.image_features([{"pixel_frames": frames, "image_grid_thw": grid[None]}])[0][0]
    f_fp = engine.image_features([{"pixel_values": pv, "image_grid_thw": grid[None]}])[0][0]
    np.testing.assert_allclose(f_u8, f_fp, rtol=0, atol=1e-6)
    a = generate(model, [{"input_ids": ids, "pixel_frames": frames, "image_grid_thw": grid[None]}], 5)
    b = generate(model, [{"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid[None]}], 5)
    assert a == b
