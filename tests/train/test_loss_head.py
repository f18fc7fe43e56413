"""The LM head at supervised positions only, in chunks (train/loss_head.py), against full computations:
the host layout and its chunk bound, the chunked CE and its gradients against float64 numpy, and the
train step's forward (MindVL, both losses, several chunks) against the full [B, L, V] logits path.

    python -m pytest -q tests/train/test_loss_head.py
"""
import os
import re
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from mindvl_ms.config.base import load
from mindvl_ms.config.model import MindVLConfig
from mindvl_ms.config.train import StageConfig
from mindvl_ms.data.collate import build_model_inputs
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.train.forward_loss import ForwardLoss, has_sparse_head
from mindvl_ms.train.loss import TrainLoss
from mindvl_ms.train.loss_head import IGNORE, ChunkedHeadCE, chunk_grid, supervised_layout
from mindvl_ms.train.optim import select_trainable
from mindvl_ms.train.train_step import TrainStep
from tests.support import allocator
from tests.support import hf_tiny as hf_tiny
from tests.support.paths import ROOT
from tests.train.test_trainer_mindvl import MODEL


@pytest.mark.parametrize("chunk", [1, 5, 8, 64, 1000])
def test_chunk_grid_never_exceeds_the_bound(chunk):
    for n_sup in list(range(0, 300)) + [4095, 4096, 4097, 131072]:
        n, c = chunk_grid(n_sup, chunk)
        assert c <= chunk and n * c >= n_sup and n >= 1       # the bound, and room for every target
        if n > 1:
            assert c == chunk and (n - 1) * c < n_sup          # no empty chunk
    with pytest.raises(ValueError, match="logits_chunk_tokens"):
        chunk_grid(3, 0)


def test_supervised_layout_against_a_loop():
    rng = np.random.default_rng(0)
    t = rng.integers(0, 50, (3, 20)).astype(np.int32)
    t[rng.random((3, 20)) < 0.6] = IGNORE
    seg = rng.integers(1, 4, (3, 20)).astype(np.int32)
    tok = rng.integers(0, 9, (3, 20)).astype(np.int32)
    lay = supervised_layout(t, seg, tok, chunk=4)
    rows = [[p for p in range(20) if t[r, p] != IGNORE] for r in range(3)]  # each row's own positions
    b, n, c = lay["logit_index"].shape
    assert b == 3 and c == 4 and n == -(-max(len(p) for p in rows) // 4)
    for r, pos in enumerate(rows):
        flat = {k: v[r].reshape(-1) for k, v in lay.items()}
        assert list(flat["logit_index"][:len(pos)]) == pos
        assert list(flat["sup_targets"][:len(pos)]) == [t[r, p] for p in pos]
        ids = sorted({int(seg[r, p]) for p in pos})  # the row's supervised samples, numbered 1, 2, ...
        assert list(flat["sup_segment_ids"][:len(pos)]) == [ids.index(seg[r, p]) + 1 for p in pos]
        assert list(flat["sup_token_index"][:len(pos)]) == [tok[r, p] for p in pos]
        assert (flat["sup_targets"][len(pos):] == IGNORE).all() and (flat["sup_segment_ids"][len(pos):] == 0).all()


def _numpy_ce_and_grads(h, w, t, coef):
    """float64: CE per position, and d(sum coef*CE)/dh, /dw."""
    h64, w64 = h.astype(np.float64), w.astype(np.float64)
    logits = h64 @ w64.T
    top = logits.max(-1, keepdims=True)
    p = np.exp(logits - top)
    lse = np.log(p.sum(-1)) + top[:, 0]
    p /= p.sum(-1, keepdims=True)
    valid = t != IGNORE
    safe = np.where(valid, t, 0)
    ce = (lse - logits[np.arange(len(t)), safe]) * valid
    g = p.copy()
    g[np.arange(len(t)), safe] -= 1.0
    g *= (coef * valid)[:, None]
    return ce, g @ w64, g.T @ h64


def head_case(seed: int):
    """A chunk grid's hidden states [3, 4, 6], head weight [37, 6], targets (row 2 mostly unsupervised) and
    per-position loss coefficients, and the generator for more draws."""
    rng = np.random.default_rng(seed)
    n, c, d, v = 3, 4, 6, 37
    h = rng.standard_normal((n, c, d)).astype(np.float32)
    w = rng.standard_normal((v, d)).astype(np.float32)
    t = rng.integers(0, v, (n, c)).astype(np.int32)
    t[2, 1:] = IGNORE
    coef = rng.random((n, c)).astype(np.float32)
    return h, w, t, coef, rng


class _HeadGrad(nn.Cell):
    """(sum(CE * coef), CE) and its gradients w.r.t. hidden and weight, for any chunk count (dynamic n); the
    chunks one after another, or all as one block (`one_block`)."""

    def __init__(self, c, d, v, one_block=False, kernel=True):
        super().__init__()
        self.head = ChunkedHeadCE(one_block=one_block, kernel=kernel)
        self.grad = ms.value_and_grad(self.weighted, grad_position=(0, 1), has_aux=True)
        self.set_inputs(Tensor(shape=[None, c, d], dtype=ms.float32), Tensor(shape=[v, d], dtype=ms.float32),
                        Tensor(shape=[None, c], dtype=ms.int32), Tensor(shape=[None, c], dtype=ms.float32))

    def weighted(self, h, w, t, coef):
        ce = self.head(h, w, t)
        return (ce * coef).sum(), ce

    def construct(self, h, w, t, coef):
        return self.grad(h, w, t, coef)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("one_block", [False, True])
def test_chunked_ce_and_gradients_match_numpy(one_block, kernel):
    """With the C++ log-softmax (where the kernel library builds) and with MindSpore's composite ops."""
    ms.set_context(mode=ms.GRAPH_MODE)
    h, w, t, coef, rng = head_case(1)
    n, c, d = h.shape
    v = w.shape[0]
    grad = _HeadGrad(c, d, v, one_block, kernel)
    graphs = []
    for _ in range(3):  # dynamic chunk count: each call has one chunk more, on the same compiled graph
        (val, got_ce), (gh, gw) = grad(Tensor(h), Tensor(w), Tensor(t), Tensor(coef))
        ce, rh, rw = _numpy_ce_and_grads(h.reshape(-1, d), w, t.reshape(-1), coef.reshape(-1))
        assert float(val.asnumpy()) == pytest.approx(float((ce * coef.reshape(-1)).sum()), rel=1e-5)
        np.testing.assert_allclose(got_ce.asnumpy().reshape(-1), ce, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gh.asnumpy().reshape(-1, d), rh, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(gw.asnumpy(), rw, rtol=1e-4, atol=1e-5)
        extra = (rng.standard_normal((1, c, d)).astype(np.float32), rng.integers(0, v, (1, c)).astype(np.int32))
        h, t = np.concatenate([h, extra[0]]), np.concatenate([t, extra[1]])
        coef = np.concatenate([coef, rng.random((1, c)).astype(np.float32)])
        n += 1
        graphs.append(len(grad.compile_cache))
    # the chunk counts ran on one graph (MindSpore compiles the second such cell of a process once more, on
    # its first new input shape: hence the check from the second call on)
    assert graphs[0] <= graphs[1] == graphs[2] <= 2


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(2):
        row = []
        for sizes in ([(28, 28)], [(28, 56)]):
            ids, pv, grid = hf_tiny.image_sample(rng, sizes, text_len=6, vocab=200)
            labels = ids.copy()
            labels[: len(ids) // 2] = -100
            row.append({"input_ids": ids, "labels": labels, "pixel_values": pv, "image_grid_thw": grid})
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def one_block_mindvl():
    """(config, model) of the tiny MindVL with a one-block ViT (the head sees only the language model's
    hidden states; the gradients still reach every vision parameter): built once for both loss kinds."""
    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = load(MindVLConfig, dict(MODEL, vision=dict(MODEL["vision"], depth=1, fullatt_block_indexes=[0])), "test")
    ms.set_seed(0)
    return cfg, MindVLModel(cfg)


def test_composite_chunk_loop_matches_numpy_on_every_call():
    """The composite head's chunk loop (no C++ kernels, dynamic shapes as the train step declares them) over
    20 calls, in a process with tbbmalloc preloaded: every chunk's CE is numpy's. MindSpore 2.9's CPU
    LogSoftmax inside that loop returned stale values for chunks 1..n-1 on 17 of 20 calls there (glibc's
    malloc hid it), so the reported loss was wrong while the gradients, recomputed in the bprop, were not."""
    env = allocator.env_with_preload(dict(os.environ, PYTHONPATH=ROOT))
    if allocator.preload() is None:
        pytest.skip("tbbmalloc is not installed (requirements-test.txt)")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "workers", "chunk_loop_ce.py"), "20"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    error = float(re.search(r"max_error (\S+)", out.stdout).group(1))
    assert error < 1e-4, out.stdout


@pytest.mark.slow  # 12-14 s each: MindVL forward + gradient, compiled twice
@pytest.mark.parametrize("kind", ["token_mean", "balanced"])
def test_sparse_chunked_forward_equals_the_full_logits_path(kind, one_block_mindvl):
    """ForwardLoss on MindVL: supervised-only chunked head (chunk of 5 positions, several chunks) vs the
    model's full [B, L, V] logits: same loss share and the same gradient for every parameter."""
    ms.set_context(mode=ms.GRAPH_MODE)
    cfg, model = one_block_mindvl
    assert has_sparse_head(model)
    batch = build_model_inputs(_batch(), cfg)
    names = list(model.INPUT_NAMES)
    seg_pos = names.index("segment_ids")
    loss = TrainLoss(kind, 0.7, 0.6)
    n_sup = float((batch["targets"] != IGNORE).sum())
    samples = float(len(np.unique(batch["segment_ids"][batch["targets"] != IGNORE])))
    scalars = [Tensor(n_sup if kind == "token_mean" else -1.0, ms.float32), Tensor(samples, ms.float32),
               Tensor(1.0, ms.float32)]
    model_in = [Tensor(batch[k]) for k in names]
    lay = supervised_layout(batch["targets"], batch["segment_ids"], batch["token_index"], chunk=5)
    assert lay["logit_index"].shape[1] > 2
    params = model.trainable_params()
    out = {}
    for sparse in (False, True):
        fwd = ForwardLoss(model, loss, len(names), seg_pos, sparse=sparse)
        extra = ([Tensor(lay[k]) for k in ("sup_targets", "sup_segment_ids", "sup_token_index", "logit_index")]
                 if sparse else [Tensor(batch["targets"]), Tensor(batch["token_index"])])
        grad = ms.value_and_grad(fwd, None, params, has_aux=True)
        (val, _), grads = grad(*model_in, *extra, *scalars)
        out[sparse] = (float(val.asnumpy()), [g.asnumpy() for g in grads])
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-5)
    for p, a, b in zip(params, out[True][1], out[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-6, err_msg=p.name)
    assert any(np.abs(g).max() > 1e-4 for g in out[True][1])


def test_train_step_reads_the_chunk_size_from_the_loss_config():
    cfg = load(MindVLConfig, MODEL, "test")
    model = MindVLModel(cfg)
    batch = build_model_inputs(_batch(1), cfg)
    n_sup = int((batch["targets"] != IGNORE).sum(1).max())  # the row with the most targets
    rows = batch["targets"].shape[0]
    keys = []
    for chunk, expect in ((3, (rows, -(-n_sup // 3), 3)), (4096, (rows, 1, -(-n_sup // 8) * 8))):
        st = load(StageConfig, {"name": "s", "seq_length": 64, "global_batch_size": 2, "micro_batch_size": 2,
                                "max_steps": 1, "loss": {"logits_chunk_tokens": chunk}})
        eng = TrainStep(model, select_trainable(model, [""]), model.INPUT_NAMES, st.loss, st)
        arrays = eng._feeds([batch])[0]
        assert arrays[-1].shape == expect  # logit_index [B, n, c]
        # the head without the chunk loop when the stage's micro-batch (2 rows x 64) fits one chunk
        assert eng.one_block == (chunk >= 2 * 64) == eng.micro.forward.head.blocks.one_block
        keys.append(eng.key)
    assert keys[0] != keys[1]  # a stage restarted on the other head's graphs would compile: not the same step
