"""A tiny stand-in for MindVLModel used by the trainer tests.

Same call convention (positional INPUT_NAMES arrays -> logits [B, L, V]) and the same parameter
name prefixes (`visual.merger.`, `visual.`, `model.`, `lm_head.`), but small enough to compile in
seconds: token embedding, one segment-masked causal attention layer (samples in a pack cannot see
each other), a per-sample "vision" feature (row k of pixel_values belongs to segment k+1) added to
the sample's tokens, lm head.
"""
import numpy as np
from mindspore import nn, ops

IGNORE = -100


class _Merger(nn.Cell):
    def __init__(self, d_in, d):
        super().__init__()
        self.mlp = nn.Dense(d_in, d, weight_init="normal")


class _Visual(nn.Cell):
    def __init__(self, d_in, d):
        super().__init__()
        self.patch_embed = nn.Dense(d_in, d_in, weight_init="normal")
        self.merger = _Merger(d_in, d)


class _Text(nn.Cell):
    def __init__(self, vocab, d):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.q = nn.Dense(d, d, has_bias=False, weight_init="normal")
        self.k = nn.Dense(d, d, has_bias=False, weight_init="normal")
        self.v = nn.Dense(d, d, has_bias=False, weight_init="normal")
        self.norm = nn.LayerNorm((d,))


class TinyVLM(nn.Cell):
    INPUT_NAMES = ("input_ids", "segment_ids", "pixel_values")

    def __init__(self, vocab=32, d=16, d_in=8):
        super().__init__()
        self.visual = _Visual(d_in, d)
        self.model = _Text(vocab, d)
        self.lm_head = nn.Dense(d, vocab, has_bias=False, weight_init="normal")
        self.scale = 1.0 / np.sqrt(d)

    def construct(self, input_ids, segment_ids, pixel_values):
        h = self.model.embed_tokens(input_ids)                                  # [B, L, D]
        img = self.visual.merger.mlp(ops.tanh(self.visual.patch_embed(pixel_values)))  # [S, D] one per sample
        table = ops.cat((ops.zeros_like(img[:1]), img), 0)                      # [S+1, D], row 0 = padding
        h = h + ops.gather(table, segment_ids, 0)                               # each sample sees its own image
        q, k, v = self.model.q(h), self.model.k(h), self.model.v(h)             # [B, L, D]
        s = ops.matmul(q, k.swapaxes(1, 2)) * self.scale                         # [B, L, L]
        l = input_ids.shape[1]
        pos = ops.arange(l)
        causal = pos.reshape(-1, 1) >= pos.reshape(1, -1)                        # [L, L]
        same = segment_ids.expand_dims(2) == segment_ids.expand_dims(1)          # [B, L, L]
        allowed = ops.logical_and(same, causal.expand_dims(0))
        s = ops.select(allowed, s, ops.full_like(s, -1e4))  # -1e4 also fits float16
        h = h + ops.matmul(ops.softmax(s, -1), v)
        return self.lm_head(self.model.norm(h))                                 # [B, L, V]


def make_sample(rng, vocab=32, n_min=3, n_max=9, d_in=8):
    n = int(rng.randint(n_min, n_max + 1))
    ids = rng.randint(1, vocab, size=n).astype(np.int64)
    labels = ids.copy()
    labels[: max(1, n // 3)] = IGNORE  # a "prompt" part without supervision
    return {"input_ids": ids, "labels": labels, "pixel": rng.randn(d_in).astype(np.float32)}


def make_rows(n_rows, seed=0, max_per_row=3, vocab=32):
    rng = np.random.RandomState(seed)
    return [[make_sample(rng, vocab) for _ in range(rng.randint(1, max_per_row + 1))] for _ in range(n_rows)]


def collate(rows, stage, pad_to=None):
    """Text-only version of build_model_inputs' loss-side contract plus a [rows, d_in] pixel stand-in."""
    length = pad_to or stage.seq_length
    b = len(rows)
    input_ids = np.zeros((b, length), np.int32)
    segment_ids = np.zeros((b, length), np.int32)
    targets = np.full((b, length), IGNORE, np.int32)
    token_index = np.full((b, length), -1, np.int32)
    sid, pix = 0, []
    for r, row in enumerate(rows):
        col = 0
        for s in row:
            n = len(s["input_ids"])
            if col + n > length:
                raise ValueError(f"row {r} holds more than {length} tokens")
            sid += 1
            input_ids[r, col:col + n] = s["input_ids"]
            segment_ids[r, col:col + n] = sid
            tgt = np.concatenate([s["labels"][1:], [IGNORE]])
            targets[r, col:col + n] = tgt
            sup = tgt != IGNORE
            token_index[r, col:col + n] = np.where(sup, np.cumsum(sup) - 1, -1)
            pix.append(s["pixel"])
            col += n
    return {"input_ids": input_ids, "segment_ids": segment_ids, "pixel_values": np.stack(pix).astype(np.float32),
            "targets": targets, "token_index": token_index, "num_samples": np.int32(sid)}
