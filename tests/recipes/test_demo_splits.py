"""The demo's easy-VQA held-out split depends on the seed and its size only: a recipe's train settings
(`vqa_mix`, the train size) leave the questions it is scored on, and their image-blind prior, as they are,
so recipes are compared on one split per seed. Seconds, no MindSpore.

    python -m pytest -q tests/recipes/test_demo_splits.py
"""
import json

from mindvl_ms.recipes.demo.datasets import write_demo_data


def _heldout(info):
    with open(info["files"]["heldout"]["vqa"], encoding="utf-8") as f:
        return [(o["messages"], o["images"]) for o in map(json.loads, f)]


def test_heldout_vqa_is_independent_of_the_train_mix(tmp_path):
    runs = [write_demo_data(str(tmp_path / name), seed=1, sizes={"vqa": (n, 40)}, progress=False, vqa_mix=mix)
            for name, n, mix in [("thirds", 30, {"yes/no": 1, "colour": 1, "shape": 1}),
                                 ("shape", 30, {"yes/no": 2, "colour": 3, "shape": 6}),
                                 ("own", 50, None)]]
    held = [_heldout(info) for info in runs]
    assert held[0] == held[1] == held[2] and len(held[0]) == 40
    # another seed draws another split
    other = write_demo_data(str(tmp_path / "seed2"), seed=2, sizes={"vqa": (30, 40)}, progress=False,
                            vqa_mix={"yes/no": 1, "colour": 1, "shape": 1})
    assert _heldout(other) != held[0]
