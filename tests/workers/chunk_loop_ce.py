"""The composite chunked LM head (train/loss_head.py, no C++ kernels) under the train step's dynamic shapes,
called CALLS times on new random blocks of 2-4 chunks: prints `max_error <e>`, the largest absolute
difference from numpy's float64 cross-entropy over every call and chunk. Run by
tests/train/test_loss_head.py in a process with tbbmalloc preloaded.

    python tests/workers/chunk_loop_ce.py [CALLS]
"""
import os
import sys

import numpy as np

os.environ.setdefault("GLOG_v", "3")
import mindspore as ms  # noqa: E402
from mindspore import Tensor, nn  # noqa: E402

from mindvl_ms.train.loss_head import IGNORE, ChunkedHeadCE  # noqa: E402

V, D, C = 50, 8, 5


class _Head(nn.Cell):
    def __init__(self):
        super().__init__()
        self.head = ChunkedHeadCE(kernel=False)

    def construct(self, h, w, t):
        return self.head(h, w, t)


def main(calls: int) -> float:
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    net = _Head()
    net.set_inputs(Tensor(shape=[None, None, D], dtype=ms.float32), Tensor(shape=[V, D], dtype=ms.float32),
                   Tensor(shape=[None, None], dtype=ms.int32))  # as the train step declares them
    rng = np.random.default_rng(0)
    w = rng.standard_normal((V, D)).astype(np.float32)
    worst = 0.0
    for k in range(calls):
        n = (4, 3, 2)[k % 3]
        h = rng.standard_normal((n, C, D)).astype(np.float32)
        t = rng.integers(0, V, (n, C)).astype(np.int32)
        t[0, 1] = IGNORE
        got = net(Tensor(h), Tensor(w), Tensor(t)).asnumpy().reshape(-1)
        z = h.reshape(-1, D).astype(np.float64) @ w.T.astype(np.float64)
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        flat = t.reshape(-1)
        ref = (lse - z[np.arange(n * C), np.maximum(flat, 0)]) * (flat != IGNORE)
        worst = max(worst, float(np.abs(got - ref).max()))
    return worst


if __name__ == "__main__":
    print(f"max_error {main(int(sys.argv[1]) if len(sys.argv) > 1 else 20):.3g}")
