"""The demo's supervised-logits training model against the plain MindVL model with the same weights:
the kept logits equal the full logits at the supervised positions, so the token-mean loss (computed
here in numpy from the full logits) is unchanged.

    python -m pytest -q tests/test_demo_sparse_logits.py
"""
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindvl_ms.checkpoint.hf import load_into, model_tensors
from mindvl_ms.config.base import load, read_yaml
from mindvl_ms.config.data import DataConfig
from mindvl_ms.config.model import MindVLConfig
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import iter_jsonl
from mindvl_ms.demo.datasets import write_demo_data
from mindvl_ms.demo.sparse_logits import SupervisedLogitsMindVL, compact_targets
from mindvl_ms.data.collate import INPUT_NAMES, build_model_inputs
from mindvl_ms.models.mindvl import MindVLForConditionalGeneration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("data"))
    info = write_demo_data(d, seed=0, sizes={"vqa": (3, 1), "ocr": (2, 1), "grounding": (2, 1)}, progress=False)
    data_cfg = load(DataConfig, {"system_prompt": "", "image": {"min_pixels": 12544, "max_pixels": 12544}}, "test")
    proc = MindVLProcessor(config=data_cfg)
    samples = {t: [proc.process_sample(s) for _, s in iter_jsonl(info["files"]["train"][t])]
               for t in ("vqa", "ocr", "grounding")}
    rows = [samples["vqa"] + samples["ocr"][:1], samples["grounding"] + samples["ocr"][1:]]  # two packed rows
    cfg = load(MindVLConfig, read_yaml(os.path.join(ROOT, "configs", "model", "tiny.yaml")), "tiny.yaml")
    return cfg, build_model_inputs(rows, cfg)


def test_compact_targets_layout(batch):
    _, full = batch
    out = compact_targets(full, multiple=8)
    b, l = full["targets"].shape
    k = out["targets"].shape[1]
    assert k % 8 == 0 and k >= (full["targets"] != -100).sum(1).max()
    assert np.array_equal(out["attn_segment_ids"], full["segment_ids"])
    idx = out["logit_index"].reshape(b, k)
    for r in range(b):
        pos = [p for p in range(l) if full["targets"][r, p] != -100]
        n = len(pos)
        assert list(idx[r, :n] - r * l) == pos
        assert list(out["targets"][r, :n]) == [full["targets"][r, p] for p in pos]
        assert list(out["segment_ids"][r, :n]) == [full["segment_ids"][r, p] for p in pos]
        assert list(out["token_index"][r, :n]) == [full["token_index"][r, p] for p in pos]
        assert len(set(out["segment_ids"][r, :n])) > 1  # the rows are packs of several samples
        assert (out["targets"][r, n:] == -100).all() and (out["segment_ids"][r, n:] == 0).all()


def test_kept_logits_and_loss_match_the_full_model(batch):
    cfg, full = batch
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    try:
        ms.set_seed(0)
        base = MindVLForConditionalGeneration(cfg)
        sparse = SupervisedLogitsMindVL(cfg)
        load_into(sparse, model_tensors(base))
        ref = base(*[Tensor(full[k]) for k in INPUT_NAMES])[0].asnumpy()           # [B, L, V]
        comp = compact_targets(full)
        got = sparse(*[Tensor(comp[k]) for k in SupervisedLogitsMindVL.INPUT_NAMES])[0].asnumpy()  # [B, K, V]
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    b, l, v = ref.shape
    k = got.shape[1]
    kept = ref.reshape(b * l, v)[comp["logit_index"]].reshape(b, k, v)
    mask = comp["targets"] != -100
    np.testing.assert_allclose(got[mask], kept[mask], rtol=1e-5, atol=1e-4)

    def ce_mean(logits, targets):  # numpy token-mean cross entropy over supervised positions
        sel = targets != -100
        x = logits[sel].astype(np.float64)
        lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
        return float(np.mean(lse - x[np.arange(len(x)), targets[sel]]))

    assert ce_mean(got, comp["targets"]) == pytest.approx(ce_mean(ref, full["targets"]), rel=1e-5)


@pytest.mark.parametrize("lambdas", [(0.0, 1.0), (1.0, 1.0)])
def test_balanced_loss_same_on_the_compact_layout(batch, lambdas):
    """The openPangu-VL balanced loss (per-token and per-sample terms) reads only supervised positions,
    their sample ids and token order, so the compact layout gives the full layout's value."""
    from mindvl_ms.train.loss import TrainLoss

    cfg, full = batch
    comp = compact_targets(full)
    rng = np.random.default_rng(0)
    b, l = full["targets"].shape
    v = cfg.text.vocab_size
    logits_full = rng.standard_normal((b, l, v)).astype(np.float32)
    logits_comp = logits_full.reshape(b * l, v)[comp["logit_index"]].reshape(b, -1, v)
    loss = TrainLoss("balanced", *lambdas)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        n_samples = Tensor(float(len(np.unique(full["segment_ids"][full["targets"] != -100]))), ms.float32)
        vals = [float(loss(Tensor(lg), Tensor(d["targets"]), Tensor(d["segment_ids"]), Tensor(d["token_index"]),
                           Tensor(-1.0, ms.float32), n_samples).asnumpy())
                for lg, d in ((logits_full, full), (logits_comp, comp))]
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    assert vals[0] > 0 and vals[1] == pytest.approx(vals[0], rel=1e-5)
