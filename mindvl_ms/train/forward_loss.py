"""The loss side of the train step: the model's forward plus the training loss share, as one Cell.

- `ForwardLoss`: forward, loss share (+ MoE aux loss) of one micro-batch. For models with
  `hidden_states` + `head_weight` (MindVL, `has_sparse_head`) the LM head runs only at the supervised
  positions, in chunks of `loss.logits_chunk_tokens` (`train/loss_head.py`; the host computes the gather
  grid); other models return full [B, L, V] logits. The [V, D] tables (embedding, head) may add their
  gradients into the accumulators row-wise from their own bprops (`train/row_grads.py`,
  `row_grad_tables`), so no dense [V, D] gradient is made.
- `WeightSumStep`: forward only, the sum of balanced-loss token weights of one micro-batch (the pre-pass
  that makes each micro-batch's share exact when the global batch is split).
"""
from __future__ import annotations

import inspect
from typing import Dict, Optional, Sequence

import mindspore as ms
from mindspore import Parameter, ParameterTuple, nn, ops

from mindvl_ms.parallel.parallelize import shard_loss_head
from mindvl_ms.train.loss import IGNORE, TrainLoss, token_ce
from mindvl_ms.train.loss_head import ChunkedHeadCE, ChunkedHeadCERowGrad
from mindvl_ms.train.row_grads import RowGradEmbedding, row_grad_token


def backbone(model: nn.Cell) -> nn.Cell:
    """The model under an AMP wrapper (`auto_mixed_precision` O2 wraps it in `_OutputTo32`)."""
    return getattr(model, "_backbone", model)


def has_sparse_head(model: nn.Cell) -> bool:
    """True when the model exposes `hidden_states(*inputs)` and `head_weight()` (MindVL does): the
    step then runs the LM head only at supervised positions, in chunks (train/loss_head.py)."""
    net = backbone(model)
    hs, hw = getattr(net, "hidden_states", None), getattr(net, "head_weight", None)
    if not (callable(hs) and callable(hw)):
        return False
    names = getattr(net, "INPUT_NAMES", ())  # a subclass with other inputs (its own logits layout) opts out
    return len(inspect.signature(hs).parameters) == len(names)


def supervised_chunks(hidden, targets, seg, tok, index):
    """hidden [B, L, D] and each row's chunk grid [B, n, c] (`loss_head.supervised_layout`, row-local) ->
    (hidden at the supervised positions [B*n, c, D], targets, segment ids, token index [B*n, c]): a per-row
    gather, and the rows' sample numbers made unique across rows (row r's sample j -> r*n*c + j; a row has
    at most n*c supervised samples), so whichever rank built a row, it means the same in the global batch."""
    b, n, c = index.shape
    d = hidden.shape[-1]
    kept = ops.gather(hidden, index.reshape(b, n * c), 1, 1).reshape(b * n, c, d)     # [B*n, c, D]
    offset = (ops.arange(b, dtype=ms.int32) * (n * c)).reshape(b, 1, 1)
    seg = ops.where(seg > 0, seg + offset, ops.zeros_like(seg))
    return kept, targets.reshape(b * n, c), seg.reshape(b * n, c), tok.reshape(b * n, c)


class ForwardLoss(nn.Cell):
    """(*model_inputs, *loss_inputs, token_norm, num_samples, scale) -> (loss share * scale, expert load).

    loss_inputs: sparse head (`has_sparse_head`): sup_targets, sup_segment_ids, sup_token_index,
    logit_index, all [B, n, c] and row-local (`loss_head.supervised_layout`, see `supervised_chunks`); otherwise targets, token_index [B, L] (the model
    returns full [B, L, V] logits and segment_ids is the model input at `seg_pos`).

    `row_grads` {table Parameter name: accumulator} (sparse head only, `row_grad_tables`): the embedding
    lookup and/or the head add those tables' gradients into the accumulators themselves (train/row_grads.py);
    `self.token` then carries the dependency and the tables must be left out of the differentiated weights.
    `one_block`: the head's chunks run as one block, without a loop (`loss_head._HeadBlocks`), for a stage
    whose micro-batches fit one chunk (`train_step.one_block_head`)."""

    def __init__(self, model: nn.Cell, loss: TrainLoss, n_model: int, seg_pos: int, aux_weight: float = 1.0,
                 sparse: bool = False, row_grads: Optional[Dict[str, Parameter]] = None, one_block: bool = False):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.model, self.loss, self.n_model, self.seg_pos = model, loss, n_model, seg_pos
        self.sparse = sparse
        self.row_embed = self.row_head = False
        if row_grads and not sparse:
            raise ValueError("row-wise table gradients need the sparse head (has_sparse_head); got "
                             f"row_grads for {sorted(row_grads)}")
        self.row_tables = frozenset(row_grads or ())  # names of the tables MicroStep must not differentiate
        if sparse:
            self.net = backbone(model)
            row_grads = row_grads or {}
            table, head = self.net.model.embed_tokens.weight, self.net.head_weight()
            self.row_embed, self.row_head = table.name in row_grads, head.name in row_grads
            self.token = row_grad_token() if row_grads else None
            if self.row_embed:
                self.embed = RowGradEmbedding(table, row_grads[table.name], self.token)
            if self.row_head:
                self.head_acc = row_grads[head.name]
            self.head = ChunkedHeadCERowGrad(one_block) if self.row_head else ChunkedHeadCE(one_block=one_block)
            shard_loss_head(self.head, self.net)  # vocab-parallel as the model's LM head, when it is sharded
        self.aux_weight = float(aux_weight)  # 1 / (micro-batches x ranks): the MoE aux loss is a batch mean

    def ce_and_aux(self, *args):
        """-> (ce, mask, segment_ids, token_index [B*n, c] or [B, L], model output tuple or None)."""
        model_args = args[:self.n_model]
        n = self.n_model
        if self.sparse:
            targets, seg, tok, index = args[n], args[n + 1], args[n + 2], args[n + 3]
            if self.row_embed:
                text = self.embed(model_args[0])                                 # [B, L, D]
                hidden, aux, load = self.net.hidden_states_from_embeds(text, *model_args[1:])
            else:
                hidden, aux, load = self.net.hidden_states(*model_args)          # [B, L, D]
            kept, targets, seg, tok = supervised_chunks(hidden, targets, seg, tok, index)  # [B*n, c(, D)]
            if self.row_head:
                ce = self.head(kept, self.net.head_weight(), targets, self.head_acc, self.token)  # [B*n, c]
            else:
                ce = self.head(kept, self.net.head_weight(), targets)         # [B*n, c]
            return ce, (targets != IGNORE).astype(ms.float32), seg, tok, (aux, load)
        out = self.model(*model_args)
        logits = out[0] if isinstance(out, tuple) else out                   # [B, L, V]
        ce, mask = token_ce(logits, args[n])
        extra = (out[1], out[2]) if isinstance(out, tuple) else None
        return ce, mask, model_args[self.seg_pos], args[n + 1], extra

    def construct(self, *args):
        ce, mask, seg, tok, extra = self.ce_and_aux(*args)
        token_norm, num_samples, scale = args[-3], args[-2], args[-1]
        loss = self.loss.from_ce(ce, mask, seg, tok, token_norm, num_samples)
        load = ops.zeros((1, 1), ms.float32)
        if extra is not None:
            loss = loss + extra[0].astype(ms.float32) * self.aux_weight      # MoE sequence-wise aux loss
            load = extra[1].astype(ms.float32)                               # [moe layers, E] routed tokens
        return loss * scale, load


class WeightSumStep(nn.Cell):
    """Forward only: the sum of balanced-loss token weights of one micro-batch (same inputs as ForwardLoss
    without the three scalars)."""

    def __init__(self, forward: ForwardLoss):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.forward = forward

    def construct(self, *args):
        ce, mask, _, tok, _ = self.forward.ce_and_aux(*args)
        return self.forward.loss.weight_sum_ce(ce, mask, tok)


def row_grad_tables(model: nn.Cell, params: Sequence[Parameter], accum: ParameterTuple) -> Dict[str, Parameter]:
    """{name: accumulator} of the trainable [V, D] tables whose gradients are added row-wise
    (train/row_grads.py): the token embedding (when the model can take looked-up embeddings,
    `hidden_states_from_embeds`) and the LM head, for models with the sparse head. Empty otherwise."""
    if not has_sparse_head(model):
        return {}
    net = backbone(model)
    by_name = {p.name: a for p, a in zip(params, accum)}
    tables = [net.head_weight()]
    if callable(getattr(net, "hidden_states_from_embeds", None)):
        tables.append(net.model.embed_tokens.weight)
    return {t.name: by_name[t.name] for t in tables if t.name in by_name}
