"""The LM head at supervised positions only, in bounded chunks: host-side layout + in-graph chunked CE.

Why: with the real Qwen3 vocabulary (151,936 rows) a full head makes fp32 [L, V] logits plus an
equal-sized log-softmax and its gradient: 20 GB at 32k tokens, 80 GB at 131k. Only positions with a
target need logits (prompts, image tokens and padding have none), and no more than
`loss.logits_chunk_tokens` of them need to exist at once.

Host side (`supervised_layout`, numpy): per row of a micro-batch, the positions (within the row) of its
supervised targets, padded to a static [n_chunks, chunk] grid shared by the rows (row-local, so the grid
splits by rows under data parallelism like every model input):
  - n_sup <= C (C = logits_chunk_tokens, n_sup = the most supervised targets in a row): one chunk of
    min(round_up(n_sup, 8), C) slots;
  - n_sup > C: ceil(n_sup / C) chunks of exactly C slots.
  So a chunk never holds more than C positions. Padding slots point at position 0 with target IGNORE,
  segment 0 and token index -1; they contribute nothing to either loss. The train step gathers each row's
  positions from its own hidden states and runs the B*n chunks one after another.

Graph side (`ChunkedHeadCE`): hidden [n, c, D] gathered at those positions, the head weight [V, D]
and targets [n, c] -> per-position cross entropy [n, c] (0 at IGNORE). A `while` loop over the n
chunks computes one [c, V] logits block at a time (forward: log-softmax and the target entry; the
block is freed before the next, except chunk 0's log-softmax, which the backward reuses). The backward is a
custom bprop that recomputes the logits of every further block (one extra [c, D] x [D, V] matmul each;
none when there is one chunk) and accumulates dW and dh chunk by chunk (the onehot is
scattered into the [c, V] block, row scalings are applied to [c, D] operands because a broadcast over
a [c, V] block is slow on CPU (docs/PERFORMANCE.md, ## train); the first chunk's dW product is the
accumulator, so one chunk means one [V, D] temporary), so no [N, V] tensor
exists in either direction: peak logits memory is O(C x V), whatever the sequence length. The
per-position CE is what both losses consume (token_mean and the balanced loss, whose weights are
stop-gradient functions of CE), so they are unchanged (tests/train/test_loss_head.py checks loss and
gradients against the full [B, L, V] computation).

CPU kernels (`head_kernels`, ops/csrc/head_ce.cc): with the real vocabulary and a small hidden size the
head's [c, V] elementwise passes and its dW chain cost more than its matmuls, since MindSpore runs each op as
its own pass over memory (docs/PERFORMANCE.md, ## bench). Where the kernel library loads (CPU, not under
semi/auto parallel), `HeadLogSoftmax` replaces LogSoftmax in the forward, and in the row-wise head
(`ChunkedHeadCERowGrad`, float32) `HeadGradInto` is each chunk's whole backward: it makes G = exp(logp) -
onehot(t) a tile at a time, adds G^T @ (h * s) into the accumulator in place and returns dh = (G @ W) * s,
with no [c, V] G and no row blocks (`train.row_grads.head_weight_grad_into` stays the composite path). These
kernels are not bitwise equal to the composite ops: exp is a polynomial, the log-softmax's sum is taken in
double, and both products sum in another order (tests/train/test_head_kernel.py compares them with float64
numpy and the composite ops). `drop_kernel` (`ops.cpu_kernels.drop_kernels`, and the vocab-parallel switch)
returns to the composite ops.
"""
from __future__ import annotations

from typing import Dict, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindvl_ms.ops.cpu_kernels import custom_op
from mindvl_ms.ops.dispatch import is_ascend
from mindvl_ms.train.row_grads import NO_GRAD, head_weight_grad_into

IGNORE = -100
PAD_MULTIPLE = 8


def chunk_grid(n_sup: int, chunk: int) -> Tuple[int, int]:
    """(n_chunks, chunk_size) for n_sup supervised positions with at most `chunk` per chunk."""
    if chunk < 1:
        raise ValueError(f"logits_chunk_tokens must be >= 1, got {chunk}")
    if n_sup <= chunk:
        return 1, min(max(PAD_MULTIPLE, -(-n_sup // PAD_MULTIPLE) * PAD_MULTIPLE), chunk)
    return -(-n_sup // chunk), chunk


def supervised_layout(targets: np.ndarray, segment_ids: np.ndarray, token_index: np.ndarray,
                      chunk: int, min_slots: int = 0) -> Dict[str, np.ndarray]:
    """Host side: targets/segment_ids/token_index [B, L] -> each row's compact chunk grid (see module doc),
    sized for the row with the most supervised positions and at least `min_slots` (pipeline micro-batches
    and fixed stage shapes share one grid).

    Returns, each int32 [B, n, c]: logit_index (positions within the row), sup_targets, sup_segment_ids
    (the row's supervised samples numbered 1, 2, ... within the row; the train step makes them unique
    across rows) and sup_token_index."""
    t = np.asarray(targets)
    b = t.shape[0]
    pos = [np.flatnonzero(row != IGNORE) for row in t]
    n, c = chunk_grid(max([p.size for p in pos] + [min_slots]), chunk)
    index = np.zeros((b, n * c), np.int32)
    out_t = np.full((b, n * c), IGNORE, np.int32)
    out_s = np.zeros((b, n * c), np.int32)
    out_i = np.full((b, n * c), -1, np.int32)
    for r, p in enumerate(pos):
        index[r, :p.size] = p
        out_t[r, :p.size] = t[r, p]
        out_s[r, :p.size] = np.unique(np.asarray(segment_ids)[r, p], return_inverse=True)[1].reshape(-1) + 1
        out_i[r, :p.size] = np.asarray(token_index)[r, p]
    return {"logit_index": index.reshape(b, n, c), "sup_targets": out_t.reshape(b, n, c),
            "sup_segment_ids": out_s.reshape(b, n, c), "sup_token_index": out_i.reshape(b, n, c)}


def _cast(x, dtype):
    """x in `dtype`, as x itself when it already is (decided at compile time): `Tensor.astype` copies even
    then, and for the [V, D] head weight that copy is a table-sized TensorMove per micro-step
    (docs/PERFORMANCE.md, ## train)."""
    return x if x.dtype == dtype else x.astype(dtype)


def head_kernels():
    """(HeadLogSoftmax, HeadGradInto), the head's C++ CPU ops (ops/csrc/head_ce.cc), or None: on Ascend, under
    semi/auto parallel (the compiler shards the composite primitives) and where the kernel library cannot
    be built or loaded."""
    if is_ascend() or ms.get_auto_parallel_context("parallel_mode") in ("semi_auto_parallel", "auto_parallel"):
        return None
    ops_ = (custom_op("HeadLogSoftmax", 1), custom_op("HeadGradInto", 6))
    return ops_ if all(op is not None for op in ops_) else None


PRIMITIVES = ("mm_nt", "mm", "mm_tn", "max", "sub", "exp", "sum", "log", "onehot", "mul", "div", "sub_onehot")


class _HeadBlocks(nn.Cell):
    """The chunk loop with its custom bprop: construct(hidden [n, c, D], weight [V, D], targets [n, c]) ->
    (CE [n, c], kept), kept = chunk 0's float32 log-softmax [c, V] (the fused path; a [1] zero in the
    vocab-parallel form). The bprop reads chunk 0's probabilities from `kept` (exp of the log-softmax)
    instead of recomputing its logits, one [c, D] x [D, V] matmul fewer per micro-step (all of them when
    the step has one chunk). Only chunk 0's block is kept, so the head still holds O(C x V) memory: the
    block lives from the head's forward to its backward, which runs next. The primitives are the owning
    `ChunkedHeadCE`'s (shared objects: the strategies it is given are theirs).

    `one_block`: the n chunks are one [n * c, V] block, with no loop: for a stage whose micro-batches fit
    one chunk (`train_step.one_block_head`), so that block is at most one chunk's. A loop over a
    dynamic chunk count is control flow, which splits the micro-step into many kernel graphs launched one
    after another; one block is one straight graph (docs/PERFORMANCE.md, ## train)."""

    def __init__(self, prims, one_block: bool = False, kernel: bool = True):
        super().__init__()
        self.vocab_parallel = False                         # set through ChunkedHeadCE.vocab_parallel
        self.one_block = bool(one_block)
        for name in PRIMITIVES:
            setattr(self, name, prims[name])
        self.on, self.off = ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32)
        self.fused_log_softmax = is_ascend()
        kernels = head_kernels() if kernel else None
        self.lsm_kernel, self.grad_kernel = kernels or (None, None)
        self.kernel = kernels is not None                   # read by the graph; only drop_kernel changes it

    def drop_kernel(self):
        """The composite ops from now on, and no C++ op held (`ops.cpu_kernels.drop_kernels`, the vocab-parallel
        form)."""
        self.kernel = False
        self.lsm_kernel = self.grad_kernel = None

    def _logits(self, h, w):
        """[c, D] x [V, D] -> float32 [c, V] (matmul in h's dtype, as `models.text.lm_logits`)."""
        return _cast(self.mm_nt(h, w), ms.float32)

    def _split_form(self, h, w, t):
        """One block in the vocab-parallel form: (z = logits - max [c, V], sum exp z [c, 1], exp z [c, V],
        onehot(t) [c, V]); IGNORE targets index row 0's class and are masked by the caller."""
        logits = self._logits(h, w)
        _, top = self.max(logits)                                        # [c, 1]
        z = self.sub(logits, top)
        e = self.exp(z)
        onehot = self.onehot(ops.maximum(t, 0), logits.shape[-1], self.on, self.off)  # [c, V]
        return z, self.sum(e, -1), e, onehot

    def _block_ce(self, h, w, t):
        """One chunk: (CE [c] (0 at IGNORE), the block's float32 log-softmax [c, V], or a [1] zero in the
        vocab-parallel form)."""
        valid = (t != IGNORE).astype(ms.float32)
        if self.vocab_parallel:
            z, total, _, onehot = self._split_form(h, w, t)
            return (self.log(total) - self.sum(self.mul(z, onehot), -1))[:, 0] * valid, ops.zeros((1,), ms.float32)
        logp = self._log_softmax(self._logits(h, w))                    # [c, V]
        return -ops.gather_elements(logp, 1, ops.maximum(t, 0).reshape(-1, 1))[:, 0] * valid, logp

    def _log_softmax(self, logits):
        """float32 [c, V] -> its log-softmax: the HeadLogSoftmax kernel; on Ascend MindSpore's fused LogSoftmax
        (no [c, V] broadcasts); else z - log(sum exp z), z = logits - max. MindSpore 2.9's CPU LogSoftmax
        inside the chunk loop (a while loop over dynamic shapes) returns stale values for chunks 1..n-1
        on some calls (ops/softmax.py), so the CPU composite path does not use it."""
        if self.kernel:
            return self.lsm_kernel(logits)
        if self.fused_log_softmax:
            return ops.log_softmax(logits, -1)
        _, top = self.max(logits)                                        # [c, 1]
        z = self.sub(logits, top)
        return self.sub(z, self.log(self.sum(self.exp(z), -1)))

    def construct(self, hidden, weight, targets):
        n = hidden.shape[0]
        w = _cast(weight, hidden.dtype)
        if self.one_block:                                           # [n * c, D] at once
            ce, kept = self._block_ce(hidden.reshape(-1, hidden.shape[-1]), w, targets.reshape(-1))
            return ce.reshape(targets.shape), kept
        ce = ops.zeros(targets.shape, ms.float32)                    # [n, c]
        first, kept = self._block_ce(hidden[0], w, targets[0])
        ce[0] = first
        i = 1
        while i < n:
            ce[i] = self._block_ce(hidden[i], w, targets[i])[0]
            i += 1
        return ce, kept

    def bprop(self, hidden, weight, targets, out, dout):
        dh, dw = self._backward(hidden, weight, targets, dout[0], out[1], None)
        return dh, _cast(dw, weight.dtype), ops.zeros_like(targets)

    def _backward(self, hidden, weight, targets, dout, kept, acc):
        """-> (dh [n, c, D], dW). d CE / d logits = softmax - onehot(t), times s = dout * valid per row. The
        onehot is subtracted in the [c, V] block (c entries scattered), the row scaling applied to the
        [c, D] operands:
          G = P - onehot(t),  dh = (G @ W) * s,  dW = sum over chunks of G^T @ (h * s)
        Chunk 0's P is exp(kept) (the forward's log-softmax), the other chunks' are recomputed.
        acc None: dW is that float32 [V, D] sum; the first chunk's product is the sum itself, so a
        single-chunk step holds one [V, D] product. acc (the head's accumulator): each chunk's product is
        added into acc in row blocks (`train.row_grads`) and dW is a [1] zero that depends on those adds; with the
        C++ kernels and float32 hidden states, `_backward_fused` instead."""
        n = hidden.shape[0]
        w = _cast(weight, hidden.dtype)
        if self.kernel and acc is not None and hidden.dtype == ms.float32 and not self.vocab_parallel:
            return self._backward_fused(hidden, w, targets, dout, kept, acc)
        if self.one_block:                                            # one [n * c, V] block, kept from the forward
            g, hs = self._block_grad(hidden.reshape(-1, hidden.shape[-1]), w, targets.reshape(-1), dout.reshape(-1),
                                     kept)
            return (self.mm(g, w) * hs[1]).reshape(hidden.shape), self._dw_first(g, hs[0], acc)
        dh = ops.zeros(hidden.shape, hidden.dtype)                    # [n, c, D]
        g, hs = self._block_grad(hidden[0], w, targets[0], dout[0], kept)
        dh[0] = self.mm(g, w) * hs[1]
        dw = self._dw_first(g, hs[0], acc)
        i = 1
        while i < n:
            g, hs = self._block_grad(hidden[i], w, targets[i], dout[i], None)
            dh[i] = self.mm(g, w) * hs[1]                              # [c, D]
            dw = self._dw_add(dw, g, hs[0], acc)
            i += 1
        return dh, dw

    def _backward_fused(self, hidden, w, targets, dout, kept, acc):
        """`_backward` by the HeadGradInto kernel, one call per chunk: -> (dh [n, c, D], a [1] zero that
        depends on every call); each call adds its chunk's dW into acc in place."""
        if self.one_block:
            dh = self._fused_grad(hidden.reshape(-1, hidden.shape[-1]), w, targets.reshape(-1), dout.reshape(-1),
                                  kept, acc)
            return dh.reshape(hidden.shape), ops.depend(ops.zeros((1,), ms.float32), dh)
        n = hidden.shape[0]
        dh = ops.zeros(hidden.shape, hidden.dtype)                    # [n, c, D]
        first = self._fused_grad(hidden[0], w, targets[0], dout[0], kept, acc)
        dh[0] = first
        done = ops.depend(ops.zeros((1,), ms.float32), first)
        i = 1
        while i < n:
            di = self._fused_grad(hidden[i], w, targets[i], dout[i], None, acc)
            dh[i] = di
            done = ops.depend(done, di)
            i += 1
        return dh, done

    def _fused_grad(self, h, w, t, dout, kept, acc):
        """One chunk (h [c, D] float32): dh [c, D] = (G @ W) * s, and acc += G^T @ (h * s) in place, by the
        kernel from the block's log-softmax (`kept`, or recomputed when None); targets go in as float32 (the
        ids are exact below 2^24, which the kernel checks against V)."""
        logp = self.lsm_kernel(self._logits(h, w)) if kept is None else kept
        s = dout * (t != IGNORE).astype(ms.float32)                   # [c]
        return self.grad_kernel(logp, ops.maximum(t, 0).astype(ms.float32), h, s, w, acc)

    def _dw_first(self, g, hs, acc):
        if acc is None:
            return _cast(self.mm_tn(g, hs), ms.float32)               # [V, D]
        return ops.depend(ops.zeros((1,), ms.float32), head_weight_grad_into(acc, g, hs))

    def _dw_add(self, dw, g, hs, acc):
        if acc is None:
            return dw + _cast(self.mm_tn(g, hs), ms.float32)          # [V, D]
        return ops.depend(dw, head_weight_grad_into(acc, g, hs))

    def _block_grad(self, h, w, t, dout, kept):
        """One chunk: (G = softmax(h W^T) - onehot(t) [c, V], (h * s [c, D], s [c, 1])); IGNORE rows have s 0.
        `kept`: the block's log-softmax from the forward (fused path), or None (recompute the logits)."""
        c = t.shape[0]
        s = (dout * (t != IGNORE).astype(ms.float32)).reshape(-1, 1).astype(h.dtype)  # [c, 1]
        if self.vocab_parallel:
            _, total, e, onehot = self._split_form(h, w, t)
            return _cast(self.sub_onehot(self.div(e, total), onehot), h.dtype), (h * s, s)
        if kept is None:
            p = _cast(ops.softmax(self._logits(h, w), -1), h.dtype)  # [c, V]
        else:
            p = _cast(ops.exp(kept), h.dtype)                          # [c, V]
        at = ops.stack((ops.arange(c, dtype=ms.int32), ops.maximum(t, 0).astype(ms.int32)), 1)  # [c, 2] (row, target)
        g = ops.tensor_scatter_sub(p, at, ops.ones((c,), p.dtype))    # P - onehot(t)
        return g, (h * s, s)


class _HeadBlocksRowGrad(_HeadBlocks):
    """`_HeadBlocks` whose bprop adds dW into the accumulator `acc` in row blocks (`train.row_grads`).
    construct(hidden, weight, targets, acc, token) -> (CE [n, c], kept)."""

    def construct(self, hidden, weight, targets, acc, token):
        return _HeadBlocks.construct(self, hidden, weight, targets)

    def bprop(self, hidden, weight, targets, acc, token, out, dout):
        dh, done = self._backward(hidden, weight, targets, dout[0], out[1], acc)
        return (dh, NO_GRAD, ops.zeros_like(targets), NO_GRAD, ops.depend(ops.zeros_like(token), done))


class ChunkedHeadCE(nn.Cell):
    """construct(hidden [n, c, D], weight [V, D], targets int32 [n, c]) -> CE float32 [n, c] (0 at IGNORE).

    One [c, V] logits block at a time in both passes (custom bprop recomputes the block). With static shapes
    graph mode unrolls the loop over n; with the train step's dynamic shapes n is unknown when compiling, so
    the loop is control flow. `one_block` (all n chunks as one [n * c, V] block, for stages whose
    micro-batches fit one chunk) has no loop.

    Every primitive the blocks use is the cell's own, so `parallel.parallelize.shard_loss_head` can declare
    MindFormers' vocab-parallel strategies on them (the head weight [V, D] split on V, the convention of
    `lm_head`) and the audit (`parallel/audit.py`) reads them back. Sharded, the cell sets `vocab_parallel`
    and each block runs in the form of MindFormers' VocabParallelCrossEntropy
    (parallel_core/training_graph/loss_func.py): with z = logits - max, CE = log sum exp z - <z, onehot(t)>
    and dCE/dlogits = exp z / sum exp z - onehot(t). The max and the two sums reduce over the split V axis,
    which semi-auto parallel completes with an all-reduce over the vocab shards, so no rank ever holds a
    full [c, V] block (tests/parallel/test_loss_head_parallel.py checks this split form against the full
    cross entropy shard by shard). Unsharded (CPU, stand-alone) the block is the fused log-softmax / softmax
    path, as before, by the C++ kernels where they load (module doc; `kernel` False: never)."""

    def __init__(self, blocks=_HeadBlocks, one_block: bool = False, kernel: bool = True):
        super().__init__()
        self.mm_nt = ops.MatMul(transpose_b=True)           # [c, D] x [V, D]^T -> [c, V]
        self.mm = ops.MatMul()                              # [c, V] x [V, D] -> [c, D]
        self.mm_tn = ops.MatMul(transpose_a=True)           # [c, V]^T x [c, D] -> [V, D]
        self.max = ops.ArgMaxWithValue(axis=-1, keep_dims=True)  # [c, V] -> [c, 1] (MindFormers' _LogSoftmax)
        self.sub = ops.Sub()                                # [c, V] - [c, 1]
        self.exp = ops.Exp()                                # [c, V]
        self.sum = ops.ReduceSum(keep_dims=True)            # [c, V] -> [c, 1]
        self.log = ops.Log()                                # [c, 1]
        self.onehot = ops.OneHot()                          # targets [c] -> [c, V]
        self.mul = ops.Mul()                                # z * onehot [c, V]
        self.div = ops.RealDiv()                            # exp z / sum [c, V]
        self.sub_onehot = ops.Sub()                         # P - onehot [c, V]
        self.blocks = blocks({name: getattr(self, name) for name in PRIMITIVES}, one_block, kernel)

    @property
    def vocab_parallel(self) -> bool:
        """The vocab-parallel form's switch (set by parallel.parallelize.shard_loss_head)."""
        return self.blocks.vocab_parallel

    @vocab_parallel.setter
    def vocab_parallel(self, on: bool) -> None:
        if on:
            self.blocks.drop_kernel()  # the compiler shards the composite primitives, not the C++ ops
        self.blocks.vocab_parallel = bool(on)

    def construct(self, hidden, weight, targets):
        return self.blocks(hidden, weight, targets)[0]


class ChunkedHeadCERowGrad(ChunkedHeadCE):
    """`ChunkedHeadCE` whose backward adds the head's dW into its accumulator in place, in row blocks
    (`train.row_grads`), instead of returning a [V, D] gradient.

    construct(hidden [n, c, D], weight [V, D], targets [n, c], acc [V, D], token [1]) -> CE [n, c]."""

    def __init__(self, one_block: bool = False, kernel: bool = True):
        super().__init__(_HeadBlocksRowGrad, one_block, kernel)

    def construct(self, hidden, weight, targets, acc, token):
        return self.blocks(hidden, weight, targets, acc, token)[0]
