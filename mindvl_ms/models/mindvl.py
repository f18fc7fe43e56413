"""MindVL: vision encoder + patch-merger projector + language model (Qwen3/Qwen2 dense or DeepSeek-V3 MoE).

Inputs are the arrays of `mindvl_ms.data.collate.build_model_inputs` in INPUT_NAMES order; the merge
of image features into the <|image_pad|> positions is one gather over concat(text embeddings, image
features) with a host-computed index, so `construct` has no value-dependent control flow and one
compiled graph (dynamic shapes via `set_dynamic_inputs`) serves every sequence length and image size.

Outputs (the same for every configuration):
  logits      float32[B, L, V]
  aux_loss    float32[]            MoE auxiliary loss (0 for dense models)
  expert_load float32[layers, E]   tokens routed to each expert per MoE layer ([1, 1] zeros for dense)

Parameter names follow transformers' Qwen2.5-VL checkpoint layout: `visual.*`, `model.*`, `lm_head.*`.
`MindVLModel` is the Cell alone: training builds it, `checkpoint.pretrained` loads and saves it. The public
`MindVLForConditionalGeneration` (infer/hf_api.py) subclasses it with from_pretrained / save_pretrained,
keyword calls (`model(**processor(...))`) and `generate`, a host-side layer over this positional path.
"""
import mindspore as ms
from mindspore import Tensor, nn, ops

from mindvl_ms.config import MindVLConfig
from mindvl_ms.data.collate import INPUT_NAMES, patch_dim
from mindvl_ms.models.text import TextModel, TiedHead, lm_logits
from mindvl_ms.models.moe import DeepseekV3Model
from mindvl_ms.models.vision import VisionTransformer
from mindvl_ms.ops.layers import dense


def build_language_model(cfg) -> nn.Cell:
    if cfg.model_type == "deepseek_v3":
        return DeepseekV3Model(cfg)
    return TextModel(cfg)


class MindVLModel(nn.Cell):
    """Vision encoder + projector + language model + LM head over the INPUT_NAMES arrays (module docstring)."""

    INPUT_NAMES = INPUT_NAMES

    def __init__(self, config: MindVLConfig):
        super().__init__()
        self.config = config
        self.visual = VisionTransformer(config.vision)
        self.model = build_language_model(config.text)
        t = config.text
        self.tied = t.tie_word_embeddings
        self.lm_head = None if self.tied else dense(t.hidden_size, t.vocab_size, t.initializer_range)
        self.tied_head = TiedHead() if self.tied else None

    def construct(self, input_ids, position_ids, segment_ids, pixel_values, vision_pos_ids, window_index,
                  reverse_index, window_segment_ids, full_segment_ids, embed_index, window_gather, full_gather,
                  actual_seq_len):
        hidden, aux_loss, expert_load = self.hidden_states(
            input_ids, position_ids, segment_ids, pixel_values, vision_pos_ids, window_index, reverse_index,
            window_segment_ids, full_segment_ids, embed_index, window_gather, full_gather, actual_seq_len)
        return self.logits(hidden), aux_loss, expert_load

    def hidden_states(self, input_ids, position_ids, segment_ids, pixel_values, vision_pos_ids, window_index,
                      reverse_index, window_segment_ids, full_segment_ids, embed_index, window_gather=None,
                      full_gather=None, actual_seq_len=None):
        """Final normalised hidden states [B, L, D] (plus the language model's aux loss and expert load).

        Without the gathers the ViT uses its dense-mask fallback; `actual_seq_len` feeds the Ascend TND
        flash-attention kernel of the LLM (ignored on CPU)."""
        return self.hidden_states_from_embeds(
            self.model.embed_tokens(input_ids), position_ids, segment_ids, pixel_values, vision_pos_ids,
            window_index, reverse_index, window_segment_ids, full_segment_ids, embed_index, window_gather,
            full_gather, actual_seq_len)

    def hidden_states_from_embeds(self, text, position_ids, segment_ids, pixel_values, vision_pos_ids,
                                  window_index, reverse_index, window_segment_ids, full_segment_ids, embed_index,
                                  window_gather=None, full_gather=None, actual_seq_len=None):
        """`hidden_states` with the token embeddings `text` [B, L, D] looked up by the caller (the train step
        looks them up with a row-wise gradient, `train.row_grads`)."""
        b, l, d = text.shape
        image = self.visual(pixel_values, vision_pos_ids, window_index, reverse_index, window_segment_ids,
                            full_segment_ids, window_gather, full_gather)  # [M, D] merged visual tokens
        table = ops.cat((text.reshape(-1, d), image.astype(text.dtype)), 0)  # [B*L + M, D]
        embeds = ops.gather(table, embed_index, 0).reshape(b, l, d)  # [B, L, D]
        return self.model(embeds, position_ids, segment_ids, actual_seq_len)

    def head_weight(self):
        """The LM head's [V, D] weight (the embedding table when tied): the train step's chunked head
        (`train.loss_head`) multiplies the supervised hidden states by it."""
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def logits(self, hidden):
        """[..., D] -> float32 [..., V] through lm_head (or the tied embedding table)."""
        return lm_logits(hidden, self.model.embed_tokens.weight, self.lm_head, self.tied_head)

    # -- graph set-up helpers ------------------------------------------------------------------
    def dynamic_inputs(self):
        """Placeholder Tensors with dynamic dims for `set_inputs` (one compile for all shapes)."""
        i32, f32 = ms.int32, ms.float32
        return [
            Tensor(shape=[None, None], dtype=i32),  # input_ids [B, L]
            Tensor(shape=[3, None, None], dtype=i32),  # position_ids
            Tensor(shape=[None, None], dtype=i32),  # segment_ids
            Tensor(shape=[None, patch_dim(self.config)], dtype=f32),  # pixel_values [N, K]
            Tensor(shape=[None, 2], dtype=i32),  # vision_pos_ids
            Tensor(shape=[None], dtype=i32),  # window_index [N/4]
            Tensor(shape=[None], dtype=i32),  # reverse_index
            Tensor(shape=[None], dtype=i32),  # window_segment_ids [N]
            Tensor(shape=[None], dtype=i32),  # full_segment_ids
            Tensor(shape=[None], dtype=i32),  # embed_index [B*L]
            Tensor(shape=[None, None], dtype=i32),  # window_gather [Sw, Ww]
            Tensor(shape=[None, None], dtype=i32),  # full_gather [Sf, Wf]
            Tensor(shape=[None], dtype=i32),  # actual_seq_len [B*K]
        ]

    def set_dynamic_inputs(self) -> "MindVLModel":
        self.set_inputs(*self.dynamic_inputs())
        return self


def cast_params(model: nn.Cell, dtype) -> nn.Cell:
    """Cast every parameter to `dtype` (e.g. ms.float16 for fp16 inference); norms and softmax still
    accumulate in float32 and logits come out in float32."""
    for p in model.get_parameters():
        p.set_dtype(dtype)
    return model
