"""Graph cells for cached generation: vision encoder, prefill and decode over a static KV cache.

The cells hold references to the sub-cells of a `MindVLModel` (its `visual`, `model`
and `lm_head` under the same attribute names), so parameters are the model's own objects with the same
names; no model file is changed and no weight is copied.

KV cache: two tensors cache_k / cache_v [layers, B, kv_heads, S, head_dim] (S = cache length, chosen by
the caller). They are graph inputs and outputs (functional updates via TensorScatterUpdate), which is what
an exported MindIR graph needs. Every new token carries its cache slot (`write_pos` int32[B, L]) and the
caller passes `kv_valid` int32[B, S] (1 = the slot holds a real token after this step's writes), so left
padding, right padding and ragged batches are all the same graph: query i of row b may attend to slot j
when kv_valid[b, j] == 1 and j <= write_pos[b, i].

Shapes (all dims dynamic except where fixed below; one compile per cell):
  VisionEncoder  pixels [N, K] (float32 normalised patches, or uint8 single-frame patches [N, C*P*P]
                 when uint8=True, see preprocess.py) + vision metadata -> image_embeds float32[M, D]
  Prefill        input_ids [B, L], position_ids [3, B, L], image_embeds [M, D], embed_index [B*L],
                 write_pos [B, L], kv_valid [B, S], last_index [B] (flat index b*L + col of the token
                 whose logits are returned), cache_k, cache_v -> logits float32[B, V], cache_k, cache_v
  Decode         input_ids [B, 1], position_ids [3, B, 1], write_pos [B, 1], kv_valid [B, S], cache_k,
                 cache_v -> logits float32[B, V], cache_k, cache_v
The attention core, norms and rotary are the model's dispatch cells (ops/), so on Ascend the same cells run
the fused kernels. Layer caches are joined with concat rather than stack: a MindIR loaded in a GraphCell
otherwise keeps the first call's output shape for later calls with another batch or cache length.
Dense Qwen3/Qwen2 language models only (the DeepSeek-V3 MLA cache is a different layout); generate.py
falls back to full-sequence forwards for other models.
"""
import mindspore as ms
from mindspore import Tensor, nn, ops

from mindvl_ms.models.text import lm_logits
from mindvl_ms.ops.attention import NEG_INF
from mindvl_ms.infer.preprocess import UInt8Normalize

VISION_META = ("vision_pos_ids", "window_index", "reverse_index", "window_segment_ids", "full_segment_ids")
PREFILL_NAMES = ("input_ids", "position_ids", "image_embeds", "embed_index", "write_pos", "kv_valid", "last_index")
DECODE_NAMES = ("input_ids", "position_ids", "write_pos", "kv_valid")


def supports_cache(config) -> bool:
    """True when the language model is a dense Qwen2/Qwen3 decoder (the layout these cells drive)."""
    return config.text.model_type in ("qwen3", "qwen2")


def cache_shape(config, batch: int, length: int):
    t = config.text
    return (t.num_hidden_layers, batch, t.num_key_value_heads, length, t.head_dim_)


def param_dtype(model):
    return model.model.embed_tokens.weight.dtype


def _write(cache, new, pos):
    """cache [B, KV, S, hd], new [B, KV, L, hd], pos int32[B, L] -> cache with new[b, :, i] at slot pos[b, i]."""
    b, kv, l, hd = new.shape
    rows = ops.broadcast_to(ops.arange(0, b, dtype=ms.int32)[:, None], pos.shape)  # [B, L]
    idx = ops.cat((rows[:, :, None], pos[:, :, None]), -1).reshape(-1, 2)  # [B*L, 2]
    upd = new.transpose(0, 2, 1, 3).reshape(-1, kv, hd)  # [B*L, KV, hd]
    out = ops.tensor_scatter_update(cache.transpose(0, 2, 1, 3), idx, upd.astype(cache.dtype))  # [B, S, KV, hd]
    return out.transpose(0, 2, 1, 3)


def cache_bias(write_pos, kv_valid):
    """Additive mask float32[B, 1, L, S] from the query slots [B, L] and the valid key slots [B, S]."""
    slots = ops.cumsum(ops.ones_like(kv_valid), 1) - 1  # [B, S] 0-based slot ids
    allowed = ops.logical_and((kv_valid > 0)[:, None, :], slots[:, None, :] <= write_pos[:, :, None])
    return (ops.logical_not(allowed).astype(ms.float32) * NEG_INF)[:, None]


class VisionEncoder(nn.Cell):
    """The model's vision tower (+ in-graph uint8 normalisation when `uint8`) -> float32 [M, D]."""

    def __init__(self, model, image_mean=None, image_std=None, uint8: bool = False):
        super().__init__()
        self.visual = model.visual
        self.uint8 = uint8
        v = model.config.vision
        self.k = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        if uint8:
            self.normalize = UInt8Normalize(v, image_mean, image_std)

    def construct(self, pixels, vision_pos_ids, window_index, reverse_index, window_segment_ids, full_segment_ids):
        if self.uint8:
            pixels = self.normalize(pixels)  # uint8 [N, C*P*P] -> float32 [N, C*T*P*P]
        out = self.visual(pixels, vision_pos_ids, window_index, reverse_index, window_segment_ids,
                          full_segment_ids)
        return out.astype(ms.float32)  # [M, D]

    def dynamic_inputs(self):
        i32 = ms.int32
        first = Tensor(shape=[None, self.normalize.frame_dim], dtype=ms.uint8) if self.uint8 else \
            Tensor(shape=[None, self.k], dtype=ms.float32)
        return [first, Tensor(shape=[None, 2], dtype=i32), Tensor(shape=[None], dtype=i32),
                Tensor(shape=[None], dtype=i32), Tensor(shape=[None], dtype=i32), Tensor(shape=[None], dtype=i32)]


class _CachedDecoder(nn.Cell):
    """Shared body: run the text decoder layers over new tokens, writing their k/v into the cache."""

    def __init__(self, model):
        super().__init__()
        if not supports_cache(model.config):
            raise NotImplementedError(f"KV-cache cells support qwen2/qwen3 language models, not "
                                      f"{model.config.text.model_type}")
        self.model = model.model  # the TextModel: embed_tokens, layers, norm, rotary_emb
        self.lm_head = model.lm_head
        self.cfg = model.config.text
        self.n_layers = self.cfg.num_hidden_layers

    def _attention(self, attn, x, cos, sin, ck, cv, write_pos, bias):
        q, k, v = attn.project_qkv(x, cos, sin)  # [B, H, L, hd], [B, KV, L, hd] x2
        ck = _write(ck, k, write_pos)  # [B, KV, S, hd]
        cv = _write(cv, v, write_pos)
        return attn.attend(q, ck, cv, bias), ck, cv

    def _decode(self, embeds, position_ids, write_pos, kv_valid, cache_k, cache_v):
        cos, sin = self.model.rotary_emb(position_ids)  # [B, 1, L, hd]
        bias = cache_bias(write_pos, kv_valid)  # [B, 1, L, S]
        x = embeds
        new_k, new_v = [], []
        for i in range(self.n_layers):
            layer = self.model.layers[i]
            h, ck, cv = self._attention(layer.self_attn, layer.input_layernorm(x), cos, sin, cache_k[i],
                                        cache_v[i], write_pos, bias)
            h, x = layer.post_attention_layernorm(h, x)  # x + h, then the norm (fused on Ascend)
            x = x + layer.mlp(h)
            new_k.append(ck[None])
            new_v.append(cv[None])
        # concat, not stack: a loaded MindIR (GraphCell) keeps Stack's first output shape across calls
        return self.model.norm(x), ops.cat(new_k, 0), ops.cat(new_v, 0)  # [layers, B, KV, S, hd]

    def _logits(self, h):  # [B, D] -> float32 [B, V]
        # 2-D straight through: a [B, 1, V] result sliced back to [B, V] cost as much as a tiny
        # decoder itself over a 151,936-token vocabulary (docs/PERFORMANCE.md, ## infer)
        return lm_logits(h, self.model.embed_tokens.weight, self.lm_head)

    def _cache_inputs(self, dtype):
        return [Tensor(shape=[self.n_layers, None, self.cfg.num_key_value_heads, None, self.cfg.head_dim_],
                       dtype=dtype)] * 2


class Prefill(_CachedDecoder):
    """Prompt tokens (with merged image features) -> last-token logits and the filled cache."""

    def construct(self, input_ids, position_ids, image_embeds, embed_index, write_pos, kv_valid, last_index,
                  cache_k, cache_v):
        b, l = input_ids.shape
        text = self.model.embed_tokens(input_ids)  # [B, L, D]
        d = text.shape[-1]
        table = ops.cat((text.reshape(-1, d), image_embeds.astype(text.dtype)), 0)  # [B*L + M, D]
        embeds = ops.gather(table, embed_index, 0).reshape(b, l, d)  # [B, L, D]
        h, cache_k, cache_v = self._decode(embeds, position_ids, write_pos, kv_valid, cache_k, cache_v)
        last = ops.gather(h.reshape(-1, d), last_index, 0)  # [B, D]
        return self._logits(last), cache_k, cache_v

    def dynamic_inputs(self, dtype):
        i32 = ms.int32
        return [Tensor(shape=[None, None], dtype=i32), Tensor(shape=[3, None, None], dtype=i32),
                Tensor(shape=[None, self.cfg.hidden_size], dtype=ms.float32), Tensor(shape=[None], dtype=i32),
                Tensor(shape=[None, None], dtype=i32), Tensor(shape=[None, None], dtype=i32),
                Tensor(shape=[None], dtype=i32)] + self._cache_inputs(dtype)


class Decode(_CachedDecoder):
    """One new token per row -> its logits and the updated cache."""

    def construct(self, input_ids, position_ids, write_pos, kv_valid, cache_k, cache_v):
        embeds = self.model.embed_tokens(input_ids)  # [B, 1, D]
        h, cache_k, cache_v = self._decode(embeds, position_ids, write_pos, kv_valid, cache_k, cache_v)
        return self._logits(h[:, 0]), cache_k, cache_v

    def dynamic_inputs(self, dtype):
        i32 = ms.int32
        return [Tensor(shape=[None, 1], dtype=i32), Tensor(shape=[3, None, 1], dtype=i32),
                Tensor(shape=[None, 1], dtype=i32), Tensor(shape=[None, None], dtype=i32)] + \
            self._cache_inputs(dtype)


def build_cells(model, image_mean=None, image_std=None):
    """(float VisionEncoder, uint8 VisionEncoder, Prefill, Decode) with dynamic inputs set."""
    dtype = param_dtype(model)
    vis_f = VisionEncoder(model)
    vis_u8 = VisionEncoder(model, image_mean, image_std, uint8=True)
    prefill, decode = Prefill(model), Decode(model)
    for cell, inputs in ((vis_f, vis_f.dynamic_inputs()), (vis_u8, vis_u8.dynamic_inputs()),
                         (prefill, prefill.dynamic_inputs(dtype)), (decode, decode.dynamic_inputs(dtype))):
        cell.set_inputs(*inputs)
    return vis_f, vis_u8, prefill, decode
