"""MindVL whose forward returns logits only at supervised positions, per row ([B, K, V]).

Training no longer needs it: the train step does this for every model with `hidden_states` and
`head_weight` (MindVL), in bounded chunks over a flat supervised-position grid (`mindvl_ms.train.loss_head`;
`mindvl demo` trains the plain model). This module stays for code that wants the kept logits from a
model forward; `TrainStep` runs it on the full-logits path, since its inputs differ from
`hidden_states`'.

With the real Qwen3 vocabulary (151,936 rows) the LM head is ~99% of the tiny model's FLOPs, and in
the demo data only ~20% of positions carry a target (prompts and image tokens are unsupervised). This
subclass gathers the final hidden states at the supervised positions before the LM head, so the
head, the log-softmax and their gradients run on [B, K, V] instead of [B, L, V] (K = most targets in
a row). Same parameters and names as `MindVLForConditionalGeneration` (it is a subclass), so its
checkpoints are ordinary MindVL checkpoints; generation and evaluation use the base class.

Inputs (INPUT_NAMES): the base model's, with its `segment_ids` renamed `attn_segment_ids` (attention
segments [B, L]), plus `logit_index` int32[B*K] (flat positions into B*L whose logits are needed) and
`segment_ids` int32[B, K] (the sample id of each kept position, 0 = padding), which is what the
trainer's loss reads next to `targets` [B, K]. `compact_targets` turns a `build_model_inputs` batch
into this layout; token-mean and balanced losses give the same values as on the full layout, because
unsupervised positions contribute nothing to either.
"""
from __future__ import annotations

from typing import Dict

import numpy as np
from mindspore import ops

from mindvl_ms.data.collate import IGNORE, INPUT_NAMES
from mindvl_ms.models.mindvl import MindVLForConditionalGeneration

SPARSE_INPUT_NAMES = tuple("attn_segment_ids" if n == "segment_ids" else n for n in INPUT_NAMES) + (
    "logit_index", "segment_ids")


class SupervisedLogitsMindVL(MindVLForConditionalGeneration):
    INPUT_NAMES = SPARSE_INPUT_NAMES

    def construct(self, input_ids, position_ids, attn_segment_ids, pixel_values, vision_pos_ids, window_index,
                  reverse_index, window_segment_ids, full_segment_ids, embed_index, window_gather, full_gather,
                  actual_seq_len, logit_index, segment_ids):
        hidden, aux_loss, expert_load = self.hidden_states(
            input_ids, position_ids, attn_segment_ids, pixel_values, vision_pos_ids, window_index, reverse_index,
            window_segment_ids, full_segment_ids, embed_index, window_gather, full_gather,
            actual_seq_len)  # [B, L, D]
        b, k, d = segment_ids.shape[0], segment_ids.shape[1], hidden.shape[-1]
        kept = ops.gather(hidden.reshape(-1, d), logit_index, 0).reshape(b, k, d)  # [B, K, D]
        return self.logits(kept), aux_loss, expert_load  # [B, K, V]


def compact_targets(batch: Dict[str, np.ndarray], multiple: int = 8) -> Dict[str, np.ndarray]:
    """A `build_model_inputs` batch -> the SupervisedLogitsMindVL layout (see module doc).

    K is the most supervised targets in any row, rounded up to `multiple` (fewer distinct shapes);
    padding slots point at position 0 of their row with target IGNORE and segment 0."""
    targets, seg, tok = batch["targets"], batch["segment_ids"], batch["token_index"]
    b, l = targets.shape
    sup = targets != IGNORE
    k = max(1, int(sup.sum(axis=1).max()) if b else 1)
    k = -(-k // multiple) * multiple
    index = np.zeros((b, k), np.int32)
    new_t = np.full((b, k), IGNORE, np.int32)
    new_seg = np.zeros((b, k), np.int32)
    new_tok = np.full((b, k), -1, np.int32)
    for r in range(b):
        pos = np.flatnonzero(sup[r])
        n = pos.size
        index[r] = r * l
        index[r, :n] = r * l + pos
        new_t[r, :n], new_seg[r, :n], new_tok[r, :n] = targets[r, pos], seg[r, pos], tok[r, pos]
    out = dict(batch)
    out["attn_segment_ids"] = seg
    out["segment_ids"], out["targets"], out["token_index"] = new_seg, new_t, new_tok
    out["logit_index"] = index.reshape(-1)
    return out
