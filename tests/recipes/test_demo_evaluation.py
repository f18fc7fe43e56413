"""The demo's evaluation backends (recipes/demo/evaluation.py): one model per model config in a process, the
next checkpoint's weights streamed into it, so the graphs compiled for the first checkpoint serve the SFT
variants and their merge."""
import os

import mindspore as ms
import numpy as np
from mindspore import Tensor
from PIL import Image

from mindvl_ms.checkpoint.pretrained import save_pretrained
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.infer.generate import EvalBackend, load_model
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.recipes.demo import evaluation
from mindvl_ms.train import load_run_config
from tests.support import post as H


def _config(layers=1):
    model = dict(H.MODEL, text=dict(H.MODEL["text"], num_hidden_layers=layers))
    return load_run_config(data={"seed": 0, "model": model, "stages": [{"name": "x", "max_steps": 1}]})


def _save(cfg, path, seed):
    """A checkpoint of the config's model with weights drawn from `seed`; {name: values}."""
    ms.set_seed(0)
    model = MindVLModel(cfg.model)
    rng = np.random.default_rng(seed)
    for p in model.get_parameters():
        p.set_data(Tensor((p.asnumpy() + rng.standard_normal(p.shape)).astype(p.asnumpy().dtype)))
    save_pretrained(model, path)
    return {p.name: p.asnumpy().copy() for p in model.get_parameters()}


def test_a_new_checkpoint_of_the_same_config_takes_over_the_kept_model(tmp_path):
    """eval_backend(b) after eval_backend(a), same model config: b's weights go into a's model (its compiled
    vision graph then gives what a model loaded from b gives), a is no longer kept, the image features of a's
    weights are dropped; a checkpoint of another config gets a model of its own, and b stays kept."""
    cfg = _config()
    ckpt = {n: str(tmp_path / n) for n in "abc"}
    _save(cfg, ckpt["a"], 1)
    want_b = _save(cfg, ckpt["b"], 2)
    _save(_config(layers=2), ckpt["c"], 3)
    img = str(tmp_path / "x.png")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(img)
    try:
        a = evaluation.eval_backend(ckpt["a"], cfg.data, 4)
        feats_a = a.encode_images([(img, 56, 56)])[0]
        a.engine.image_cache["x"] = np.zeros(1)
        b = evaluation.eval_backend(ckpt["b"], cfg.data, 4)
        assert b.model is a.model and not b.engine.image_cache
        assert evaluation.cached_backend(ckpt["a"]) is None and evaluation.cached_backend(ckpt["b"]) is b
        for p in b.model.get_parameters():
            np.testing.assert_array_equal(p.asnumpy(), want_b[p.name], err_msg=p.name)
        feats_b = b.encode_images([(img, 56, 56)])[0]
        fresh = EvalBackend(load_model(ckpt["b"]), MindVLProcessor(config=cfg.data), 4)
        np.testing.assert_array_equal(feats_b, fresh.encode_images([(img, 56, 56)])[0])
        assert not np.allclose(feats_b, feats_a)
        c = evaluation.eval_backend(ckpt["c"], cfg.data, 4)
        assert c.model is not b.model and c.model.config.text.num_hidden_layers == 2
        assert evaluation.cached_backend(ckpt["b"]) is b
    finally:
        for path in ckpt.values():
            evaluation._BACKENDS.pop(os.path.abspath(path), None)
