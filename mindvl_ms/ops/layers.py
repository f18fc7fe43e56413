"""Building blocks shared by the vision encoder and both language models: `dense`, `Embedding`, M-RoPE.

- `dense(d_in, d_out, std, bias=False)`: an `ops.Linear` (nn.Dense, weight [out, in] as torch Linear) with
  a normal init and a zero bias.
- `Embedding(vocab, dim, std)`: the token table `weight` [V, D] read by one Gather primitive (a primitive
  instance, so the parallel layer can give it a strategy); the parameter name is HF's `embed_tokens.weight`.
- `MRotaryEmbedding(rot_dim, theta, mrope_section, layout)`: position_ids int32[3, B, L] holding (t, h, w)
  -> cos, sin float32[B, 1, L, rot_dim] in the rotate-half layout. Frequency pair j is driven by the axis
  `mrope_pair_axis(mrope_section, layout)[j]`; the same assignment repeats for the second half of the dims.
  The dense model rotates its whole head_dim, MLA only its decoupled rope dims: the module is the same,
  `rot_dim` is what differs. For text tokens t = h = w, so every layout is plain 1D RoPE.
"""
import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from mindvl_ms.ops.linear import Linear


def dense(d_in: int, d_out: int, std: float, bias: bool = False) -> Linear:
    """`ops.Linear` [d_in -> d_out] with weights ~ Normal(std) and a zero bias when `bias`."""
    return Linear(d_in, d_out, weight_init=Normal(std), bias_init="zeros", has_bias=bias)


class Embedding(nn.Cell):
    """Token embedding table `weight` [V, D] (a gather, as torch nn.Embedding)."""

    def __init__(self, vocab: int, dim: int, std: float):
        super().__init__()
        self.weight = Parameter(initializer(Normal(std), (vocab, dim), ms.float32), name="weight")
        self.gather = ops.Gather()

    def construct(self, ids):  # int32 [B, L] -> [B, L, D]
        return self.gather(self.weight, ids, 0)


def mrope_pair_axis(mrope_section, layout: str = "chunked") -> np.ndarray:
    """int64[sum(mrope_section)]: the position axis (0 t, 1 h, 2 w) that drives each rotary frequency pair.

    - chunked (Qwen2.5-VL): the first sec_t pairs read t, the next sec_h read h, the last sec_w read w,
      so h and w get only the lowest frequencies;
    - interleaved (Qwen3-VL's `apply_interleaved_mrope`): pair j reads h if j % 3 == 1 and j < 3 * sec_h,
      w if j % 3 == 2 and j < 3 * sec_w, t otherwise (TextConfig.validate checks the section fits);
    - spread (openPangu-VL's 3D-IM-RoPE, any split such as 1:6 t:(h+w)): axis a's k_a pairs have the
      evenly spaced ideal slots (i + 0.5) * n / k_a; merging all slots in order (ties t, h, w) gives each
      pair its axis, so every axis spans high to low frequencies; an equal split gives thw thw ...
    """
    sec = [int(n) for n in mrope_section]
    if layout == "chunked":
        return np.repeat(np.arange(3), sec)
    j = np.arange(sum(sec))
    if layout == "interleaved":
        axis = np.zeros(j.size, np.int64)
        axis[(j % 3 == 1) & (j < 3 * sec[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * sec[2])] = 2
        return axis
    if layout != "spread":
        raise ValueError(f"mrope layout {layout!r}: expected chunked, interleaved or spread")
    slots = [((i + 0.5) * j.size / k, a) for a, k in enumerate(sec) for i in range(k)]
    return np.array([a for _, a in sorted(slots)], np.int64)


class MRotaryEmbedding(nn.Cell):
    """position_ids int32[3, B, L] -> cos, sin float32[B, 1, L, rot_dim] (M-RoPE, rotate-half layout)."""

    def __init__(self, rot_dim: int, theta: float, mrope_section, layout: str = "chunked"):
        super().__init__()
        half = rot_dim // 2
        owner = mrope_pair_axis(mrope_section, layout)  # which of t/h/w drives frequency pair j
        if owner.size != half:
            raise ValueError(f"mrope_section {list(mrope_section)} sums to {owner.size}, the rotary dims "
                             f"{rot_dim} need {half} pairs")
        inv = 1.0 / (theta ** (np.arange(0, rot_dim, 2, dtype=np.int64).astype(np.float32) / rot_dim))
        self.inv_freq = Tensor(inv.astype(np.float32))  # [half]
        sel = np.zeros((3, half), np.float32)
        sel[owner, np.arange(half)] = 1.0
        self.select = Tensor(sel)  # [3, half] one-hot per pair

    def construct(self, position_ids):
        pos = position_ids.astype(ms.float32)  # [3, B, L]
        freqs = pos[..., None] * self.inv_freq  # [3, B, L, half]
        # the driving axis of each pair: exact, since the selection is one-hot
        freqs = (freqs * self.select[:, None, None, :]).sum(0)  # [B, L, half]
        emb = ops.cat((freqs, freqs), -1)[:, None]  # [B, 1, L, rot]
        return ops.cos(emb), ops.sin(emb)
