"""MindVL: vision encoder + patch-merger projector + language model (Qwen3/Qwen2 dense or DeepSeek-V3 MoE).

Inputs are the arrays of `mindvl_ms.data.collate.build_model_inputs` in INPUT_NAMES order: the row
dimension first, every index local to its row (the contract that lets a data-parallel rank's rows mean
the same in the global graph). The graph adds the row offsets itself (`flat_vision_inputs`) and runs the
ViT over all rows' patches as one packed sequence; the merge of visual features into the <|image_pad|> /
<|video_pad|> positions (`merge`) is a batched per-row gather over the row's concat(text embeddings, visual
features) with a host-computed index, so `construct` has no value-dependent control flow and one compiled
graph (dynamic shapes via `set_dynamic_inputs`, or the static shapes of a stage's `RowBudget`) serves
every sequence length and image size.

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


def _row_offsets(b: int, step):
    """int32[B, 1]: r * step, the start of row r in a flattened [B * step] axis."""
    return (ops.arange(b, dtype=ms.int32) * step).reshape(b, 1)


def _flat_blocks(gather, seg, patches: int):
    """Row-local block layout (gather [B, S, W] padded with P, 1-based block ids seg [B, P]) -> the packed
    sequence's ([B*S, W] padded with B*P, [B*P] ids of the flattened blocks): row r's blocks become
    r*S+1 .. r*S+S (a row's unused blocks stay empty)."""
    b, s, w = gather.shape
    n = b * patches
    valid = (gather < patches).astype(ms.int32)
    flat = (gather + _row_offsets(b, patches).reshape(b, 1, 1)) * valid + n * (1 - valid)
    return flat.reshape(b * s, w), (seg + _row_offsets(b, s)).reshape(-1)


def flat_vision_inputs(pixel_values, vision_pos_ids, window_index, reverse_index, window_segment_ids,
                       full_segment_ids, window_gather, full_gather):
    """The row-local vision inputs [B, P, ...] (data.collate) -> the flat inputs of `VisionTransformer` over
    all rows' patches packed into one sequence of B*P (indices offset by their row's start). Built in the
    graph, from the global B, so the result is the same whichever rank built which rows."""
    b, p, k = pixel_values.shape
    units = window_index.shape[1]
    off = _row_offsets(b, units)
    flat = (pixel_values.reshape(b * p, k), vision_pos_ids.reshape(b * p, 2),
            (window_index + off).reshape(-1), (reverse_index + off).reshape(-1))
    if window_gather is None:  # dense-mask ViT: segment ids only need to differ between rows
        return flat + ((window_segment_ids + _row_offsets(b, p)).reshape(-1),
                       (full_segment_ids + _row_offsets(b, p)).reshape(-1), None, None)
    wg, ws = _flat_blocks(window_gather, window_segment_ids, p)
    fg, fs = _flat_blocks(full_gather, full_segment_ids, p)
    return flat + (ws, fs, wg, fg)


class RowMerge(nn.Cell):
    """Visual features into the text, row by row: text [B, L, D], image [B*P/4, D] (each row's merged tokens
    in its own block), row-local embed_index [B, L] -> embeddings [B, L, D]. `parallel.vit_balance.GroupMerge`
    replaces it when a tensor-parallel group splits the images (same inputs and output)."""

    def construct(self, text, image, embed_index):
        b, l, d = text.shape
        image = image.reshape(b, -1, d).astype(text.dtype)  # [B, P/4, D], row r's features
        table = ops.cat((text, image), 1)  # [B, L + P/4, D]: each row's own text and visual features
        return ops.gather(table, embed_index, 1, 1)  # [B, L, D], per-row gather (batch_dims 1)


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
        self.merge = RowMerge()

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
        image = self.visual(*flat_vision_inputs(pixel_values, vision_pos_ids, window_index, reverse_index,
                                                window_segment_ids, full_segment_ids, window_gather,
                                                full_gather))  # [B*P/4, D] merged visual tokens
        embeds = self.merge(text, image, embed_index)  # [B, L, D]
        if actual_seq_len is not None:  # row-local ends -> ends in the flattened [B*L] tokens
            actual_seq_len = (actual_seq_len + _row_offsets(b, l)).reshape(-1)
        return self.model(embeds, position_ids.transpose(1, 0, 2), segment_ids, actual_seq_len)

    def head_weight(self):
        """The LM head's [V, D] weight (the embedding table when tied): the train step's chunked head
        (`train.loss_head`) multiplies the supervised hidden states by it."""
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def logits(self, hidden):
        """[..., D] -> float32 [..., V] through lm_head (or the tied embedding table)."""
        return lm_logits(hidden, self.model.embed_tokens.weight, self.lm_head, self.tied_head)

    # -- graph set-up helpers ------------------------------------------------------------------
    def dynamic_inputs(self, budget=None):
        """Placeholder Tensors for `set_inputs`: dynamic row sizes (one compile for all shapes), or every
        size fixed by a `data.collate.RowBudget` and the micro-batch rows `budget[1]` ((RowBudget, B)).
        Constant dims (M-RoPE's 3, the patch width, the (row, col) pair) are never dynamic."""
        i32, f32 = ms.int32, ms.float32
        fix = budget is not None
        rb, b = budget if fix else (None, None)
        l, p = (rb.seq_length, rb.patches) if fix else (None, None)
        units = p // self.config.vision.spatial_merge_size ** 2 if fix else None
        win = (rb.window_blocks, rb.window_width) if fix else (None, None)
        full = (rb.full_blocks, rb.full_width) if fix else (None, None)
        return [
            Tensor(shape=[b, l], dtype=i32),  # input_ids [B, L]
            Tensor(shape=[b, 3, l], dtype=i32),  # position_ids [B, 3, L]
            Tensor(shape=[b, l], dtype=i32),  # segment_ids [B, L]
            Tensor(shape=[b, p, patch_dim(self.config)], dtype=f32),  # pixel_values [B, P, K]
            Tensor(shape=[b, p, 2], dtype=i32),  # vision_pos_ids [B, P, 2]
            Tensor(shape=[b, units], dtype=i32),  # window_index [B, P/4]
            Tensor(shape=[b, units], dtype=i32),  # reverse_index [B, P/4]
            Tensor(shape=[b, p], dtype=i32),  # window_segment_ids [B, P]
            Tensor(shape=[b, p], dtype=i32),  # full_segment_ids [B, P]
            Tensor(shape=[b, l], dtype=i32),  # embed_index [B, L]
            Tensor(shape=[b, *win], dtype=i32),  # window_gather [B, Sw, Ww]
            Tensor(shape=[b, *full], dtype=i32),  # full_gather [B, Sf, Wf]
            Tensor(shape=[b, rb.slots if fix else None], dtype=i32),  # actual_seq_len [B, K]
        ]

    def set_dynamic_inputs(self, budget=None) -> "MindVLModel":
        self.set_inputs(*self.dynamic_inputs(budget))
        return self


def cast_params(model: nn.Cell, dtype) -> nn.Cell:
    """Cast every parameter to `dtype` (e.g. ms.float16 for fp16 inference); norms and softmax still
    accumulate in float32 and logits come out in float32."""
    for p in model.get_parameters():
        p.set_dtype(dtype)
    return model
