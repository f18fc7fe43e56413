"""A research branch's SFT variants and the resolution grid resize the demo's images differently, as the
experiments need: the variants (MindVL section 5.3: longer rows, larger images) and the search's settings."""
import pytest

from mindvl_ms.data.image import image_tokens, smart_resize
from mindvl_ms.recipes.demo.config import load_demo_config
from mindvl_ms.recipes.demo.grounding_data import GROUND_SIZE
from mindvl_ms.recipes.demo.ocr_data import OCR_SIZE
from tests.research.helpers import load

resolution = load("resolution_search/run.py", "research_resolution")
common = load("common.py", "research_common")
DEMO_SIZES = [(64, 64), OCR_SIZE, GROUND_SIZE]   # (width, height): easy-VQA, OCR, grounding


@pytest.mark.parametrize("recipe", ["RECIPE", "SMOKE"])
def test_sft_variants_differ_in_row_length_and_resized_images(recipe, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "OUT", str(tmp_path))
    cfg, _ = load_demo_config(common.branch_config(str(tmp_path / "ckpt"), getattr(common, recipe)), "/tmp/data")
    variants = {v.name: cfg.stage_data(v) for v, parent in cfg.schedule() if parent is not None}
    assert sorted(variants) == ["sft_256", "sft_512"]
    assert variants["sft_256"].seq_length == 256 and variants["sft_512"].seq_length == 512
    small, large = variants["sft_256"].image, variants["sft_512"].image
    for w, h in DEMO_SIZES:
        a = smart_resize(h, w, 28, small.min_pixels, small.max_pixels)
        b = smart_resize(h, w, 28, large.min_pixels, large.max_pixels)
        assert a[0] * a[1] < b[0] * b[1], (w, h, a, b)
    # 56x56 (4 tokens) against 112x112 (16) for the grounding images; 112x28 against 224x56 for OCR
    assert image_tokens(*GROUND_SIZE, small) == 4 and image_tokens(*GROUND_SIZE, large) == 16
    assert image_tokens(*OCR_SIZE, small) == 4 and image_tokens(*OCR_SIZE, large) == 16


def test_resolution_grid_gives_five_sizes_per_demo_image():
    from mindvl_ms.eval.resolution_search import UNIT, grid

    settings = [(lo // UNIT, hi // UNIT) for lo, hi in grid(resolution.GRID, resolution.GRID)]
    sizes = resolution.check_grid(settings, DEMO_SIZES)
    # the min = max settings: 56, 84, 112, 168, 224 px squares for the square images (hand-computed)
    assert [sizes[(g, g)][2] for g in resolution.GRID] == [(56, 56), (84, 84), (112, 112), (168, 168), (224, 224)]
    assert [sizes[(g, g)][1] for g in resolution.GRID] == [(28, 112), (28, 168), (56, 224), (84, 336), (112, 448)]


def test_a_grid_that_resizes_alike_is_refused():
    with pytest.raises(AssertionError, match="resized sizes"):
        resolution.check_grid([(1, 16), (4, 16), (16, 16), (1, 32), (16, 64)], DEMO_SIZES)
