"""Per-token log-probs of responses on the project's model (graph mode): two prompt+response samples packed
in one row give the same per-response sums as each alone in a row, and equal numpy log-softmax of the
model's own logits at the target positions (next-token targets from build_model_inputs)."""
import mindspore as ms
import numpy as np
from mindspore import Tensor

from tests.support import post as H
from mindvl_ms.config.train import load_run_config
from mindvl_ms.data.preference import encode_response
from mindvl_ms.data.collate import INPUT_NAMES, build_model_inputs
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.train.post.dpo import response_sums
from mindvl_ms.train.post.step import LogProbs
from mindvl_ms.train.train_step import ms_dtype


def test_packed_response_logprobs():
    cfg = load_run_config(data={"model": H.MODEL, "stages": [{"name": "x", "max_steps": 1}]}).model
    model = MindVLModel(cfg)
    rng = np.random.default_rng(0)
    a = encode_response(H.prompt(rng), [5, 6, 7])
    b = encode_response(H.prompt(rng), [9, 3])
    lp = LogProbs(model, len(INPUT_NAMES))
    packed = build_model_inputs([[a, b]], cfg, pad_to=40)
    alone = build_model_inputs([[a], [b]], cfg, pad_to=40)
    # dynamic dims (as PostTrainStep.target_logp sets them): one graph for the packed and the alone batch
    lp.set_inputs(*[Tensor(shape=[None] * packed[k].ndim, dtype=ms_dtype(packed[k])) for k in INPUT_NAMES],
                  Tensor(shape=[None, None], dtype=ms.int32))
    run = lambda mb: lp(*[Tensor(mb[k]) for k in INPUT_NAMES],  # noqa: E731
                        Tensor(mb["targets"].astype(np.int32))).asnumpy()
    s_packed = response_sums(run(packed), packed["segment_ids"])
    s_alone = response_sums(run(alone), alone["segment_ids"])
    np.testing.assert_allclose(s_packed[1:3], s_alone[1:3], rtol=1e-5)
    logits = model(*[Tensor(alone[k]) for k in INPUT_NAMES])
    logits = (logits[0] if isinstance(logits, tuple) else logits).asnumpy().astype(np.float64)
    mx = logits.max(-1, keepdims=True)
    lsm = logits - mx - np.log(np.exp(logits - mx).sum(-1, keepdims=True))
    t = alone["targets"]
    for row, resp in ((0, [5, 6, 7]), (1, [9, 3])):
        pos = np.flatnonzero(t[row] != -100)
        assert t[row, pos].tolist() == resp                    # the response tokens, predicted one step earlier
        np.testing.assert_allclose(s_alone[row + 1], lsm[row, pos, resp].sum(), rtol=1e-5)
