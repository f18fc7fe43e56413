"""Post-training test set-up: a tiny MindVL config, in-memory pair/prompt sources, rewards, a stage run."""
import json
import os

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindvl_ms.data.preference import encode_response
from mindvl_ms.infer.generate import get_engine
from mindvl_ms.infer.rollout import EngineSampler
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.train import load_run_config, run_training
from mindvl_ms.train.post.sources import PairSource, PromptSource
from tests.support import hf_tiny

MODEL = {
    "vision": {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
               "fullatt_block_indexes": [0], "window_size": 56},
    "text": {"vocab_size": hf_tiny.VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mrope_section": [2, 3, 3]},
    "image_token_id": hf_tiny.IMAGE, "video_token_id": 253, "vision_start_token_id": hf_tiny.VSTART,
    "vision_end_token_id": hf_tiny.VEND,
}


def prompt(rng):
    ids, pv, grid = hf_tiny.image_sample(rng, [(28, 28)], text_len=3, vocab=16)
    return {"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid}


def pair_source(n=6, n_ntp=2, seed=0):
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        p = prompt(rng)
        pairs.append((encode_response(p, [5, 6, 7]), encode_response(p, [8, 9])))
    ntp = []
    for _ in range(n_ntp):
        ids, pv, grid = hf_tiny.image_sample(rng, [(28, 28)], text_len=4, vocab=16)
        labels = ids.copy()
        labels[: len(ids) // 2] = -100
        ntp.append([{"input_ids": ids, "labels": labels, "pixel_values": pv, "image_grid_thw": grid}])
    return PairSource(pairs, ntp or None, seed=1)


def prompt_source(n=4, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [dict(prompt(rng), answer="128", reward="") for _ in range(n)]
    return PromptSource(prompts, lambda ids: " ".join(str(int(t)) for t in ids), (), seed=1)


def low_ids(response, answer):
    """Fraction of response tokens with an id below int(answer) (a dense reward for the tests)."""
    toks = response.split()
    return sum(int(t) < int(answer) for t in toks) / max(len(toks), 1)


_FRESH = {}  # model spec (JSON) -> reset() of the process's model for it (fresh_model)


def fresh_model(model_spec=None):
    """-> reset(): a tiny MindVL with the weights `ms.set_seed(0); MindVLModel(MODEL)` gives, set back before each
    use (the engine's image features dropped): one model per spec for the process (every module asking for it),
    so the graphs compiled on it (the post stage's step kept on it, the engine's cells) are compiled once."""
    key = json.dumps(model_spec or MODEL, sort_keys=True)
    if key not in _FRESH:
        _FRESH[key] = _new_fresh_model(model_spec)
    return _FRESH[key]


def _new_fresh_model(model_spec):
    cfg = load_run_config(data={"seed": 0, "model": model_spec or MODEL, "stages": [{"name": "x", "max_steps": 1}]})
    ms.set_seed(0)
    model = MindVLModel(cfg.model)
    init = {p.name: p.asnumpy().copy() for p in model.get_parameters()}

    def reset():
        for p in model.get_parameters():
            p.set_data(Tensor(init[p.name]))
        get_engine(model).image_cache.clear()
        return model
    return reset


def run(tmp, stage, factory, resume=None, model=None, plot=True):
    cfg = load_run_config(data={"seed": 0, "model": MODEL, "plot": plot, "stages": [stage]})
    ms.set_seed(0)
    model = model or MindVLModel(cfg.model)
    summary = run_training(cfg, tmp, model=model, data_factory=factory, progress=False, resume=resume,
                           sampler=EngineSampler())
    path = os.path.join(tmp, "metrics.jsonl")
    recs = [json.loads(x) for x in open(path)] if os.path.isfile(path) else []  # rank 0 writes metrics
    return model, summary, recs


def char_parity(response, answer):
    """1.0 or 0.0 from the parity of the response's characters (a coin from the text, for pair tests)."""
    return float(sum(map(ord, response)) % 2)


class _LossOnly(nn.Cell):
    def __init__(self, obj):
        super().__init__()
        self.obj = obj

    def construct(self, *args):
        return self.obj(*args)[0]


class LossGrad(nn.Cell):
    """An objective cell's loss (its first output) and that loss's gradient w.r.t. the first input."""

    def __init__(self, obj):
        super().__init__()
        self.g = ops.value_and_grad(_LossOnly(obj), 0)

    def construct(self, *args):
        return self.g(*args)
